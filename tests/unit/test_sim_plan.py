"""Capacity planning: objectives, the replica search, the infeasibility floor, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cadence.cli import main
from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel
from cadence.sim.plan import Objective, Trial, min_replicas, plan, unloaded_ttft
from cadence.sim.profile import default_profile_path
from cadence.sim.workloads import repeat_workload
from cadence.workload import Workload, WorkloadRequest

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}
CONST = StepCostModel("tokens", {"const": 0.1}, META)


def _trial(n: int, meets: bool) -> Trial:
    return Trial({}, n, {}, 0, 0, 1, meets, 0.0)


def test_objective_parsing() -> None:
    o = Objective.parse("ttft_p95=1.5")
    assert (o.metric, o.q, o.bound, o.key) == ("ttft", 95, 1.5, "ttft_p95")
    assert Objective.parse("itl_p50=0.2").key == "itl_p50"
    for bad in ("ttft=1", "ttft_p97=1", "speed_p95=1", "ttft_p95=-1", "ttft_p95=x"):
        with pytest.raises(ValueError, match="METRIC_pQ"):
            Objective.parse(bad)


def test_min_replicas_doubles_then_bisects() -> None:
    tried: list[int] = []

    def run(n: int) -> Trial:
        tried.append(n)
        return _trial(n, n >= 5)

    best, trials = min_replicas(run, 64)
    assert best is not None and best.replicas == 5
    assert tried == [1, 2, 4, 8, 6, 5]
    assert [t.replicas for t in trials] == tried


def test_min_replicas_gives_up_at_the_cap() -> None:
    best, trials = min_replicas(lambda n: _trial(n, False), 6)
    assert best is None and [t.replicas for t in trials] == [1, 2, 4, 6]


def test_unloaded_ttft_is_the_prefill_chunks_back_to_back() -> None:
    w = Workload("w", (WorkloadRequest(arrival_time=0.0, prompt_tokens=1000, output_tokens=5),
                       WorkloadRequest(arrival_time=0.0, prompt_tokens=10, output_tokens=5)))
    assert unloaded_ttft(w, EngineConfig(), CONST) == pytest.approx([0.2, 0.1])  # 512-token chunks: 2 steps, 1 step


def _steady(n: int, gap: float, out: int = 20) -> Workload:
    return Workload("steady", tuple(WorkloadRequest(arrival_time=i * gap, prompt_tokens=32, output_tokens=out)
                                    for i in range(n)))


def test_plan_finds_the_fewest_replicas() -> None:
    # 100 ms per step and one request every 50 ms: with max_num_seqs=1 a replica serves one request
    # at a time (2 s each), so queues build until there are enough replicas to hold them all.
    cfg = EngineConfig.from_options(max_num_seqs=1, num_kv_blocks=256)
    res = plan(_steady(60, 0.05), cfg, CONST, [Objective.parse("ttft_p95=0.5")], max_replicas=64)
    assert res.best is not None
    n = res.best.replicas
    assert 20 <= n <= 64 and res.best.meets
    failing = [t.replicas for t in res.trials if not t.meets]
    assert failing and max(failing) == n - 1  # the count just below the answer was tried and failed


def test_plan_grid_prefers_options_that_need_fewer_replicas() -> None:
    cfg = EngineConfig.from_options(num_kv_blocks=256)
    res = plan(_steady(60, 0.05), cfg, CONST, [Objective.parse("ttft_p95=0.5")],
               grid={"max_num_seqs": [1, 64]}, max_replicas=64)
    assert res.best is not None and res.best.options == {"max_num_seqs": 64} and res.best.replicas == 1


def test_plan_reports_an_infeasible_slo_without_searching() -> None:
    res = plan(_steady(5, 1.0), EngineConfig(), CONST, [Objective.parse("ttft_p95=0.05")])
    assert res.best is None and not res.trials
    assert "infeasible" in res.notes[0]


def test_repeat_workload_shifts_each_copy_by_one_period() -> None:
    w = repeat_workload(_steady(4, 1.0), 3)  # arrivals 0..3: span 3, mean gap 1 -> period 4
    assert [r.arrival_time for r in w.requests] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert "repeated x3" in w.notes[-1]


def test_cli_sim_prints_the_bench_report_and_writes_its_files(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc = main(["sim", "--workload", "chat", "--num-requests", "30", "--rate", "1", "--replicas", "2",
               "--router", "round-robin", "--slo", "ttft=2", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "ttft" in text and "goodput" in text and "replica" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"]["completed"] == 30 and summary["meta"]["replicas"] == 2
    assert (out / "requests.jsonl").exists() and (out / "latency_cdf.png").exists()


_NO_TORCH = """
import sys
from cadence.cli import main
assert main(sys.argv[1:]) == 0
assert "torch" not in sys.modules, "cadence sim imported torch"
"""


@pytest.mark.parametrize("action", [[], ["plan", "--slo", "ttft_p95=30"]])
def test_cli_sim_never_imports_torch(tmp_path, action) -> None:
    """The simulator and its report are numpy: importing torch would cost `cadence sim` seconds."""
    out = [] if action else ["--out", str(tmp_path / "run")]
    argv = ["sim", *action, "--workload", "chat", "--num-requests", "10", "--rate", "1", *out]
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_cli_plan_answers_in_one_command(capsys) -> None:
    rc = main(["sim", "plan", "--workload", "chat", "--num-requests", "40", "--rate", "3",
               "--slo", "ttft_p95=3", "--max-replicas", "8"])
    text = capsys.readouterr().out
    assert "cheapest:" in text or "no configuration" in text
    assert rc == (0 if "cheapest:" in text else 1)


def test_shipped_profile_names_what_it_measured() -> None:
    m = StepCostModel.load(default_profile_path())
    for key in ("model", "dtype", "device", "machine", "kv_bytes_per_token"):
        assert m.metadata.get(key), key
    assert 0 < m.fit_report["heldout_mape"] < 1


def test_engine_flags_reproduce_a_config_for_cadence_serve() -> None:
    from cadence.cli import build_parser, engine_config_from_args
    from cadence.sim.serving import engine_flags

    cfg = EngineConfig.from_options(max_num_seqs=8, enable_prefix_caching=False, num_threads=1,
                                    tenant_weights=(("a", 2.0),))
    flags = engine_flags(cfg)
    assert "--max-num-seqs" in flags and "--no-enable-prefix-caching" in flags
    args = build_parser().parse_args(["serve", *flags])
    assert engine_config_from_args(args) == cfg
    assert engine_flags(EngineConfig()) == []


def test_serving_overhead_line_is_never_negative() -> None:
    from cadence.sim.serving import fit_line

    assert fit_line([1, 4, 16], [0.010, 0.013, 0.025]) == pytest.approx((0.001, 0.009))
    slope, icpt = fit_line([1, 4, 16], [0.02, 0.01, -0.03])  # serving cannot make steps cheaper
    assert slope == 0.0 and icpt == pytest.approx(0.0, abs=1e-12)


def test_cli_plan_prints_boolean_options_as_serve_flags(capsys) -> None:
    """The cheapest line is meant to be pasted into `cadence serve`: a boolean is --name or --no-name,
    never `--name False` (a flag that does not exist)."""
    rc = main(["sim", "plan", "--workload", "chat", "--num-requests", "20", "--rate", "2",
               "--slo", "ttft_p95=30", "--max-replicas", "2", "--grid", "enable_prefix_caching=false"])
    text = capsys.readouterr().out
    assert rc == 0, text
    cheapest = next(line for line in text.splitlines() if line.startswith("cheapest:"))
    assert "--no-enable-prefix-caching" in cheapest and "False" not in cheapest


def test_cli_plan_prints_each_tried_row_once(capsys) -> None:
    rc = main(["sim", "plan", "--workload", "chat", "--num-requests", "20", "--rate", "2",
               "--slo", "ttft_p95=30", "--max-replicas", "4", "--grid", "max_num_seqs=8,16"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    heads = [i for i, line in enumerate(lines) if line.startswith("engine options")]
    tried = [line.split()[:2] for line in lines if "max_num_seqs=" in line and not line.startswith("cheapest")]
    assert tried == [["max_num_seqs=8", "1"], ["max_num_seqs=16", "1"]]  # each row once
    assert len(heads) == 1 and lines[heads[0] + 1].startswith("max_num_seqs=8")
