"""POST routes take JSON only (a web page cannot post text/plain or a form without a CORS preflight),
CORS is off unless origins are given, a preflight is answered only for an allowed origin, and API
keys still guard every route with CORS on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from serve_process import CliServer, start_cli_server

from cadence.server.app import OPEN_PATHS

KEY = "sk-test"
GOOD = "https://good.example"
EVIL = "https://evil.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODIES = {
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    "/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [15]},
}


@pytest.fixture(scope="module")
def guarded() -> Iterator[CliServer]:
    """API key and CORS for one origin."""
    live = start_cli_server("--api-key", KEY, "--allowed-origins", GOOD)
    try:
        yield live
    finally:
        live.stop()
        live.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def plain() -> Iterator[CliServer]:
    """The defaults: no key, no CORS."""
    live = start_cli_server()
    try:
        yield live
    finally:
        live.stop()
        live.log_path.unlink(missing_ok=True)


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def _post_paths(server: CliServer) -> list[str]:
    """The POST routes that take a JSON body (the liveness probes take none)."""
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    return sorted(path for path, ops in schema["paths"].items() if "post" in ops and path not in OPEN_PATHS)


def test_every_post_route_refuses_bodies_that_are_not_json(guarded):
    paths = _post_paths(guarded)
    assert set(paths) == set(BODIES), paths
    payload = json.dumps({"prompt": "x"}).encode()
    cases = {
        "text/plain": "'text/plain'",
        "text/plain; charset=utf-8": "'text/plain; charset=utf-8'",
        "application/x-www-form-urlencoded": "'application/x-www-form-urlencoded'",
        "multipart/form-data; boundary=x": "'multipart/form-data; boundary=x'",
        None: "no Content-Type",
    }
    with httpx.Client(base_url=guarded.url, timeout=30) as c:
        for path in paths:
            for content_type, named in cases.items():
                headers = dict(AUTH) if content_type is None else {**AUTH, "Content-Type": content_type}
                r = c.post(path, content=payload, headers=headers)
                err = _error(r, 415, "unsupported_media_type")
                assert named in err["message"] and "application/json" in err["message"], err
                assert err["type"] == "invalid_request_error"


def test_json_content_types_are_served(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        for path, body in BODIES.items():
            for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
                # What `curl -H 'Content-Type: application/json' -d ...` sends.
                r = c.post(path, content=json.dumps(body).encode(), headers={**AUTH, "Content-Type": content_type})
                assert r.status_code == 200, (path, content_type, r.text)
    oai = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert oai.completions.create(model="cadence-tiny-random", prompt="x", max_tokens=2).usage.completion_tokens == 2
    reply = oai.chat.completions.create(
        model="cadence-tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason == "length"


def _preflight(server: CliServer, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )


def test_cors_is_off_by_default(plain):
    r = _preflight(plain, GOOD)
    assert r.status_code == 405
    assert not any(h.startswith("access-control-") for h in r.headers)
    r = httpx.get(plain.url + "/v1/models", headers={"Origin": GOOD}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # A page of any origin cannot post without a preflight: the kinds of body it could send are refused.
    r = httpx.post(plain.url + "/v1/completions", content=b'{"prompt": "x"}',
                   headers={"Origin": EVIL, "Content-Type": "text/plain"}, timeout=30)
    _error(r, 415, "unsupported_media_type")


def test_preflight_is_answered_only_for_an_allowed_origin(guarded):
    r = _preflight(guarded, GOOD)  # carries no key, as browsers send it: answered all the same
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == GOOD
    assert {"GET", "POST"} <= {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in r.headers
    r = _preflight(guarded, EVIL)
    err = _error(r, 400, "cors_refused")
    assert "origin" in err["message"]
    assert "access-control-allow-origin" not in r.headers
    _error(_preflight(guarded, GOOD, method="DELETE"), 400, "cors_refused")


def test_cross_origin_responses_and_keys(guarded):
    body = {"prompt": "x", "max_tokens": 1}
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        # No key: still 401, with the CORS header so that the page can read why.
        r = c.post("/v1/completions", json=body, headers={"Origin": GOOD})
        _error(r, 401, "invalid_api_key")
        assert r.headers["access-control-allow-origin"] == GOOD
        r = c.post("/v1/completions", json=body, headers={**AUTH, "Origin": GOOD})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
        # Another origin gets no CORS header: its page cannot read the answer.
        r = c.post("/v1/completions", json=body, headers={**AUTH, "Origin": EVIL})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_every_route_but_liveness_still_needs_the_key_with_cors_on(guarded):
    schema = httpx.get(guarded.url + "/openapi.json", headers=AUTH, timeout=30).json()
    routes = [(path, method.upper()) for path, ops in schema["paths"].items() for method in ops]
    routes += [("/openapi.json", "GET"), ("/docs", "GET")]
    assert len(routes) >= 10
    with httpx.Client(base_url=guarded.url, timeout=30) as c:
        for path, method in routes:
            concrete = re.sub(r"\{[^}]+\}", "cadence-tiny-random", path)
            for headers in ({"Origin": GOOD}, {"Origin": GOOD, "Authorization": "Bearer sk-bad"}):
                r = c.request(method, concrete, headers={**headers, "Content-Type": "application/json"})
                if path in OPEN_PATHS:  # the liveness probes
                    assert r.status_code == 200
                else:
                    _error(r, 401, "invalid_api_key")
