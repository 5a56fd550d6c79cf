"""Structured output in the engine: outputs follow their grammar in every sampling mode, alone and
batched with unconstrained requests, through preemption and chunked prefill; a grammar's end ends
the request; a budget too small ends it with "length"."""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence import LLM, SamplingParams
from cadence.request import StructuredOutputsParams as SO

TINY = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "num_kv_blocks": 256, "max_num_seqs": 32}
PROMPT = [1, 422, 2542, 314, 253, 1095, 28]  # any ids: the tiny model's weights are random


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny=True, **TINY)


# -- a property-based set of schemas: bounded so that a random model can finish them --------------
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    # (no unbounded-precision "number": a random model may write decimals past any budget)
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.lists(st.sampled_from(["red", "green", "blue", "a b", 'q"t']), min_size=1, max_size=4, unique=True)
    .map(lambda vs: {"enum": vs}),
    st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,6}$"}, {"type": "string", "pattern": "^[0-9]{2}-[A-Z]$"}]),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    names = st.lists(st.sampled_from(["id", "name", "tags", "x", "kind", "val"]), min_size=1, max_size=3, unique=True)
    return names.flatmap(lambda ks: st.lists(children, min_size=len(ks), max_size=len(ks)).map(
        lambda vs: {"type": "object", "properties": dict(zip(ks, vs, strict=True)), "required": list(ks),
                    "additionalProperties": False}))


_schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        children.map(lambda c: {"type": "array", "items": c, "maxItems": 3}),
        st.lists(children, min_size=2, max_size=2).map(lambda cs: {"anyOf": cs}),
    ),
    max_leaves=5,
).map(lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"],
                                                       "additionalProperties": False})


def _check(schema: dict, text: str) -> None:
    jsonschema.validate(json.loads(text), schema)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas)
def test_outputs_validate_against_their_schema_sixteen_at_once_mixed_with_plain_requests(llm, schema):
    so = SO(json=schema)
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=so),
              *(SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=so) for i in range(7)),
              *(SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=200, structured_outputs=so)
                for _ in range(4)),
              *(SamplingParams(temperature=t, max_tokens=12) for t in (0.0, 1.0, 0.7, 0.0))]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for p, o in zip(params, outs, strict=True):
        c = o.outputs[0]
        if p.structured_outputs is None:
            assert len(c.token_ids) == 12 or c.finish_reason == "stop"
            continue
        assert c.finish_reason == "stop", (schema, c.text)
        _check(schema, c.text)


def test_a_constrained_request_alone_validates_at_temperature_0_and_1(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                               "n": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                               {"type": "null"}]}},
              "required": ["name", "tags", "n"], "additionalProperties": False}
    for temperature in (0.0, 1.0):
        out = llm.generate([PROMPT], SamplingParams(temperature=temperature, seed=5, max_tokens=200,
                                                    structured_outputs=SO(json=schema)), use_tqdm=False)
        c = out[0].outputs[0]
        assert c.finish_reason == "stop"
        _check(schema, c.text)
        assert list(json.loads(c.text)) == ["name", "tags", "n"]  # properties in the schema's order


def test_choice_returns_one_of_the_choices_and_regex_matches(llm):
    choices = ["yes", "no", "maybe so", "n/a (\"quoted\")"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=SO(choice=choices))
              for i in range(6)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=SO(regex=r"[0-9]{3}-[a-z]{2,4}"))
               for i in range(4)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for o in outs[:6]:
        assert o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop"
    for o in outs[6:]:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.outputs[0].text), o.outputs[0].text


def test_json_object_gives_an_object(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=SO(json_object=True)),
                       use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may nest deeper than the budget: the prefix is still an object's start
        assert out.finish_reason == "length" and out.text.startswith("{")


def test_a_grammar_in_lark_and_in_gbnf(llm):
    for grammar in ('start: "ab" ("c" | "d")+ "!"', 'root ::= "ab" ("c" | "d")+ "!"'):
        out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                                    structured_outputs=SO(grammar=grammar)), use_tqdm=False)
        c = out[0].outputs[0]
        assert re.fullmatch(r"ab[cd]+!", c.text) and c.finish_reason == "stop", c.text


