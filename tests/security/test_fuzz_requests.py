"""Fuzzing /v1/completions and /v1/chat/completions with bodies built from strategies, valid-ish and
hostile (wrong types, extreme numbers, NaN and Infinity literals, deep and odd nesting, broken JSON,
bad tenants), against the app in-process on the tiny model. Whatever comes in, the answer is never a
5xx: an OpenAI-shaped error with a client-error status, or a well-formed response (its choices, its
usage, or a stream of JSON events ending in `[DONE]`).

`CADENCE_FUZZ_EXAMPLES` sets the examples per test (hostile.py); a few seconds by default.
"""

from __future__ import annotations

import json
from typing import Any

from hostile import (
    check_error,
    encode,
    fuzz_settings,
    json_numbers_finite,
    json_values,
    sse_events,
)
from hypothesis import event, given
from hypothesis import strategies as st

from cadence.server.protocol import ChatCompletionResponse, CompletionResponse

token_ids = st.one_of(st.integers(0, 49151), st.integers(0, 49151), st.sampled_from([49152, -1, 2**31, 2**63]))
unit_floats = st.floats(0.0, 1.0) | st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-5, 1.0])
penalties = st.floats(-2.0, 2.0) | st.sampled_from([-0.0, 5e-324, -1e-300, 2.0, -2.0])

# Each field's valid-ish values (in range, with its edges); any field may also get `json_values`.
SAMPLING = {
    "model": st.sampled_from(["cadence-tiny-random", "gpt-4"]),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0.0, 2.0) | st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 9.99e-6, 2.0]),
    "top_p": unit_floats,
    "top_k": st.integers(-1, 60),
    "min_p": unit_floats,
    "seed": st.integers(0, 2**63 - 1),
    "presence_penalty": penalties,
    "frequency_penalty": penalties,
    "repetition_penalty": st.floats(0.01, 10.0) | st.sampled_from([1e-300, 0.01, 10.0]),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "stop_token_ids": st.lists(token_ids, max_size=4),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49160).map(str), st.floats(-100.0, 100.0), max_size=3),
    "allowed_token_ids": st.lists(token_ids, min_size=1, max_size=4),
    "user": st.text(max_size=30),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "speculative": st.booleans() | st.sampled_from(["no", 0, None]),
    "priority": st.integers(-10, 10),
    "deadline": st.sampled_from([1e-9, 0.5, 30.0, 86400.0]),
    "response_format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}}}]),
    "guided_choice": st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
    "guided_regex": st.sampled_from(["[ab]{1,3}", "(", "a{99999}", "\\d+"]),
    "guided_json": st.sampled_from([{"type": "integer"}, {"type": "objekt"}, "{", {"enum": [1, "a", None]}]),
    "structured_outputs": st.fixed_dictionaries({}, optional={"choice": st.lists(st.text(max_size=3), max_size=2),
                                                             "regex": st.text(max_size=5)}),
}
max_tokens = st.integers(1, 4) | st.sampled_from([64, 2**20])
prompt = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(token_ids, min_size=1, max_size=8),
    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
    st.lists(st.lists(token_ids, min_size=1, max_size=5), min_size=1, max_size=3),
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "user"]),
     "content": st.text(max_size=40) | st.lists(
         st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2)},
    optional={"name": st.text(max_size=10)},
)
COMPLETION = {
    **SAMPLING,
    "max_tokens": max_tokens,
    "logprobs": st.integers(0, 20),
    "echo": st.just(False),
    "best_of": st.integers(1, 2),
}
CHAT = {
    **SAMPLING,
    "max_tokens": max_tokens,
    "max_completion_tokens": max_tokens,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "chat_template": st.sampled_from(["{{ messages }}", "{% for m in messages %}{{ m.content }}{% endfor %}"]),
    "add_generation_prompt": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", "bad name", ""])},
        optional={"parameters": st.sampled_from([{"type": "object"}, {"type": "nope"}, {}]),
                  "description": st.text(max_size=12)})}), max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": st.booleans(),
}


