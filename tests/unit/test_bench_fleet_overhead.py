"""benchmarks/bench_fleet.py `routers`: the simulated fleets pay the serving overhead measured
through the fleet, the simulated single server its profile's own, and each the request path its
server was probed at (prompts sent twice, a cost per prompt token)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from cadence.executor.cost_model import StepCostModel
from cadence.sim.profile import default_profile_path
from cadence.sim.serving import _priced_first_step
from cadence.workload import write_jsonl

FLEET = {"per_step": 0.006, "per_seq": 0.0009}
FITS = {"1": {"per_step": 0.002, "per_seq": 0.0004, "runs": []}, "2": {**FLEET, "runs": []}}
PATH_S, PATH_PER_TOKEN_S = 0.03, 4e-6


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(profile=str(default_profile_path()), kv_blocks=200, max_num_seqs=16, tiny=False)


def _probe(model: StepCostModel, block: int = 16) -> list[dict]:
    """A probe of cached second sends through a server whose path is PATH_S + PATH_PER_TOKEN_S a
    prompt token, its steps priced by `model`."""
    runs = []
    for words, tokens in ((8, 12), (96, 140), (384, 560)):
        cached = (tokens - 1) // block * block
        for _ in range(3):
            ttft = _priced_first_step(model, tokens, cached) + PATH_S + PATH_PER_TOKEN_S * tokens
            runs.append({"words": words, "prompt_tokens": tokens, "cached_tokens": cached, "ttft_s": ttft})
    return runs


def _real(tmp_path: Path, name: str, model: StepCostModel) -> Path:
    real = tmp_path / name
    real.mkdir()
    (real / "request_path_probe.json").write_text(json.dumps(_probe(model)))
    return real


def test_a_fleet_is_simulated_with_the_fleets_overhead_and_the_single_server_with_its_own(tmp_path):
    bf = load_benchmark("bench_fleet")
    args, base = _args(tmp_path), StepCostModel.load(default_profile_path())
    assert base.overhead != FLEET
    fleet_steps = dataclasses.replace(base, overhead=FLEET)
    out = tmp_path / "fleet_sim"
    out.mkdir()
    fleet = bf.with_request_path(args, _real(tmp_path, "fleet", fleet_steps), out,
                                 bf.server_overhead("prefix-affinity", FITS))
    assert fleet.overhead == FLEET  # the two-replica fleet's, as the routers' fleets have two
    assert StepCostModel.load(out / "profile.json").overhead == FLEET  # what `cadence sim` is given
    # The request path, its cached sends priced with the fleet's overhead: both terms recovered.
    assert fleet.request_delay == pytest.approx(PATH_S, rel=1e-6)
    assert fleet.request_delay_per_token == pytest.approx(PATH_PER_TOKEN_S, rel=1e-6)

    out = tmp_path / "single_sim"
    out.mkdir()
    single = bf.with_request_path(args, _real(tmp_path, "single", base), out, bf.server_overhead("single", FITS))
    assert single.overhead == base.overhead
    assert single.request_delay == pytest.approx(PATH_S, rel=1e-6)
    assert single.request_delay_per_token == pytest.approx(PATH_PER_TOKEN_S, rel=1e-6)
    assert bf.server_overhead("prefix-affinity", None) is None  # without --fleet-overhead: the profile's


def test_the_simulated_fleets_itl_rises_by_the_fleets_overhead(tmp_path):
    bf = load_benchmark("bench_fleet")
    args, base = _args(tmp_path), StepCostModel.load(default_profile_path())
    wl = tmp_path / "wl.jsonl"
    write_jsonl(bf.families_workload(2, 4, 64, 16, 12, seed=0), wl)
    load = ["--requests-file", str(wl), "--arrival", "poisson", "--rate", "4", "--seed", "0"]
    itl = {}
    for label, overhead in (("profile's", None), ("fleet's", bf.server_overhead("round-robin", FITS))):
        out = tmp_path / label
        out.mkdir()
        real = _real(tmp_path, f"real_{label}", base if overhead is None else dataclasses.replace(base, overhead=FLEET))
        bf.with_request_path(args, real, out, overhead)
        bf._run(bf.sim_cmd("round-robin", args, load, out, str(out / "profile.json")))
        itl[label] = json.loads((out / "summary.json").read_text())["overall"]["itl"]["p50"]
    # Each decode step costs the fleet's per-step term more, and its per-request term for each of
    # the (at most 8) running requests beyond the profile's.
    extra = itl["fleet's"] - itl["profile's"]
    assert FLEET["per_step"] <= extra <= FLEET["per_step"] + 8 * FLEET["per_seq"]


def test_an_overhead_batch_beyond_max_num_seqs_is_refused_before_any_server_starts(tmp_path):
    bf = load_benchmark("bench_fleet")
    args = argparse.Namespace(**vars(_args(tmp_path)), overhead_batches="1,4,32", overhead_rounds=1, sim_only=False,
                              port=18999)
    with pytest.raises(ValueError, match=r"--overhead-batches: .*--max-num-seqs \(16\)"):
        bf.fleet_overheads(args, tmp_path)


def test_repeats_summary_counts_cells_within_15_percent():
    bf = load_benchmark("bench_fleet")

    def lat(t50: float, t90: float, i50: float, i90: float) -> dict:
        return {"ttft": {"p50": t50, "p90": t90, "p95": t90}, "itl": {"p50": i50, "p90": i90}}

    first, again, sim = lat(1.0, 2.0, 0.1, 0.2), lat(1.1, 3.0, 0.1, 0.2), lat(0.8, 2.0, 0.1, 0.1)
    rows = [{"router": "single", "seed": 0, "real": first, "sim": sim}]
    reps = [{"router": "single", "seed": 0, "rep": 1, "first": first, "real": again}]
    text = bf.repeats_summary(rows, reps)
    assert "real against itself: 3 of 4 cells" in text  # TTFT p90 1.5x apart
    assert "against the first runs of the same servers: 2 of 4" in text  # TTFT p50 0.8, ITL p90 0.5
    assert "against the repeats: 1 of 4" in text  # 0.73, 0.67, 1.0, 0.5
    assert "| single | 0 | 2 | 1100 / 3000 |" in bf.repeats_table(reps)