def test_a_budget_too_small_ends_with_length_and_the_valid_prefix(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=2, max_tokens=4,
                                                structured_outputs=SO(regex="[0-9]{50}")), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4
    assert re.fullmatch("[0-9]+", c.text)


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                structured_outputs=SO(choice=["alpha", "beta"])), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in ("alpha", "beta")


def test_n_choices_each_follow_the_grammar_and_seeds_replay(llm):
    so = SO(regex=r"[a-z]{3,8}")
    p = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20, structured_outputs=so)
    first = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs
    again = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs
    assert all(re.fullmatch("[a-z]{3,8}", c.text) for c in first)
    assert [c.text for c in first] == [c.text for c in again]


SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                           "b": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                            "maximum": 999}, "maxItems": 4}},
          "required": ["a", "b"], "additionalProperties": False}


def _greedy(llm_: LLM, prompts: list[list[int]]) -> list[str]:
    p = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SO(json=SCHEMA))
    outs = llm_.generate(prompts, [p] * len(prompts), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_greedy_output_alone_equals_batched_preempted_and_chunked(llm):
    long_prompt = list(range(5, 205))
    alone = _greedy(llm, [long_prompt])[0]
    _check(SCHEMA, alone)
    batched = llm.generate([long_prompt, PROMPT, PROMPT[::-1]],
                           [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SO(json=SCHEMA)),
                            SamplingParams(temperature=1.0, max_tokens=40),
                            SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json_object=True))],
                           use_tqdm=False)
    assert batched[0].outputs[0].text == alone
    # Few KV blocks: requests growing together preempt each other (by recompute).
    small = LLM(tiny=True, **{**TINY, "num_kv_blocks": 40, "block_size": 16})
    outs = small.generate([long_prompt] * 4, [SamplingParams(temperature=0.0, max_tokens=80,
                                                             structured_outputs=SO(json=SCHEMA))] * 4, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].text for o in outs] == [alone] * 4
    chunked = LLM(tiny=True, **{**TINY, "max_num_batched_tokens": 32})
    assert _greedy(chunked, [long_prompt]) == [alone]


def test_each_step_masks_only_its_constrained_sampling_rows(llm):
    runner = llm.engine.core.executor
    seen: list[tuple[set[str], tuple[str, ...] | None]] = []
    execute = runner.execute

    def recording(out):
        seen.append(({r.request_id for r in out.scheduled if r.sample and r.sampling_params.structured_outputs},
                     out.grammar.request_ids if out.grammar is not None else None))
        return execute(out)

    runner.execute = recording
    try:
        llm.generate([PROMPT] * 4, [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(choice=["ab"])),
                                    SamplingParams(temperature=1.0, max_tokens=6, structured_outputs=SO(regex="[a-z]{6}")),
                                    SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                                    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)], use_tqdm=False)
    finally:
        del runner.execute
    assert seen
    for constrained, masked in seen:
        assert (masked is None) == (not constrained)
        assert set(masked or ()) == constrained and len(masked or ()) == len(constrained)
    assert any(m is None for _, m in seen)  # steps with plain rows only carry no mask at all


def test_a_grammar_that_fails_in_the_step_its_request_ends_reports_the_error(llm):
    """A matcher that fails (a token it refused, the library's limits) while the request ends in
    the same step (end-of-sequence, the token budget) ends it with "error", not "stop"."""
    from cadence.boundary import RequestDelta
    from cadence.request import Request

    core = llm.engine.core
    structured = core.structured
    spec = SO(choice=["yes"])
    request = Request("grammar-fails", [1, 2], SamplingParams(max_tokens=4, structured_outputs=spec))
    structured.attach([request])
    refused = next(t for t in range(structured.vocab_size) if not structured.validate(spec).matcher()
                   .try_consume_tokens([t]))
    for reason in ("stop", "length"):
        structured.attach([request])
        (end,) = structured.advance([RequestDelta("grammar-fails", (refused,), finish_reason=reason)])
        assert end.request_id == "grammar-fails" and end.error, end
    assert not structured.active
    structured.attach([request])
    (final,) = core._advance_grammars([RequestDelta("grammar-fails", (refused,), finish_reason="stop")])
    assert final.finish_reason == "error" and final.error and final.new_token_ids == (refused,), final
