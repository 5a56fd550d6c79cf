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
    assert back.request_delay_for(550) == 0.008  # no per-token term: the constant, whatever the prompt
    assert _base().request_delay == 0.0  # a profile without one: no delay
    m = dataclasses.replace(_base(), request_path={"per_request": 0.004, "per_prompt_token": 2e-6})
    back = StepCostModel.load(m.save(tmp_path / "q.json"))
    assert back.request_path == {"per_request": 0.004, "per_prompt_token": 2e-6}
    assert back.request_delay_for(500) == pytest.approx(0.004 + 500 * 2e-6)


@pytest.mark.parametrize("bad", [{"per_reqest": 0.01}, {"per_request": -0.001}, {"per_request": float("nan")},
                                 {"per_request": 0.01, "per_prompt_tokens": 1e-6},
                                 {"per_request": 0.01, "per_prompt_token": -1e-6}])
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


def _cached_runs(model: StepCostModel, per_request: float, per_token: float) -> list[dict[str, float]]:
    """A probe's second sends as a server with this request path would time them: each prompt's
    full 16-token blocks cached, its first token the priced step plus the path."""
    runs = []
    for words, lengths in ((8, (10, 11, 10, 12, 10)), (96, (140, 138, 141, 140, 139)), (384, (560, 555, 562, 558, 560))):
        for n in lengths:
            cached = (n - 1) // 16 * 16
            m = n - cached
            step = model.predict(StepFeatures(prefill_tokens=m, prefill_seqs=1, sampled=1,
                                              prefill_attention=m * cached + m * (m + 1) // 2))
            runs.append({"words": words, "prompt_tokens": n, "cached_tokens": cached,
                         "ttft_s": step + per_request + per_token * n})
    runs[6]["ttft_s"] += 3.0  # one request the machine held up: each length's median ignores it
    return runs


def test_the_fit_recovers_a_cost_per_prompt_token_from_cached_prompts_of_several_lengths():
    model = _base()
    fit = fit_request_path(_cached_runs(model, 0.004, 1.5e-6), model)
    assert fit == {"per_request": pytest.approx(0.004, abs=1e-6), "per_prompt_token": pytest.approx(1.5e-6, rel=1e-3)}
    # Nothing a token beyond the constant: the term is 0, not noise.
    fit = fit_request_path(_cached_runs(model, 0.006, 0.0), model)
    assert fit == {"per_request": pytest.approx(0.006, abs=1e-9), "per_prompt_token": pytest.approx(0.0, abs=1e-12)}


def test_a_prompt_cached_but_for_its_last_token_is_priced_as_the_decode_row_the_engine_makes():
    # A second send of n = 16k + 1 tokens finds 16k cached: the engine computes the last token as
    # a one-token row, which it lays out as a decode row, not a prompt chunk.
    model = _base()
    runs = []
    for words, lengths in ((8, (17, 17, 17)), (96, (145, 145, 145)), (384, (561, 561, 561))):
        for n in lengths:
            row = model.predict(StepFeatures(decode_seqs=1, sampled=1, decode_context=n, decode_padded=n))
            runs.append({"words": words, "prompt_tokens": n, "cached_tokens": n - 1, "ttft_s": row + 0.004 + 2e-6 * n})
    chunk = model.predict(StepFeatures(prefill_tokens=1, prefill_seqs=1, sampled=1, prefill_attention=145))
    row = model.predict(StepFeatures(decode_seqs=1, sampled=1, decode_context=145, decode_padded=145))
    assert abs(chunk - row) > 1e-4  # (the two prices differ: the test tells them apart)
    fit = fit_request_path(runs, model)
    assert fit == {"per_request": pytest.approx(0.004, abs=1e-7), "per_prompt_token": pytest.approx(2e-6, rel=1e-3)}


def test_a_long_prompt_reaches_its_engine_later_than_a_short_one_by_the_per_token_term():
    config = EngineConfig()
    base = dataclasses.replace(_base(), request_path={"per_request": 0.01})
    per_token = dataclasses.replace(_base(), request_path={"per_request": 0.01, "per_prompt_token": 2e-5})
    reqs = (WorkloadRequest(prompt_tokens=20, output_tokens=8, arrival_time=0.0),
            WorkloadRequest(prompt_tokens=600, output_tokens=8, arrival_time=5.0))
    w = Workload("test", reqs)  # far apart: each request finds the engine idle
    plain = simulate(w, config, base, SimOptions()).records
    longer = simulate(w, config, per_token, SimOptions()).records
    for a, b, n in zip(plain, longer, (20, 600), strict=True):
        assert b.send_time == pytest.approx(a.send_time)
        assert b.ttft == pytest.approx(a.ttft + 2e-5 * n)
        assert b.e2e == pytest.approx(a.e2e + 2e-5 * n)
        assert b.itls == pytest.approx(a.itls)


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


def test_a_zero_per_token_term_simulates_exactly_as_a_profile_without_one():
    from cadence.workload import assign_arrivals, builtin_workload

    without = dataclasses.replace(_base(), request_path={"per_request": 0.00704})
    zero = dataclasses.replace(_base(), request_path={"per_request": 0.00704, "per_prompt_token": 0.0})
    w = assign_arrivals(builtin_workload("shared-prefix", 120, seed=0), "poisson", 2.0, seed=0)
    a, b = (simulate(w, EngineConfig(), m, SimOptions()).records for m in (without, zero))
    assert [(r.send_time, r.ttft, r.e2e, list(r.itls)) for r in a] == [(r.send_time, r.ttft, r.e2e, list(r.itls)) for r in b]
