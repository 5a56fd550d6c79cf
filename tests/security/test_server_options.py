"""The HTTP-limit and CORS options: safe defaults, `cadence serve` flags, and refusals naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from cadence.cli import build_parser, http_options
from cadence.config import ServerConfig


def _config(*flags: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", *flags])
    return ServerConfig(**http_options(args)).validate()


def test_defaults_are_bounded_and_cors_is_off():
    cfg = _config()
    assert cfg == ServerConfig()
    assert (cfg.max_header_count, cfg.max_header_bytes, cfg.max_request_line_bytes) == (100, 64 << 10, 8 << 10)
    assert (cfg.header_timeout, cfg.keep_alive_timeout) == (10.0, 5.0)
    assert cfg.allowed_origins == () and not cfg.allow_credentials


def test_flags():
    cfg = _config(
        "--max-header-count", "50", "--max-header-bytes", "32KiB", "--max-request-line-bytes", "4096",
        "--header-timeout", "2.5", "--keep-alive-timeout", "1",
        "--allowed-origins", "https://a.example, https://b.example", "--allowed-origins", "http://localhost:3000",
        "--allowed-methods", "get,post,options", "--allowed-headers", "Authorization,Content-Type",
        "--allow-credentials",
    )
    assert (cfg.max_header_count, cfg.max_header_bytes, cfg.max_request_line_bytes) == (50, 32 << 10, 4096)
    assert (cfg.header_timeout, cfg.keep_alive_timeout) == (2.5, 1.0)
    assert cfg.allowed_origins == ("https://a.example", "https://b.example", "http://localhost:3000")
    assert cfg.allowed_methods == ("GET", "POST", "OPTIONS")
    assert cfg.allowed_headers == ("Authorization", "Content-Type")
    assert cfg.allow_credentials


@pytest.mark.parametrize(
    "change, field",
    [
        ({"max_header_count": 0}, "max_header_count"),
        ({"max_header_count": 2.5}, "max_header_count"),
        ({"max_header_bytes": 100}, "max_header_bytes"),
        ({"max_request_line_bytes": 128 << 10}, "max_request_line_bytes"),  # over max_header_bytes
        ({"header_timeout": 0}, "header_timeout"),
        ({"keep_alive_timeout": float("inf")}, "keep_alive_timeout"),
        ({"allowed_origins": ("",)}, "allowed_origins"),
        ({"allowed_origins": ("*",), "allow_credentials": True}, "allow_credentials"),
    ],
)
def test_bad_values_are_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        dataclasses.replace(ServerConfig(), **change).validate()


def test_vllm_server_flags_and_routes(cli_server_factory):
    """--served-model-name with several names, --enable-log-requests, --uvicorn-log-level, and the
    /version and /ping routes, as a vLLM user would use them (a real `cadence serve`)."""
    import httpx

    from cadence import __version__

    server = cli_server_factory("--served-model-name", "first", "second", "--enable-log-requests",
                                "--uvicorn-log-level", "warning", "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    models = httpx.get(server.url + "/v1/models", headers=auth, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["first", "second"]
    for name in ("first", "second"):
        r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "first"  # the first name answers
    r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=30,
                   json={"model": "third", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and "'first' or 'second'" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/version", headers=auth, timeout=30).json() == {"version": __version__}
    assert httpx.get(server.url + "/version", timeout=30).status_code == 401  # guarded like every route
    for method in ("GET", "POST"):  # a health probe: open, as /health is
        assert httpx.request(method, server.url + "/ping", timeout=30).json() == {"status": "ok"}
    log = server.log()
    assert log.count("request cmpl-") == 2 and "prompt(s) of" in log  # one line per admitted request
    assert "INFO:     127.0.0.1" not in log  # uvicorn's access lines are below --uvicorn-log-level
