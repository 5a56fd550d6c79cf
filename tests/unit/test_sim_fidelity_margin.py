"""A profile's validation (sim/real ratios) turns into an error band for `cadence sim` and a safe
replica count for `cadence sim plan`."""

from __future__ import annotations

import pytest

from cadence.cli import main
from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel
from cadence.sim.fidelity import RatioSpread, Validation, band, safe_bound
from cadence.sim.plan import Objective, format_plan, plan
from cadence.workload import Workload, WorkloadRequest

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}


def _validation(low: float, median: float = 0.9, high: float = 1.0) -> dict:
    spread = {"median": median, "low": low, "high": high, "cells": 9, "within": 6}
    return {"date": "2026-12-01", "machine": "test", "workloads": ["chat"], "seeds": [0, 1], "loads": [0.3, 0.85],
            "ratios": {f"{m}_p{q}": spread for m in ("ttft", "itl", "e2e") for q in (50, 90, 99)}}


def test_ratio_spread_counts_cells_within_fifteen_percent():
    s = RatioSpread.of([0.5, 0.9, 1.0, 1.1, 1.2])
    assert s.median == 1.0 and s.cells == 5 and s.within == 3  # 0.9, 1.0, 1.1 (1.2 is 20% off)
    assert s.low == pytest.approx(0.66) and s.high == pytest.approx(1.16)
    with pytest.raises(ValueError):
        RatioSpread.of([])


def test_validation_round_trips_through_a_profile_and_reads_the_nearest_percentile_above():
    v = Validation.from_profile({"validation": _validation(0.8)})
    assert v is not None and Validation.from_profile({"validation": v.as_dict()}) == v
    assert v.spread_for("ttft", 95) is v.spreads["ttft_p99"]
    assert v.spread_for("ttft", 50) is v.spreads["ttft_p50"]
    assert v.spread_for("queue", 50) is None
    assert v.gated_within() == (6 * 6, 9 * 6)  # p50 and p90 of three metrics; p99 not gated
    assert Validation.from_profile({}) is None and Validation.from_profile({"validation": "x"}) is None


def test_an_optimistic_simulator_tightens_the_bound_and_widens_the_band():
    opt = RatioSpread(0.8, 0.5, 0.95, 9, 3)
    assert safe_bound(1.0, opt) == 0.5
    assert safe_bound(1.0, RatioSpread(1.1, 1.02, 1.2, 9, 9)) == 1.0  # pessimistic: no margin
    assert safe_bound(1.0, None) == 1.0
    lo, hi = band(0.3, opt)
    assert lo == pytest.approx(0.3 / 0.95) and hi == pytest.approx(0.6)


def _steady(n: int, gap: float) -> Workload:
    return Workload("steady", tuple(WorkloadRequest(arrival_time=i * gap, prompt_tokens=32, output_tokens=20)
                                    for i in range(n)))


def test_plan_adds_the_margin_its_profile_measured():
    """100 ms per step, one request every 50 ms, one sequence per replica: the raw count holds
    TTFT p95 under 0.5 s; with a simulator that was twice too optimistic it must hold 0.25 s."""
    cfg = EngineConfig.from_options(max_num_seqs=1, num_kv_blocks=256)
    slo = [Objective.parse("ttft_p95=0.5")]
    exact = plan(_steady(60, 0.05), cfg, StepCostModel("tokens", {"const": 0.1}, META), slo, max_replicas=64)
    assert exact.best is not None and exact.safe is None and "no validation" in format_plan(exact)

    model = StepCostModel("tokens", {"const": 0.1}, {**META, "validation": _validation(0.5)})
    res = plan(_steady(60, 0.05), cfg, model, slo, max_replicas=64)
    assert res.best is not None and res.best.replicas == exact.best.replicas
    assert res.safe_objectives[0].bound == pytest.approx(0.25)
    assert res.safe is not None and res.safe.margin and res.safe.values["ttft_p95"] <= 0.25
    assert res.safe.replicas > res.best.replicas
    below = [t for t in res.trials if t.margin and t.replicas == res.safe.replicas - 1]
    assert below and not below[0].meets  # the count just under the safe one was tried and failed
    text = format_plan(res)
    assert f"cheapest: {res.best.replicas} replicas" in text and f"safe: {res.safe.replicas} replicas" in text

    pessimistic = StepCostModel("tokens", {"const": 0.1}, {**META, "validation": _validation(1.05, 1.1, 1.2)})
    same = plan(_steady(60, 0.05), cfg, pessimistic, slo, max_replicas=64)
    assert same.safe is same.best and "not optimistic" in format_plan(same)


def test_cadence_sim_prints_the_band_or_says_there_is_none(tmp_path, capsys):
    profile = StepCostModel("tokens", {"const": 0.01}, {**META, "validation": _validation(0.5)})
    path = profile.save(tmp_path / "p.json")
    assert main(["sim", "--workload", "chat", "--num-requests", "10", "--rate", "2", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fidelity: validated 2026-12-01 on test" in out and "real likely" in out and "ttft p50" in out
    bare = StepCostModel("tokens", {"const": 0.01}, META).save(tmp_path / "bare.json")
    assert main(["sim", "--workload", "chat", "--num-requests", "10", "--rate", "2", "--profile", str(bare)]) == 0
    assert "no error band" in capsys.readouterr().out
