"""Counting the repetitions a regex forces: nested lower bounds multiply, upper bounds, escapes and
character classes do not count; offline, a constraint over the limit fails the batch before any work."""

import pytest

from cadence import LLM, SamplingParams
from cadence.request import StructuredOutputsParams as SO
from cadence.structured.repetition import check_forced_repeat, forced_repeat


@pytest.mark.parametrize(("regex", "count"), [
    ("abc", 1),
    ("a{1000000}", 1_000_000),
    ("a{300000,}", 300_000),
    ("(a{1000}){1000}", 1_000_000),
    ("(?:x{10}){10}", 100),
    ("(a{2}b{3}){4}", 12),
    ("[0-9]{3}-[0-9]{4}", 4),
    (".{0,1000000}", 1),
    (r"\x{100000}", 1),
    (r"\p{L}{5}", 5),
    ("[a{9999999}]", 1),
])
def test_forced_repeat(regex: str, count: int):
    assert forced_repeat(regex) == count


def test_check_names_the_field_and_skips_string_literals_of_a_grammar():
    with pytest.raises(ValueError, match=r"^guided_regex: a counted repetition forces 1,000,000"):
        check_forced_repeat(SO(regex="a{1000000}"), "guided_regex")
    check_forced_repeat(SO(grammar='start: "a{1000000}"'), "guided_grammar")
    with pytest.raises(ValueError, match="^f: "):
        check_forced_repeat(SO(json='{"patternProperties": {"^x{200000}$": {}}}'), "f")


def test_offline_generate_refuses_an_unfollowable_constraint_before_any_work():
    llm = LLM(tiny=True, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=32, max_num_seqs=2)
    for spec in (SO(regex="a{1000000}"), SO(grammar="start: start")):
        with pytest.raises(ValueError, match=r"^structured_outputs\.(regex|grammar): "):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
