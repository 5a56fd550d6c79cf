"""Structured output and tool calls end to end: a real server (uvicorn, the tiny random model: its
output is noise, so whatever structure comes back is the grammar's doing) and the `openai` client,
used as a vLLM or OpenAI user uses it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel

ARGS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "metric": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": ARGS}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


class Verdict(BaseModel):
    answer: Literal["yes", "no", "unsure"]
    confident: bool


@pytest.fixture(scope="module")
def oai(server) -> Iterator[tuple[OpenAI, str]]:
    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client, client.models.list().data[0].id


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_parse_helper_gets_a_valid_model_back(oai, temperature):
    client, model = oai
    done = client.chat.completions.parse(model=model, messages=ASK, response_format=Verdict, max_tokens=64,
                                         temperature=temperature, seed=3)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Verdict), done
    assert Verdict.model_validate_json(done.choices[0].message.content) == parsed


@pytest.mark.parametrize("stream", [False, True])
def test_guided_choice_returns_one_of_the_choices(oai, stream):
    client, model = oai
    choices = ["positive", "negative", "neutral"]
    for route in ("chat", "completions"):
        if route == "chat":
            out = client.chat.completions.create(model=model, messages=ASK, n=3, max_tokens=16, stream=stream,
                                                 extra_body={"guided_choice": choices})
            texts = _chat_texts(out, stream, 3)
        else:
            out = client.completions.create(model=model, prompt="The review was", n=3, max_tokens=16, stream=stream,
                                            extra_body={"guided_choice": choices})
            texts = _completion_texts(out, stream, 3)
        assert all(t in choices for t in texts), (route, texts)


def _chat_texts(out, stream: bool, n: int) -> list[str]:
    if not stream:
        return [c.message.content for c in out.choices]
    texts = [""] * n
    for chunk in out:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    return texts


def _completion_texts(out, stream: bool, n: int) -> list[str]:
    if not stream:
        return [c.text for c in out.choices]
    texts = [""] * n
    for chunk in out:
        for c in chunk.choices:
            texts[c.index] += c.text
    return texts


def test_guided_regex_and_json_schema_on_completions(oai):
    client, model = oai
    out = client.completions.create(model=model, prompt="A code:", max_tokens=16, n=2,
                                    extra_body={"guided_regex": "[A-F]{2}-[0-9]{3}"})
    assert all(re.fullmatch("[A-F]{2}-[0-9]{3}", c.text) for c in out.choices), out
    out = client.completions.create(model=model, prompt="JSON:", max_tokens=64, temperature=1.0,
                                    extra_body={"structured_outputs": {"json": ARGS}})
    jsonschema.validate(json.loads(out.choices[0].text), ARGS)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_tool_always_gets_schema_valid_arguments(oai, temperature):
    client, model = oai
    done = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, CLOCK], n=4, max_tokens=64, temperature=temperature,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in done.choices:
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), ARGS)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_required_calls_stream_as_deltas_the_client_puts_back_together(oai):
    client, model = oai
    with client.chat.completions.stream(model=model, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                        max_tokens=96, temperature=1.0, seed=11) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and final.choices[0].finish_reason == "tool_calls"
    assert deltas  # the arguments came as argument deltas
    schemas = {"get_weather": ARGS, "get_time": CLOCK["function"]["parameters"]}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def test_a_named_tool_streamed_gives_the_same_call_shape(oai):
    client, model = oai
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=64, stream=True, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    first, arguments, finish = None, "", None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    assert first is None
                    first = tc
                arguments += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert first is not None and first.index == 0 and first.type == "function"
    assert first.function.name == "get_weather"
    jsonschema.validate(json.loads(arguments), ARGS)
    assert finish == "tool_calls"


def test_a_conversation_with_a_call_and_its_result_goes_on(oai):
    client, model = oai
    done = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          max_tokens=96)
    message = done.choices[0].message
    call = message.tool_calls[0]
    follow = [*ASK, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    again = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER], max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
