"""Structured output on the default model (SmolLM2-135M-Instruct): the constrained answer is valid
and meaningful, and the same greedy request gives the same text alone and beside other traffic."""

import json

import jsonschema
import pytest

from cadence import LLM, SamplingParams
from cadence.request import StructuredOutputsParams as SO

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 40},
                         "country": {"type": "string", "minLength": 2, "maxLength": 40},
                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 50}},
          "required": ["city", "country", "population_millions"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=16, max_model_len=1024)


def test_the_default_model_answers_in_the_schema(llm):
    prompt = llm.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in JSON with "
                                                          "city, country and population_millions."}])
    p = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SO(json=SCHEMA))
    alone = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    assert alone.finish_reason == "stop"
    answer = json.loads(alone.text)
    jsonschema.validate(answer, SCHEMA)
    assert "paris" in answer["city"].lower()
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(6)]
    others += [SamplingParams(temperature=0.8, seed=i, max_tokens=80, structured_outputs=SO(json=SCHEMA))
               for i in range(6)]
    outs = llm.generate([prompt] * 13, [p, *others], use_tqdm=False)
    assert outs[0].outputs[0].text == alone.text
    for o in outs[7:]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
