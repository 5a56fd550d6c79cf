"""The request path: what a request pays outside the engine's steps, in the profile and in the
simulator (a request reaches its engine that long after it is sent)."""

from __future__ import annotations

import dataclasses

import pytest

from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.sim.profile import default_profile_path
from cadence.sim.serving import fit_request_path
from cadence.sim.simulator import SimOptions, simulate
from cadence.workload import Workload, WorkloadRequest


def _base() -> StepCostModel:
    return dataclasses.replace(StepCostModel.load(default_profile_path()), request_path={})


def _workload(*arrivals: float, prompt: int = 100, out: int = 8) -> Workload:
    reqs = tuple(WorkloadRequest(prompt_tokens=prompt, output_tokens=out, arrival_time=a) for a in arrivals)
    return Workload("test", reqs)


def test_request_path_round_trips_through_a_profile_file(tmp_path):
    m = dataclasses.replace(_base(), request_path={"per_request": 0.008, "per_prompt_token": 2e-6})
    back = StepCostModel.load(m.save(tmp_path / "p.json"))
    assert back.request_path == {"per_request": 0.008, "per_prompt_token": 2e-6}
    assert back.request_delay(500) == pytest.approx(0.008 + 500 * 2e-6)


@pytest.mark.parametrize("bad", [{"per_reqest": 0.01}, {"per_request": -0.001}, {"per_request": float("nan")}])
def test_a_malformed_request_path_is_refused(bad):
    with pytest.raises(ValueError, match="request_path"):
        dataclasses.replace(_base(), request_path=bad)


def test_fit_recovers_a_constant_and_a_per_token_cost():
    model = _base()
    runs = []
    for n in (20, 20, 21, 180, 181, 180):
        step = model.predict(StepFeatures(prefill_tokens=n, prefill_seqs=1, sampled=1,
                                          prefill_attention=n * (n + 1) // 2))
        runs.append({"prompt_tokens": n, "ttft_s": step + 0.009 + 3e-6 * n})
    runs.append({"prompt_tokens": 20, "ttft_s": 5.0})  # one request the machine held up: medians ignore it
    runs.append({"prompt_tokens": 20, "ttft_s": 0.0})
    fit = fit_request_path(runs, model)
    assert fit["per_request"] == pytest.approx(0.009, abs=2e-4)
    assert fit["per_prompt_token"] == pytest.approx(3e-6, rel=0.1)


def test_a_request_reaches_its_engine_that_much_later_and_its_ttft_counts_it():
    config = EngineConfig()
    base = _base()
    slow = dataclasses.replace(base, request_path={"per_request": 0.02, "per_prompt_token": 1e-4})
    w = _workload(0.0, 5.0, prompt=100)  # far apart: each request finds the engine idle
    plain = simulate(w, config, base, SimOptions()).records
    delayed = simulate(w, config, slow, SimOptions()).records
    for a, b in zip(plain, delayed, strict=True):
        assert b.send_time == pytest.approx(a.send_time)  # sent when the workload says
        assert b.ttft == pytest.approx(a.ttft + 0.02 + 100 * 1e-4)
        assert b.e2e == pytest.approx(a.e2e + 0.02 + 100 * 1e-4)
        assert b.itls == pytest.approx(a.itls)  # the path delays a request, not its steps


def test_a_closed_loop_user_sends_its_next_request_when_the_last_one_ends():
    config = EngineConfig()
    slow = dataclasses.replace(_base(), request_path={"per_request": 0.05, "per_prompt_token": 0.0})
    w = _workload(0.0, 0.0, 0.0)
    recs = simulate(w, config, slow, SimOptions(concurrency=1, closed_loop=True)).records
    for prev, nxt in zip(recs, recs[1:], strict=False):
        end = prev.send_time + prev.e2e
        assert nxt.send_time == pytest.approx(end)  # the path is the request's, not the user's think time
        assert nxt.ttft > 0.05
