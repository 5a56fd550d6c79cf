"""The structured-output and tool fields of both routes, as the engine receives them: every shape of
`response_format`, vLLM's `guided_*` and `structured_outputs`, and `tool_choice` becomes one
`SamplingParams.structured_outputs`; the chat template gets the tools (natively, or through the
documented fallback for a template that does not mention tools, as SmolLM2's does not)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.request import SamplingParams, StructuredOutputsParams
from cadence.server.app import create_app

TINY = {"num_kv_blocks": 256, "max_model_len": 1024, "max_num_seqs": 4, "device": "cpu", "dtype": "float32"}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"]}
CLOSED = {**SCHEMA, "additionalProperties": False}  # strict mode: no property the schema does not declare
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": SCHEMA}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
# A template that handles tools itself, as transformers' tool-aware templates do.
NATIVE = ("{% for t in tools or [] %}TOOL:{{ t.function.name }}\n{% endfor %}"
          "{% for m in messages %}{{ m.role }}:{{ m.content }}"
          "{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}({{ c.function.arguments | tojson }})"
          "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}")


class Recorder:
    """The engine's submit, recording what each request asked for."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.submit = engine.submit
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    async def __call__(self, prompts: Any, params: SamplingParams, **kw: Any) -> Any:
        self.calls.append((list(prompts), params))
        return await self.submit(prompts, params, **kw)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, Recorder, AsyncEngine]]:
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    recorder = Recorder(engine)
    engine.submit = recorder  # type: ignore[method-assign]
    try:
        with TestClient(create_app(engine, ServerConfig(allow_request_chat_template=True)),
                        raise_server_exceptions=False) as c:
            yield c, recorder, engine
    finally:
        engine.shutdown(timeout=10)


def ask(served, path: str, body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, Any]:
    client, recorder, _ = served
    before = len(recorder.calls)
    r = client.post(path, json={"max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    assert len(recorder.calls) == before + 1
    return recorder.calls[-1][1].structured_outputs, (r.text if body.get("stream") else r.json())


def prompt_text(served) -> str:
    _, recorder, engine = served
    return engine.tokenizer.decode(recorder.calls[-1][0][0], skip_special_tokens=False)


def so(**kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


SHAPES = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, so(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True,
                                                                 "description": "a city"}}}, so(json=CLOSED)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}, so(json=SCHEMA)),
    ({"guided_json": SCHEMA}, so(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "auto"}, so(json=SCHEMA)),
    ({"guided_regex": "[a-z]{3}", "guided_whitespace_pattern": None, "guided_decoding_backend": "xgrammar:no-fallback"},
     so(regex="[a-z]{3}")),
    ({"guided_choice": ["yes", "no"]}, so(choice=("yes", "no"))),
    ({"guided_grammar": 'root ::= "a" | "b"'}, so(grammar='root ::= "a" | "b"')),
    ({"structured_outputs": {"json": SCHEMA}}, so(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, so(json=SCHEMA)),  # JSON is compact
    ({"structured_outputs": {"regex": "x+", "disable_fallback": True}}, so(regex="x+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, so(choice=("a", "b"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, so(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, so(json_object=True)),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"o": {"type": "object"}}},
                             "disable_additional_properties": True}},
     so(json={"type": "object", "properties": {"o": {"type": "object", "additionalProperties": False}},
              "additionalProperties": False})),
]


@pytest.mark.parametrize(("fields", "want"), SHAPES)
@pytest.mark.parametrize("stream", [False, True])
def test_every_shape_reaches_the_engine_on_both_routes(served, fields: dict, want, stream: bool):
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})):
        got, _ = ask(served, path, {**body, **fields, "stream": stream})
        assert got == want, (path, fields)


def test_named_tool_forces_its_arguments_schema_closed_to_undeclared_properties(served):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    got, _ = ask(served, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER, ADD], "tool_choice": choice})
    assert got == so(json=CLOSED)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_forces_an_array_of_calls(served, parallel):
    body = {"messages": CHAT, "tools": [WEATHER, ADD], "tool_choice": "required"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    got, _ = ask(served, "/v1/chat/completions", body)
    schema = json.loads(got.json)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == (1 if parallel is False else None)
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["get_weather"], ["add"]]
    assert options[0]["properties"]["parameters"] == CLOSED and options[0]["required"] == ["name", "parameters"]
    assert options[0]["additionalProperties"] is False


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_auto_and_none_leave_the_output_free(served, choice):
    body = {"messages": CHAT, "tools": [WEATHER]}
    if choice is not None:
        body["tool_choice"] = choice
    got, answer = ask(served, "/v1/chat/completions", body)
    assert got is None
    offered = "<tools>" in prompt_text(served)
    assert offered == (choice != "none")
    assert answer["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_fallback_renders_tools_calls_and_results_into_smollm2s_prompt(served):
    history = [
        {"role": "system", "content": "Be brief."},
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    ask(served, "/v1/chat/completions", {"messages": history, "tools": [WEATHER]})
    text = prompt_text(served)
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "<tool_call>" in system
    assert json.dumps(WEATHER) in system  # the tool, as JSON, inside <tools></tools>
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text


def test_a_template_that_handles_tools_gets_them_natively(served):
    history = [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "2"}]
    ask(served, "/v1/chat/completions", {"messages": history, "tools": [WEATHER, ADD], "chat_template": NATIVE})
    text = prompt_text(served)
    assert text.startswith("TOOL:get_weather\nTOOL:add\n")
    assert 'assistant:CALL:add({"a": 2})' in text  # arguments as an object, as vLLM passes them
    assert "tool:2[c9]" in text and "<tools>" not in text


def test_tokenize_renders_tools_as_the_chat_does(served):
    client, recorder, _ = served
    history = [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    ask(served, "/v1/chat/completions", {"messages": history, "tools": [WEATHER, ADD]})
    r = client.post("/tokenize", json={"messages": history, "tools": [WEATHER, ADD]})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == recorder.calls[-1][0][0]