@st.composite
def bodies(draw, required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> dict:
    """A body, valid-ish, with one hostile field, or hostile throughout; now and then unknown keys
    or a required field missing."""
    mode = draw(st.sampled_from(["valid", "one bad field", "hostile"]))
    names = draw(st.lists(st.sampled_from(sorted(optional)), max_size=6, unique=True))
    fields = {**required, **{k: optional[k] for k in names}}
    if mode != "valid" and draw(st.integers(0, 9)) == 0:
        fields.pop(next(iter(required)))
    bad = draw(st.sampled_from(sorted(fields))) if fields and mode == "one bad field" else None
    body = {}
    for name, valid in fields.items():
        hostile_value = mode == "hostile" and draw(st.booleans()) or name == bad
        body[name] = draw(json_values if hostile_value else valid)
    if mode != "valid":
        body.update(draw(st.dictionaries(st.text(max_size=12), json_values, max_size=2)))
    return body


def raw_bytes(body: st.SearchStrategy) -> st.SearchStrategy:
    """The body encoded, or mangled: cut short, a stray byte, not JSON at all, not an object, deep."""
    mangle = st.sampled_from(["as is", "cut", "byte", "list", "deep", "junk"])

    def apply(args: tuple[Any, str, int]) -> bytes:
        b, how, k = args
        data = encode(b)
        if how == "cut":
            return data[: k % max(1, len(data))]
        if how == "byte":
            i = k % max(1, len(data))
            return data[:i] + bytes([k % 256]) + data[i:]
        if how == "list":
            return encode([b])
        if how == "deep":
            return b"[" * (k % 400) + b"1" + b"]" * (k % 400)
        if how == "junk":
            return bytes([k % 256]) * (k % 7)
        return data

    return st.tuples(body, st.one_of(st.just("as is"), st.just("as is"), mangle), st.integers(0, 10**6)).map(apply)


tenants = st.one_of(st.none(), st.sampled_from(["acme", "a" * 64, "a" * 65, "bad tenant", "x\ty", "é", ""]))


def send(client, path: str, data: bytes, tenant: str | None):
    headers = {"Content-Type": "application/json"}
    if tenant is not None:
        headers["X-Tenant"] = tenant.encode()  # raw bytes: a header is not text
    return client.post(path, content=data, headers=headers)


def check_answer(r, response_model) -> None:
    event(f"status {r.status_code}")  # the mix of outcomes: pytest --hypothesis-show-statistics
    assert r.status_code < 500, (r.status_code, r.text[:1000])
    if r.status_code != 200:
        check_error(r.status_code, r.content)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        for sent in sse_events(r.text):
            if "error" in sent:
                check_error(400, json.dumps(sent).encode())  # the shape; the status was sent already
            else:
                assert "choices" in sent and json_numbers_finite(sent), sent
        return
    body = r.json()
    response_model.model_validate(body)
    assert body["choices"] and json_numbers_finite(body)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


@fuzz_settings
@given(data=raw_bytes(bodies({"prompt": prompt}, COMPLETION)), tenant=tenants)
def test_fuzzed_completions_never_fail_the_server(app_client, data, tenant):
    check_answer(send(app_client, "/v1/completions", data, tenant), CompletionResponse)


@fuzz_settings
@given(data=raw_bytes(bodies({"messages": st.lists(message, min_size=1, max_size=3)}, CHAT)),
       tenant=tenants)
def test_fuzzed_chat_completions_never_fail_the_server(app_client, data, tenant):
    check_answer(send(app_client, "/v1/chat/completions", data, tenant), ChatCompletionResponse)


def test_the_engine_holds_nothing_after_the_fuzzing(app_client):
    """Every request the fuzzing sent has ended: nothing queued, running or held by the server."""
    app = app_client.app
    engine, serving = app.state.engine, app.state.serving
    assert engine.is_healthy and engine.num_in_flight == 0 and not engine.core.has_unfinished_requests()
    assert serving.active == 0 and not serving.tenant_in_flight
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
