"""Hostile structured-output constraints: each is refused with a ValueError naming the field, before
any request enters the engine, and the engine keeps serving."""

import pytest

from cadence import LLM, SamplingParams
from cadence.request import StructuredOutputsParams as SO
from cadence.structured.compiler import DEFAULT_MAX_SPEC_CHARS

TINY = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny=True, **TINY)


BAD = [
    (SO(json='{"type": "object", "properties": '), "structured_outputs.json"),  # not JSON
    (SO(json="[1, 2]"), "structured_outputs.json"),  # not a schema object
    (SO(json={"type": "strung"}), "structured_outputs.json"),  # no such type
    (SO(json={"type": "string", "format": "no-such-format"}), "structured_outputs.json"),
    (SO(json={"type": "object", "dependentSchemas": {"a": {}}}), "structured_outputs.json"),  # unsupported keyword
    (SO(regex="(unclosed"), "structured_outputs.regex"),
    (SO(regex="a" * (DEFAULT_MAX_SPEC_CHARS + 1)), "structured_outputs.regex"),  # over the size cap
    (SO(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (SO(grammar="root ::= ("), "structured_outputs.grammar"),
    (SO(choice=["x" * 60_000, "y" * 60_000]), "structured_outputs.choice"),
]


@pytest.mark.parametrize(("spec", "field"), BAD, ids=[f"{i}-{f.split('.')[-1]}" for i, (_, f) in enumerate(BAD)])
def test_a_refused_constraint_names_its_field_and_queues_nothing(llm, spec, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.core.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_one_bad_constraint_fails_the_batch_before_any_work(llm):
    steps = llm.engine.core.scheduler.last_iteration_stats.step
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=4, structured_outputs=SO(regex="[a-z]+")),
                                       SamplingParams(max_tokens=4, structured_outputs=SO(regex="[z-a]"))],
                     use_tqdm=False)
    assert llm.engine.core.scheduler.last_iteration_stats.step == steps
