"""StructuredOutputsParams: one constraint per request, schemas kept as canonical JSON text."""

from dataclasses import replace

import pytest

from cadence.request import SamplingParams, StructuredOutputsParams


def test_equal_schemas_share_one_canonical_text():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert a.json == b.json and a == b and hash(a) == hash(b)
    assert a.kind == "json"


@pytest.mark.parametrize("kwargs", [{}, {"regex": "a+", "choice": ["a"]}, {"json_object": True, "grammar": "x"}])
def test_exactly_one_constraint(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"choice": []}, {"choice": ["a", 1]}, {"regex": 3}, {"json": 7}])
def test_bad_shapes_name_the_field(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_a_constrained_request_never_travels_as_a_plain_decode_row():
    # The mask must reach the sampler, which a DecodeBatch row (last token in, next token out) skips.
    assert SamplingParams().plain_decode
    assert not SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])).plain_decode
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_structured_outputs_params_comes_from_the_package_as_sampling_params_does():
    import cadence

    assert cadence.StructuredOutputsParams is StructuredOutputsParams
    assert "StructuredOutputsParams" in cadence.__all__


def test_allowed_token_ids_with_a_constraint_is_refused_naming_both_fields():
    # Both are hard masks: their intersection may be empty at some step, leaving nothing to sample
    # (offline this used to emit a token the grammar refused). The server refuses the pair too.
    constraint = StructuredOutputsParams(regex="[a-z]{3}")
    with pytest.raises(ValueError, match=r"^allowed_token_ids: cannot be combined with structured_outputs"):
        SamplingParams(allowed_token_ids=[5, 6], structured_outputs=constraint)
    with pytest.raises(ValueError, match=r"^allowed_token_ids: cannot be combined with structured_outputs"):
        replace(SamplingParams(structured_outputs=constraint), allowed_token_ids=(5, 6))
    assert SamplingParams(allowed_token_ids=[5, 6]).allowed_token_ids == (5, 6)
