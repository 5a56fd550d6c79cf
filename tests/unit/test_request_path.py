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
    m = dataclasses.replace(_base(), request_path={"per_request": 0.008})
    back = StepCostModel.load(m.save(tmp_path / "p.json"))
    assert back.request_path == {"per_request": 0.008}
    assert back.request_delay == pytest.approx(0.008)
    assert _base().request_delay == 0.0  # a profile without one: no delay


@pytest.mark.parametrize("bad", [{"per_reqest": 0.01}, {"per_request": -0.001}, {"per_request": float("nan")},
                                 {"per_request": 0.01, "per_prompt_token": 1e-6}])
def test_a_malformed_request_path_is_refused(bad):
    with pytest.raises(ValueError, match="request_path"):
        dataclasses.replace(_base(), request_path=bad)


def _priced(model: StepCostModel, n: int) -> float:
    return model.predict(StepFeatures(prefill_tokens=n, prefill_seqs=1, sampled=1, prefill_attention=n * (n + 1) // 2))


def test_fit_is_the_median_excess_over_the_shortest_prompts():
    model = _base()
    runs = [{"prompt_tokens": n, "ttft_s": _priced(model, n) + 0.009} for n in (9, 9, 10, 8, 9)]
    runs.append({"prompt_tokens": 9, "ttft_s": 5.0})  # one request the machine held up: the median ignores it
    runs.append({"prompt_tokens": 160, "ttft_s": _priced(model, 160) + 0.5})  # a long prompt's error: not used
    assert fit_request_path(runs, model) == {"per_request": pytest.approx(0.009)}
    # A model that prices the steps above what they took: no negative path.
    assert fit_request_path([{"prompt_tokens": 9, "ttft_s": 1e-6}], model) == {"per_request": 0.0}
    with pytest.raises(ValueError, match="no probe runs"):
        fit_request_path([], model)


def test_a_request_reaches_its_engine_that_much_later_and_its_ttft_counts_it():
    config = EngineConfig()
    base = _base()
    slow = dataclasses.replace(base, request_path={"per_request": 0.03})
    w = _workload(0.0, 5.0, prompt=100)  # far apart: each request finds the engine idle
    plain = simulate(w, config, base, SimOptions()).records
    delayed = simulate(w, config, slow, SimOptions()).records
    for a, b in zip(plain, delayed, strict=True):
        assert b.send_time == pytest.approx(a.send_time)  # sent when the workload says
        assert b.ttft == pytest.approx(a.ttft + 0.03)
        assert b.e2e == pytest.approx(a.e2e + 0.03)
        assert b.itls == pytest.approx(a.itls)  # the path delays a request, not its steps


def test_a_closed_loop_user_sends_its_next_request_when_the_last_one_ends():
    config = EngineConfig()
    slow = dataclasses.replace(_base(), request_path={"per_request": 0.05})
    w = _workload(0.0, 0.0, 0.0)
    recs = simulate(w, config, slow, SimOptions(concurrency=1, closed_loop=True)).records
    for prev, nxt in zip(recs, recs[1:], strict=False):
        end = prev.send_time + prev.e2e
        assert nxt.send_time == pytest.approx(end)  # the path is the request's, not the user's think time
        assert nxt.ttft > 0.05
