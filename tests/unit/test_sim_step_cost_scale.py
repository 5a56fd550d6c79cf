"""A machine slower or faster than the profile's (`StepCostModel.with_step_scale`, `cadence sim
--step-cost-scale`) and how fast a recorded run's steps ran (`served_fit.run_speed`), by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.sim.served_fit import run_speed
from cadence.sim.simulator import Simulator
from cadence.workload import Workload, WorkloadRequest

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}
MODEL = StepCostModel("tokens", {"const": 0.1, "num_tokens": 0.001}, META,
                      overhead={"per_step": 0.01, "per_seq": 0.002}, request_path={"per_request": 0.05})


def test_the_scale_multiplies_the_steps_and_leaves_the_server_s_costs() -> None:
    f = StepFeatures(decode_seqs=1, sampled=1, decode_context=10, decode_padded=10)
    slow = MODEL.with_step_scale(1.5)
    bare = StepCostModel("tokens", MODEL.coefficients, META)
    # the step's own part grows by half; the overhead (10 ms + 2 ms a request) stays
    assert slow.predict(f) - 0.012 == pytest.approx(1.5 * bare.predict(f))
    assert slow.request_delay == MODEL.request_delay == 0.05
    assert slow.metadata["step_cost_scale"] == 1.5
    assert MODEL.with_step_scale(1.0) is MODEL
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step scale"):
            MODEL.with_step_scale(bad)


def test_a_simulated_request_s_tokens_come_at_the_scaled_step_time() -> None:
    def token_times(model: StepCostModel) -> list[float]:
        reqs = (WorkloadRequest(arrival_time=0.0, prompt_tokens=10, output_tokens=3),)
        (rec,) = Simulator(EngineConfig.from_options(num_kv_blocks=256), model).run(Workload("t", reqs)).records
        return list(rec.token_times)

    one = StepCostModel("tokens", {"const": 0.1}, META, overhead={"per_step": 0.01}, request_path={"per_request": 0.05})
    assert token_times(one) == pytest.approx([0.16, 0.27, 0.38])  # 50 ms path, then 110 ms steps
    assert token_times(one.with_step_scale(2.0)) == pytest.approx([0.26, 0.47, 0.68])  # 210 ms steps


def _log(tmp_path, rows: list[tuple[StepFeatures, float]]):
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps({"step": i, "end": 1.0 + i, "duration": d, **f.to_dict()}) + "\n"
                            for i, (f, d) in enumerate(rows)))
    return path


def test_a_run_s_speed_is_its_steps_time_over_the_model_s_without_the_overhead(tmp_path) -> None:
    bare = StepCostModel("tokens", MODEL.coefficients, META)
    shapes = [StepFeatures(prefill_tokens=100, prefill_seqs=1, sampled=1, prefill_attention=5050),
              StepFeatures(decode_seqs=4, sampled=4, decode_context=400, decode_padded=400),
              StepFeatures(decode_seqs=1, sampled=1, decode_context=10, decode_padded=10)]
    rows = [(f, 1.2 * bare.predict(f)) for f in shapes]
    assert run_speed(MODEL, _log(tmp_path, rows)) == pytest.approx(1.2)
    # summed, not averaged: a long step weighs by its time
    rows = [(shapes[0], 2.0 * bare.predict(shapes[0])), (shapes[2], 1.0 * bare.predict(shapes[2]))]
    expect = (2.0 * bare.predict(shapes[0]) + bare.predict(shapes[2])) / (bare.predict(shapes[0]) + bare.predict(shapes[2]))
    assert run_speed(MODEL, _log(tmp_path, rows)) == pytest.approx(expect)
    with pytest.raises(ValueError, match="no step with a duration > 0 recorded"):
        run_speed(MODEL, _log(tmp_path, []))
    with pytest.raises(ValueError, match="no step with a duration > 0 recorded"):
        run_speed(MODEL, _log(tmp_path, [(shapes[0], 0.0), (shapes[1], 0.0)]))


def test_a_run_that_cannot_be_simulated_at_its_speed_says_why() -> None:
    from benchmark_scripts import load_benchmark

    bench_fleet = load_benchmark("bench_fleet")
    speed, why = bench_fleet.speed_of_run(MODEL, Path("/nonexistent/steps.jsonl"))
    assert why is not None and "missing (the run was made without --at-run-speed)" in why


def test_the_flag_slows_a_simulation_and_says_so(tmp_path, capsys) -> None:
    from cadence.cli import main

    common = ["sim", "--workload", "chat", "--num-requests", "8", "--rate", "4", "--seed", "3"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--step-cost-scale", "1.5", "--out", str(tmp_path / "b")]) == 0
    (a, b) = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert b["overall"]["itl"]["p50"] > 1.3 * a["overall"]["itl"]["p50"]
    assert any("1.5 times the profile's (--step-cost-scale)" in n for n in b["meta"]["notes"]), b["meta"]["notes"]
    assert (a["meta"]["step_cost_scale"], b["meta"]["step_cost_scale"]) == (1.0, 1.5)
    assert not any("--step-cost-scale" in n for n in a["meta"]["notes"])


@pytest.mark.parametrize("value", ["0", "abc", "11", "nan", "-1"])
def test_a_bad_value_is_one_line_naming_the_flag(value: str, capsys) -> None:
    from cadence.cli import main

    assert main(["sim", "--workload", "chat", "--num-requests", "4", "--step-cost-scale", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-cost-scale: expected a number from 0.1 to 10" in err[0], err


def test_a_factor_outside_what_the_simulator_takes_is_not_used(tmp_path) -> None:
    from benchmark_scripts import load_benchmark

    bench_fleet = load_benchmark("bench_fleet")
    bare = StepCostModel("tokens", MODEL.coefficients, META)
    f = StepFeatures(decode_seqs=1, sampled=1, decode_context=10, decode_padded=10)
    speed, why = bench_fleet.speed_of_run(MODEL, _log(tmp_path, [(f, 20 * bare.predict(f))]))
    assert speed == pytest.approx(20) and "outside 0.1-10" in why
    speed, why = bench_fleet.speed_of_run(MODEL, _log(tmp_path, [(f, 1.5 * bare.predict(f))]))
    assert speed == pytest.approx(1.5) and why is None
