"""benchmarks/bench_fleet.py `routers --fleet-overhead` end to end, with the tiny model and a few
requests: the fleets' serving overhead is measured through a fleet of two replicas, the
simulated fleet is given it, the simulated single server its profile's own. A check that
the benchmark runs, not a measurement."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")  # (the fleet's extra: `make serve` / `make test` install it)

from cadence.executor.cost_model import StepCostModel  # noqa: E402
from cadence.sim.profile import default_profile_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    for _ in range(50):
        port = random.randrange(18000, 19000)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError("no free port in 18000-18999")


def test_routers_with_the_fleet_overhead_runs_end_to_end(tmp_path):
    out = tmp_path / "routers"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_fleet.py"), "routers", "--tiny", "--fleet-overhead",
           "--servers", "prefix-affinity,single", "--seeds", "0", "--families", "2", "--per-family", "2",
           "--prefix-tokens", "64", "--suffix-tokens", "16", "--output-tokens", "4", "--rate", "4",
           "--kv-blocks", "64", "--max-num-seqs", "4", "--overhead-batches", "1,2", "--overhead-rounds", "1",
           "--port", str(_port()), "--out", str(out)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    fits = json.loads((out / "fleet_overhead.json").read_text())
    assert sorted(fits) == ["2"]
    for replicas, fit in fits.items():
        assert fit["replicas"] == int(replicas)
        assert [r["clients"] for r in fit["runs"]] == [int(replicas), 2 * int(replicas)]
        assert all(r["median_itl_s"] > 0 for r in fit["runs"])
    rows = {r["router"]: r for r in json.loads((out / "rows.json").read_text())}
    fleet_profile = StepCostModel.load(out / "prefix-affinity_s0_sim" / "profile.json")
    assert fleet_profile.overhead == {k: fits["2"][k] for k in ("per_step", "per_seq")}
    single_profile = StepCostModel.load(out / "single_s0_sim" / "profile.json")
    assert single_profile.overhead == StepCostModel.load(default_profile_path()).overhead
    for row in rows.values():
        assert row["real"]["ttft"]["p50"] > 0 and row["sim"]["ttft"]["p50"] > 0
    assert "serving overhead measured through the fleet" in (out / "table.md").read_text()


def test_routers_repeat_judges_the_real_runs_against_themselves(tmp_path):
    """--repeat 2 runs each server twice on the seed; the table sets the repeat against the first run
    and the simulator against both, from the client records each run kept."""
    out = tmp_path / "routers"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_fleet.py"), "routers", "--tiny", "--repeat", "2",
           "--servers", "single", "--seeds", "0", "--families", "2", "--per-family", "2",
           "--prefix-tokens", "64", "--suffix-tokens", "16", "--output-tokens", "4", "--rate", "4",
           "--kv-blocks", "64", "--max-num-seqs", "4", "--no-step-scatter", "--port", str(_port()), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    first = json.loads((out / "single_s0" / "summary.json").read_text())["overall"]
    repeat = json.loads((out / "single_s0_r1" / "summary.json").read_text())["overall"]
    [rec] = json.loads((out / "repeats.json").read_text())
    assert (rec["router"], rec["seed"], rec["rep"]) == ("single", 0, 1)
    assert rec["first"] == first and rec["real"] == repeat
    assert repeat["ttft"]["p50"] > 0
    table = (out / "table.md").read_text()
    assert "real against itself:" in table and "simulator against the first runs" in table
    assert "--no-step-scatter" in done.stdout



def test_routers_at_run_speed_simulates_again_at_the_speed_the_run_s_steps_ran(tmp_path):
    """--at-run-speed: the server records its steps, the probe's are left out of the run's, and the
    second simulation's step costs are the profile's times how fast those steps ran against it."""
    from cadence.sim.served_fit import run_speed

    # The tiny model runs far faster than the default model's profile: a profile a tenth as dear
    # keeps its factor inside what `cadence sim --step-cost-scale` takes on any machine.
    profile = tmp_path / "fast.json"
    StepCostModel.load(default_profile_path()).with_step_scale(0.1).save(profile)
    out = tmp_path / "routers"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_fleet.py"), "routers", "--tiny", "--at-run-speed",
           "--servers", "single", "--seeds", "0", "--families", "2", "--per-family", "2",
           "--prefix-tokens", "64", "--suffix-tokens", "16", "--output-tokens", "4", "--rate", "4",
           "--kv-blocks", "64", "--max-num-seqs", "4", "--profile", str(profile), "--port", str(_port()),
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    real = out / "single_s0"
    every = (real / "steps.all.jsonl").read_text().splitlines()
    run = (real / "steps.jsonl").read_text().splitlines()
    assert 0 < len(run) < len(every) and every[-len(run):] == run  # the probe's steps came first
    # the run's prompts (4 of 80 tokens; the probe's are other lengths) and decodes, no more
    assert sum(json.loads(s)["sampled"] for s in run) == 4 * 4
    [row] = json.loads((out / "rows.json").read_text())
    probed = StepCostModel.load(out / "single_s0_sim" / "profile.json")
    assert row["run_speed"] == pytest.approx(run_speed(probed, real / "steps.jsonl"))
    at_speed = json.loads((out / "single_s0_sim_speed" / "summary.json").read_text())
    given = float(f"{row['run_speed']:.4f}")  # as the script passes it to --step-cost-scale
    assert any(f"step costs: {given:g} times the profile's" in n for n in at_speed["meta"]["notes"])
    assert row["sim_speed"] == at_speed["overall"]
    assert "simulator at each run's speed:" in (out / "table.md").read_text()
