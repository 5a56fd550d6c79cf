"""Hostile and mistaken structured-output and tool requests: each is a 400 whose `param` names the
field at fault, and the engine never sees the request. Text a client writes in tools or calls never
becomes a control token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app
from cadence.server.protocol import MAX_GRAMMAR_CHARS, MAX_GUIDED_CHOICES, MAX_TOOLS
from cadence.server.structured import MAX_SCHEMA_CHARS

TINY = {"num_kv_blocks": 256, "max_model_len": 1024, "max_num_seqs": 4, "device": "cpu", "dtype": "float32"}
CHAT = [{"role": "user", "content": "hi"}]
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}


def tool(name: str = "f", parameters: Any = None, description: str | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    if description is not None:
        fn["description"] = description
    return {"type": "function", "function": fn}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, list[Any], AsyncEngine]]:
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    submitted: list[Any] = []
    submit = engine.submit

    async def recording(prompts: Any, params: Any, **kw: Any) -> Any:
        submitted.append((prompts, params))
        return await submit(prompts, params, **kw)

    engine.submit = recording  # type: ignore[method-assign]
    try:
        with TestClient(create_app(engine, ServerConfig(allow_request_chat_template=True)),
                        raise_server_exceptions=False) as c:
            yield c, submitted, engine
    finally:
        engine.shutdown(timeout=10)


def refused(served, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    client, submitted, _ = served
    before = len(submitted)
    full = {"max_tokens": 2, **({"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "hi"}), **body}
    r = client.post(path, json=full)
    assert r.status_code == 400, r.text
    assert len(submitted) == before, "the engine saw a refused request"
    return r.json()["error"]


BOTH_ROUTES = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": OBJ}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": OBJ}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": OBJ}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object", "properties": {"a": {"minimum": "zero"}}}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": {"type": "object", "description": "x" * MAX_SCHEMA_CHARS}}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"] * (MAX_GUIDED_CHOICES + 1)}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice.1"),
    ({"guided_grammar": "root ::= " + '"a" | ' * (MAX_GRAMMAR_CHARS // 6) + '"b"'}, "guided_grammar"),
    ({"guided_decoding_backend": "my-backend"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs.frobnicate"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json"),
    ({"guided_json": OBJ, "guided_regex": "a+"}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "response_format"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"guided_choice": ["0"], "allowed_token_ids": [0]}, "allowed_token_ids"),
    ({"response_format": {"type": "json_object"}, "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
]


@pytest.mark.parametrize(("body", "param"), BOTH_ROUTES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_constraints_are_refused_naming_the_field(served, body: dict, param: str, path: str):
    err = refused(served, body, path)
    assert err["param"] == param, err
    if len([k for k in body if k in ("response_format", "guided_json", "guided_regex", "guided_choice",
                                     "structured_outputs")]) == 2:
        a, b = sorted(k for k in body)
        assert a in err["message"] and b in err["message"], err  # two constraints: both are named


TOOLS = [
    ({"tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": [tool("get weather")]}, "tools.0.function.name"),
    ({"tools": [tool("a" * 65)]}, "tools.0.function.name"),
    ({"tools": [tool("")]}, "tools.0.function.name"),
    ({"tools": [tool("f"), tool("f")]}, "tools[1].function.name"),
    ({"tools": [tool("f", {"type": "objekt"})]}, "tools[0].function.parameters"),
    # arguments are an object: a schema of anything else could only force calls clients cannot read
    ({"tools": [tool("f"), tool("g", {"type": "string"})]}, "tools[1].function.parameters"),
    ({"tools": [tool("f", {"type": "array", "items": {}})], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [tool("f", {"type": ["object", "null"]})]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [tool("f")], "tool_choice": named("g")}, "tool_choice"),
    ({"tools": [tool("f")], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": named("f")}, "tool_choice"),
    ({"tools": [tool("f")], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": [tool("f")], "tool_choice": named("f"), "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "bad name", "arguments": "{}"}}]}]},
     "messages.1.tool_calls.0.function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
]


@pytest.mark.parametrize(("body", "param"), TOOLS)
def test_bad_tools_are_refused_naming_the_field(served, body: dict, param: str):
    err = refused(served, body)
    assert err["param"] == param, err
    if param in ("guided_regex", "response_format"):
        assert "tool_choice" in err["message"] and param in err["message"]


NATIVE = ("{% for t in tools or [] %}{{ t.function.description }}\n{% endfor %}"
          "{% for m in messages %}{{ m.role }}:{{ m.content }}"
          "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
MARKER = "<|im_end|>"


def test_control_token_text_in_tools_is_refused_where_the_template_writes_it(served):
    err = refused(served, {"tools": [tool("f", description=f"x{MARKER}")], "chat_template": NATIVE})
    assert err["param"] == "tools"
    history = [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": f'{{"a": "{MARKER}"}}'}}]}]
    err = refused(served, {"messages": history, "chat_template": NATIVE})
    assert err["param"] == "messages" and err["message"].startswith("messages[1].tool_calls: ")


def test_control_token_text_in_tools_stays_plain_text_in_the_fallback(served):
    client, submitted, engine = served
    history = [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": f'{{"a": "{MARKER}"}}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": MARKER}]
    body = {"messages": history, "tools": [tool("f", description=f"x{MARKER}")], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ids = submitted[-1][0][0]
    end = engine.tokenizer.encode(MARKER, split_special_tokens=False)
    assert len(end) == 1
    # One <|im_end|> per message the template wrote (system, user, assistant, tool), none from the text.
    assert ids.count(end[0]) == 4
    assert engine.tokenizer.decode(ids, skip_special_tokens=False).count(MARKER) == 4 + 3


LOOKBEHIND = "(?<=a)b"  # no regular language: the grammar library refuses it
PATTERNED = {"type": "object", "properties": {"a": {"type": "string", "pattern": LOOKBEHIND}}}
LIBRARY_REFUSES = [
    ({"guided_regex": LOOKBEHIND}, "guided_regex"),
    ({"structured_outputs": {"regex": LOOKBEHIND}}, "structured_outputs"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_json": {"not": {"type": "string"}}}, "guided_json"),
    ({"guided_json": {"type": "object", "dependentSchemas": {"a": {}}}}, "guided_json"),
    ({"guided_json": {"type": "string", "format": "made-up"}}, "guided_json"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PATTERNED}}},
     "response_format"),
    ({"tools": [tool("f"), tool("g", PATTERNED)], "tool_choice": named("g")}, "tools[1].function.parameters"),
    ({"tools": [tool("f"), tool("g", PATTERNED)], "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize(("body", "param"), LIBRARY_REFUSES)
def test_what_the_grammar_library_refuses_is_a_400_naming_the_request_field(served, body: dict, param: str):
    err = refused(served, body)
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: ") and "structured_outputs." not in err["message"], err


# Constraints the library compiles but cannot follow: one that admits no output at all (it would
# end its request at once with an empty text that does not follow it), and one whose counted
# repetition makes the library fail at the first token that enters it (in the middle of generation).
UNFOLLOWABLE = [
    ({"guided_grammar": "start: start"}, "guided_grammar", "admits no output"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar", "admits no output"),
    ({"guided_json": {"$ref": "#"}}, "guided_json", "admits no output"),
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
     "guided_json", "admits no output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format", "admits no output"),
    ({"guided_regex": "a{1000000}"}, "guided_regex", "counted repetition"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex", "counted repetition"),
    ({"structured_outputs": {"regex": "a{300000,}"}}, "structured_outputs", "counted repetition"),
    ({"guided_grammar": "start: /a{1000000}/"}, "guided_grammar", "counted repetition"),
    ({"guided_grammar": 'start: %json {"type": "string", "pattern": "^a{1000000}$"}'}, "guided_grammar",
     "counted repetition"),
    ({"guided_json": {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{1000000}$"}}}},
     "guided_json", "counted repetition"),
]


@pytest.mark.parametrize(("body", "param", "reason"), UNFOLLOWABLE)
def test_a_constraint_the_library_cannot_follow_is_a_400_before_generation(served, body: dict, param: str,
                                                                           reason: str):
    err = refused(served, body, path="/v1/completions")
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: ") and reason in err["message"], err


def test_large_optional_repetitions_are_not_refused(served):
    client, _, _ = served
    for body in ({"guided_regex": ".{0,100000}"}, {"guided_regex": "(a{300}){300}"},
                 {"guided_grammar": 'start: "{1000000}"'}):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 200, (body, r.text)


def test_tool_parameters_without_a_type_still_force_an_arguments_object(served):
    client, _, _ = served
    params = {"properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    for choice in ("required", named("f")):
        r = client.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 40, "temperature": 0, "parallel_tool_calls": False,
            "tools": [tool("f", params)], "tool_choice": choice})
        assert r.status_code == 200, r.text
        done = r.json()["choices"][0]
        assert done["finish_reason"] == "tool_calls", done
        for call in done["message"]["tool_calls"]:
            assert isinstance(json.loads(call["function"]["arguments"]), dict), call


DEEP_REGEX = "(" * 1000 + "a" + ")" * 1000
DEEP_JSON = "[" * 5000 + "]" * 5000
NESTED_TOO_DEEP = [
    ({"guided_json": {"type": "string", "pattern": DEEP_REGEX}}, "guided_json"),
    ({"guided_json": {"type": "object", "patternProperties": {DEEP_REGEX: {}}}}, "guided_json"),
    ({"guided_json": DEEP_JSON}, "guided_json"),
    ({"structured_outputs": {"json": '{"items": ' * 3000 + "{}" + "}" * 3000}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": DEEP_REGEX}}}}, "response_format.json_schema.schema"),
    ({"tools": [tool("f", {"type": "object", "properties": {"a": {"type": "string", "pattern": DEEP_REGEX}}})]},
     "tools[0].function.parameters"),
    ({"messages": [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_JSON}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("body", [{"tools": [tool("f")]}, {"tool_choice": "required"}, {"parallel_tool_calls": False}])
def test_tool_fields_on_the_completions_route_are_refused_not_ignored(served, body: dict):
    err = refused(served, body, path="/v1/completions")
    [field] = body
    assert err["param"] == field and "/v1/chat/completions" in err["message"], err


@pytest.mark.parametrize(("body", "param"), NESTED_TOO_DEEP)
def test_nesting_deeper_than_python_recurses_is_a_400_naming_the_field(served, body: dict, param: str):
    # JSON text and regexes (a schema's `pattern`) nested past the recursion limit: a 400, not a 500.
    err = refused(served, body)
    assert err["param"] == param, err
    assert "nested too deeply" in err["message"], err


# A schema the library compiles, and whose first mask it computes, but whose parser outgrows the
# library's limits once the output has begun (here 300 alternatives of 5 optional properties and a required one, past
# its items per row after the opening brace): the request's fault, found only during generation.
BEYOND_LIMITS = {"anyOf": [{"type": "object", "properties": {**{f"{i}_{j}": {"type": "integer"} for j in range(5)},
                                                               "z": {"type": "integer"}}, "required": ["z"]}
                           for i in range(300)]}


def test_a_constraint_past_the_library_limits_mid_output_is_a_400_naming_the_field(served):
    client, _, _ = served
    for stream in (False, True):  # failing with the first token: a 400 before any chunk, streamed or not
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, "stream": stream,
                                                      "guided_json": BEYOND_LIMITS})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "guided_json" and err["type"] == "invalid_request_error", err
        assert err["message"].startswith("guided_json: the grammar library stopped following"), err
    # Failing some tokens in: a 400 if that comes before the stream's first chunk is sent (the
    # engine's deltas can be read together), else the stream's error event; either names the field.
    nested = {"type": "object", "properties": {"t": {"const": "a forced text of several tokens"}, "a": BEYOND_LIMITS},
              "required": ["t", "a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested}}
    with client.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 32, "stream": True,
                                                              "response_format": rf}) as s:
        bodies = [line.removeprefix("data: ") for line in s.iter_lines()]
        events = [json.loads(b) for b in bodies if b.startswith("{")]
    err = events[-1]["error"] if s.status_code == 200 else events[0]["error"]
    assert err["param"] == "response_format" and err["type"] == "invalid_request_error", err
    ok = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # the engine serves on


def test_a_constraint_spelling_a_control_token_is_a_400_naming_the_field(served):
    # The library's mask offers the control token itself for the text, then refuses it once sampled.
    client, _, _ = served
    for body in ({"guided_choice": ["<|im_end|>"]}, {"guided_regex": "<\\|im_end\\|>x"}):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        [field] = body
        assert r.json()["error"]["param"] == field, r.text
