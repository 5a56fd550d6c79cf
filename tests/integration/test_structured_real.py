"""On the real default model (SmolLM2-135M-Instruct, whose chat template knows nothing of tools, so
the fallback prompt offers them): a forced call names the function and fills its arguments from
the question, and the openai client's `parse` helper gets its model back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from pydantic import BaseModel

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}


class Capital(BaseModel):
    country: Literal["France", "Spain", "Italy"]
    is_capital: bool


@pytest.fixture(scope="module")
def oai() -> Iterator[tuple[OpenAI, str]]:
    engine = AsyncEngine(build_engine(EngineConfig.from_options(max_model_len=2048, num_kv_blocks=256)))
    try:
        with TestClient(create_app(engine, ServerConfig())) as http:
            client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
            yield client, engine.model_name
    finally:
        engine.shutdown(timeout=10)


def test_a_named_tool_call_takes_its_arguments_from_the_question(oai):
    client, model = oai
    done = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=40)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()


def test_parse_on_the_real_model(oai):
    client, model = oai
    done = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Paris is the capital of which country? Answer in JSON."}],
        response_format=Capital, temperature=0, max_tokens=40)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.country == "France", done
