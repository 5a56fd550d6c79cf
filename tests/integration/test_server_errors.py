"""Bad input gets a clear 4xx in OpenAI's error shape and leaves the server unharmed; API keys guard every route."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from starlette.routing import Route

from cadence.server.app import OPEN_PATHS

CHAT = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = "", code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "":
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture(autouse=True)
def still_healthy(server):
    yield
    # Whatever the test sent, the server still serves.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert server.wait_idle()


JSON = {"Content-Type": "application/json"}


def post(client, path, body=None, **kw):
    if body is not None:
        return client.post(path, json=body, **kw)
    return client.post(path, headers=JSON, **kw)  # raw bytes, sent as JSON


def test_invalid_json_and_non_utf8(client):
    assert_error(post(client, "/v1/completions", content=b'{"prompt": "x",'), 400, None)
    assert_error(post(client, "/v1/completions", content=b""), 400, None)
    err = assert_error(post(client, "/v1/completions", content=b'{"prompt": "\xff\xfe"}'), 400, None)
    assert "UTF-8" in err["message"]
    assert_error(post(client, "/v1/chat/completions", content=b"[1, 2]"), 400)


def test_deeply_nested_json(client):
    deep = b'{"prompt": "x", "pad": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(post(client, "/v1/completions", content=deep), 400, None)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -4}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**15}, "max_tokens"),
        ({"prompt": "x", "n": 1000}, "n"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": 1e300}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "presence_penalty": -100}, "presence_penalty"),
        ({"prompt": "x", "stop": ["s"] * 100}, "stop"),
        ({"prompt": "x", "stop": "y" * 10_000}, "stop"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "seed": -3}, "seed"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": "x", "logit_bias": {"999999999": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"notanid": 1}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_completion_fields(client, body, param):
    err = assert_error(post(client, "/v1/completions", body), 400)
    assert err["param"] and err["param"].split(".")[0] == param, err
    assert err["type"] == "invalid_request_error"


def test_nan_and_infinity_literals(client):
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        r = post(client, "/v1/completions", content=b'{"prompt": "x", "top_p": ' + literal + b"}")
        assert_error(r, 400, "top_p")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": CHAT, "max_tokens": "x"}, "max_tokens"),
        ({"messages": [{"role": "user"}], "max_tokens": 2}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": None}], "max_tokens": 2}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            "messages.1.tool_calls.0.function",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": CHAT, "top_logprobs": 2}, None),
        ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": CHAT, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_chat_fields(client, body, param):
    err = assert_error(post(client, "/v1/chat/completions", body), 400)
    if param is not None:
        assert err["param"] == param, err


def test_unknown_model_is_404(client):
    err = assert_error(
        post(client, "/v1/completions", {"prompt": "x", "model": "gpt-17"}), 404, "model", "model_not_found"
    )
    assert "gpt-17" in err["message"]
    assert_error(client.get("/v1/models/gpt-17"), 404, "model")


def test_prompt_over_the_context_names_the_lengths(client, server):
    limit = server.engine.max_model_len
    long_prompt = [15] * (limit + 10)
    err = assert_error(post(client, "/v1/completions", {"prompt": long_prompt}), 400, "prompt")
    assert str(limit + 10) in err["message"] and str(limit) in err["message"]
    err = assert_error(
        post(client, "/v1/completions", {"prompt": [15] * 1000, "max_tokens": 100}), 400, "max_tokens"
    )
    assert all(str(n) in err["message"] for n in (1000, 100, 1100, limit))


def test_body_over_the_size_limit_is_413(client):
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    assert_error(post(client, "/v1/completions", content=big), 413, None, "request_too_large")

    def chunks():  # no Content-Length: the limit applies to the bytes read
        for _ in range(40):
            yield b"a" * 65536

    r = httpx.post(client.base_url.join("/v1/completions"), content=chunks(), headers=JSON, timeout=30)
    assert_error(r, 413, None, "request_too_large")


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404, None, "not_found")
    assert_error(client.get("/v1/completions"), 405, None, "method_not_allowed")


def test_openai_client_raises_typed_errors(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="cadence-tiny-random", prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=CHAT)


# -- API keys -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(server_factory):
    return server_factory(api_keys=("sk-good",), allow_request_chat_template=True)


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "cadence-tiny-random", path)


def test_every_route_but_liveness_needs_the_key(keyed):
    routes = [r for r in keyed.app.routes if isinstance(r, Route)]
    assert len(routes) >= 10
    seen = set()
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for route in routes:
            for method in route.methods or {"GET"}:
                if method == "HEAD":
                    continue
                path = _concrete(route.path)
                seen.add(path)
                for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good"}):
                    r = c.request(method, path, headers=headers)
                    if route.path in OPEN_PATHS:  # the liveness probes
                        assert r.status_code == 200
                    else:
                        err = assert_error(r, 401, None, "invalid_api_key")
                        assert err["type"] == "authentication_error"
    assert {"/v1/completions", "/metrics", "/openapi.json", "/docs", "/ready", "/tokenize"} <= seen


def test_context_refusals_count_tokens_in_words(client, server):
    """One token is "1 token", not "1 tokens"."""
    limit = server.engine.max_model_len
    r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": limit})
    message = assert_error(r, 400, "max_tokens")["message"]
    assert message.startswith("max_tokens: the prompt has 1 token and max_tokens is"), message
    assert message.endswith(f"over this model's context of {limit} tokens"), message


def test_the_401_body_is_written_as_every_other_error(keyed):
    """The key check answers before any route: its body is the same OpenAI error, written the same
    way (compact JSON), as the 404 of a route that does not exist."""
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        refused = c.get("/v1/models")
        missing = c.get("/no-such-route", headers={"Authorization": "Bearer sk-good"})
    for r, status in ((refused, 401), (missing, 404)):
        assert_error(r, status)
        assert r.content == json.dumps(r.json(), separators=(",", ":"), ensure_ascii=False).encode()
    assert refused.headers["www-authenticate"] == "Bearer"


def test_docs_name_every_route_open_without_a_key():
    """docs/server.md's API-key section lists each route that answers without a key."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    section = docs.split("## API keys and tenants", 1)[1].split("\n## ", 1)[0]
    opening = section.strip().split("\n\n", 1)[0]
    assert all(f"`{path}`" in opening for path in OPEN_PATHS) and "preflight" in opening, opening


def test_the_key_opens_the_routes(keyed):
    oai = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-good", max_retries=0)
    assert (
        oai.completions.create(model="cadence-tiny-random", prompt="x", max_tokens=2).usage.completion_tokens
        >= 1
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-bad", max_retries=0).models.list()
    r = httpx.get(keyed.url + "/metrics", headers={"Authorization": "Bearer sk-good"})
    assert r.status_code == 200


def test_operator_may_allow_request_chat_templates(keyed):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = httpx.post(
        keyed.url + "/v1/chat/completions",
        headers={"Authorization": "Bearer sk-good"},
        timeout=60,
        json={"messages": CHAT, "chat_template": template, "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    bad = httpx.post(
        keyed.url + "/v1/chat/completions",
        headers={"Authorization": "Bearer sk-good"},
        timeout=60,
        json={"messages": CHAT, "chat_template": "{% for %}", "max_tokens": 2},
    )
    assert_error(bad, 400, "chat_template")
