"""Structured output and tool calls through the fleet (two tiny replicas behind one endpoint): the
output follows its schema, streamed and not, and a constraint the grammar library refuses is a 400
from the ingress, naming the request's field, before any replica sees the request."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "unsure"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "score", "sure"], "additionalProperties": False}
ARGS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": ARGS}}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
NAMED_TOOL = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def _chat(client: httpx.Client, stream: bool, **extra: Any) -> tuple[httpx.Response, dict[str, Any]]:
    """The response and the message it carries (put back together from the deltas when streamed)."""
    body = {"messages": ASK, "max_tokens": 64, "temperature": 1, "seed": 5, "stream": stream, **extra}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r, r.json()["choices"][0]["message"] | {"finish_reason": r.json()["choices"][0]["finish_reason"]}
    message: dict[str, Any] = {"content": "", "tool_calls": {}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                delta = choice["delta"]
                message["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    got = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    got["name"] += call.get("function", {}).get("name") or ""
                    got["arguments"] += call.get("function", {}).get("arguments") or ""
                if choice.get("finish_reason"):
                    message["finish_reason"] = choice["finish_reason"]
    calls = message.pop("tool_calls")
    message["tool_calls"] = [{"function": calls[i]} for i in sorted(calls)]
    return r, message


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_response_follows_its_schema(fleet, stream: bool) -> None:
    with httpx.Client(base_url=fleet.url, timeout=120) as c:
        r, message = _chat(c, stream, response_format=RESPONSE_FORMAT)
    assert r.headers["x-cadence-replica"]
    assert message["finish_reason"] == "stop", message
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_gets_a_call_with_schema_valid_arguments(fleet, stream: bool) -> None:
    with httpx.Client(base_url=fleet.url, timeout=120) as c:
        r, message = _chat(c, stream, **NAMED_TOOL)
    assert r.headers["x-cadence-replica"]
    assert message["finish_reason"] == "tool_calls", message
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ARGS)


LOOKBEHIND = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}  # no regular language


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": LOOKBEHIND}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": LOOKBEHIND}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
])
def test_a_schema_the_grammar_library_refuses_is_a_400_from_the_ingress(fleet, extra: dict, param: str) -> None:
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    assert "x-cadence-replica" not in r.headers  # refused before any replica saw it


# Compiled by the ingress and the replica alike, but past the library's limits once the output has
# begun (300 alternatives, each 5 optional properties and a required one, after the opening brace).
BEYOND_LIMITS = {"anyOf": [{"type": "object", "properties": {**{f"{i}_{j}": {"type": "integer"} for j in range(5)},
                                                               "z": {"type": "integer"}}, "required": ["z"]}
                           for i in range(300)]}


def test_a_constraint_the_library_stops_following_on_a_replica_is_a_400_naming_the_field(fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "guided_json": BEYOND_LIMITS})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_json" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("guided_json: the grammar library stopped following"), error
