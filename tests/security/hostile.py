"""Strategies for hostile input and the checks every answer must pass.

The hypothesis tests here run `CADENCE_FUZZ_EXAMPLES` examples each: 100 by default (a few seconds
in `make test`); raise it for a longer run, e.g.

    CADENCE_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest -q tests/security
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_EXAMPLES = int(os.environ.get("CADENCE_FUZZ_EXAMPLES", "100"))

fuzz_settings = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,  # a generation's time follows the machine's load, not the example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Floats where arithmetic goes wrong: signed zero, subnormals, values that are 0 or inf in float32,
# the largest double, the sampling epsilon on either side, and what JSON can only spell as NaN/Infinity.
EXTREME_FLOATS = [
    0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1e-300, 1e-45, 1.1754943508222875e-38, 1e-30, 9.99e-6,
    1e-5, 1.0000001e-5, 0.01, 0.5, 1.0, 2.0, 10.0, 100.0, 100.00001, 1e30, 3.4028235e38, 1e300,
    sys.float_info.max, -sys.float_info.max, -1e-300, -5e-324, -1.0, -2.0, -100.0,
    math.nan, math.inf, -math.inf,
]

extreme_floats = st.one_of(
    st.sampled_from(EXTREME_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.floats(min_value=-1e-300, max_value=1e-300, allow_subnormal=True),
)

# Every float sampling field, as SamplingParams and the request bodies both spell it.
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")

huge_ints = st.one_of(
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]),
    st.integers(min_value=-(2**70), max_value=2**70),
)

json_scalars = st.one_of(
    st.none(), st.booleans(), huge_ints, extreme_floats, st.text(max_size=24),
    st.sampled_from(["", "0", "1.5", "NaN", "\x00", "\ud7ff", "💥" * 3, "a" * 300]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def encode(body: Any) -> bytes:
    """JSON as Python writes it: NaN and Infinity as bare literals, which JSON itself does not have."""
    return json.dumps(body, allow_nan=True).encode()


# -- the checks -------------------------------------------------------------------------------------

ERROR_STATUSES = {400, 404, 408, 413, 415, 429}


def check_error(status: int, body: bytes) -> dict[str, Any]:
    """An OpenAI-shaped error with a status that says whose fault it is; returns its `error`."""
    assert status in ERROR_STATUSES, (status, body[:500])
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and isinstance(err["code"], str), err
    assert err.get("param") is None or isinstance(err["param"], str), err
    return err


def sse_events(text: str) -> list[Any]:
    """The events of a finished stream, `[DONE]` last; each other event is a JSON object."""
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text[:300]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def json_numbers_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(json_numbers_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(json_numbers_finite(v) for v in value)
    return True
