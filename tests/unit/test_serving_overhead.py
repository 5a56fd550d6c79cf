"""The serving overhead from closed-loop decode traffic (`decode_overhead`): through a fleet, each
replica runs its share of the clients at once, and its steps are priced at that share."""

from __future__ import annotations

import dataclasses
import random

import pytest

from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.sim.profile import default_profile_path
from cadence.sim.serving import OUTPUT_TOKENS, PROMPT_TOKENS, decode_overhead

PER_STEP, PER_SEQ = 0.004, 0.0007


def _steps() -> StepCostModel:
    return dataclasses.replace(StepCostModel.load(default_profile_path()), overhead={}, request_path={})


def _decode_step(model: StepCostModel, n: int) -> float:
    ctx = PROMPT_TOKENS + OUTPUT_TOKENS // 2
    return model.predict(StepFeatures(decode_seqs=n, sampled=n, decode_context=n * ctx, decode_padded=n * ctx))


class FakeFleet:
    """Closed-loop runs against `replicas` replicas that split the clients evenly: each gap is a
    decode step of the replica's share, plus the overhead, plus symmetric jitter."""

    def __init__(self, model: StepCostModel, replicas: int) -> None:
        self.model, self.replicas, self.clients = model, replicas, []
        self.rng = random.Random(3)

    def __call__(self, url: str, users: int, rounds: int, vocab: int) -> list[float]:
        self.clients.append(users)
        n = users // self.replicas
        base = _decode_step(self.model, n) + PER_STEP + PER_SEQ * n
        jitter = [self.rng.uniform(-0.002, 0.002) for _ in range(50 * users * rounds)]
        return [base + j for j in jitter] + [base - j for j in jitter] + [base]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_fleets_overhead_is_fitted_from_its_replicas_share_of_the_clients(replicas):
    model = _steps()
    fleet = FakeFleet(model, replicas)
    fit = decode_overhead("http://fleet", model, 8000, replicas=replicas, batches=(1, 4, 16), rounds=2, loop=fleet)
    assert fleet.clients == [replicas, 4 * replicas, 16 * replicas]  # every replica runs the batch at once
    assert fit["per_step"] == pytest.approx(PER_STEP, rel=1e-6)
    assert fit["per_seq"] == pytest.approx(PER_SEQ, rel=1e-6)
    assert fit["replicas"] == replicas
    assert [r["batch"] for r in fit["runs"]] == [1, 4, 16]
    assert [r["modelled_step_s"] for r in fit["runs"]] == [_decode_step(model, n) for n in (1, 4, 16)]


def test_a_replica_slower_than_its_steps_is_never_fitted_a_negative_overhead():
    model = _steps()

    def fast(url: str, users: int, rounds: int, vocab: int) -> list[float]:
        return [_decode_step(model, users // 2) * 0.5] * 10  # faster than the model: nothing to add

    fit = decode_overhead("http://fleet", model, 8000, replicas=2, batches=(1, 4), loop=fast)
    assert fit["per_step"] == 0.0 and fit["per_seq"] == 0.0


def test_bad_replicas_and_an_empty_run_are_refused():
    model = _steps()
    with pytest.raises(ValueError, match="replicas"):
        decode_overhead("http://fleet", model, 8000, replicas=0, loop=FakeFleet(model, 1))
    with pytest.raises(RuntimeError, match="no inter-token gaps"):
        decode_overhead("http://fleet", model, 8000, loop=lambda *a: [])
