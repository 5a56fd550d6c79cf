"""benchmarks/sim_scale.py: both sides run, the reports are compared, the worktree is removed."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _load():
    return load_benchmark("sim_scale")


def test_side_by_side_against_head(capsys) -> None:
    sim_scale = _load()
    before = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rc = sim_scale.main(["--baseline", "HEAD", "--rounds", "1", "--repeat", "2",
                         "--sim-args", "--workload chat --num-requests 40 --rate 20 --replicas 2"])
    out = capsys.readouterr().out
    assert rc == 0 and "reports identical" in out and "--repeat 2" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("1 ")]
    assert [r[1] for r in rows] == ["this", "HEAD"] and all(float(r[-2]) > 0 for r in rows)
    after = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert after == before  # the baseline's worktree is gone


def test_reports_compare_without_the_timing_line() -> None:
    sim_scale = _load()
    a = "requests 3\nnote: simulated in 1.2s (10 steps)\nreplica 0"
    b = "requests 3\nnote: simulated in 9.9s (10 steps)\nreplica 0"
    assert sim_scale.comparable(a) == sim_scale.comparable(b) != sim_scale.comparable(a.replace("3", "4"))
    assert sim_scale.simulated_seconds(a) == "1.2"


def test_repeat_goes_with_the_default_workload_only() -> None:
    sim_scale = _load()
    assert sim_scale.sim_command(sim_scale.DEFAULT_SIM_ARGS, None)[-2:] == ["--repeat", "5"]
    assert sim_scale.sim_command(sim_scale.DEFAULT_SIM_ARGS, 1)[-2:] == ["--repeat", "1"]
    assert sim_scale.sim_command("--trace t.jsonl --replicas 16", None) == ["--trace", "t.jsonl", "--replicas", "16"]
    assert sim_scale.sim_command("--trace t.jsonl", 3) == ["--trace", "t.jsonl", "--repeat", "3"]
