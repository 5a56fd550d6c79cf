"""benchmarks/sim_fidelity.py --repeat: each real run made several times on fresh servers, kept as
real_RATE, real_RATE_r2, ...; real vs real counted like sim/real; --sim-only reads every repeat;
--record-validation carries the real vs real count into the profile.

The orchestration runs for real with its commands faked: `cadence serve` is a context that records
which log it was given, `cadence bench` and `cadence sim` write summaries of known percentiles,
so every count below is known by hand."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from cadence.sim.fidelity import Validation
from cadence.sim.profile import default_profile_path

sf = load_benchmark("sim_fidelity")
fig = load_benchmark("figures")
KEYS = [f"{m}_{q}" for m, q in sf.REPORTED]


def _summary(ms: dict[str, float], num_requests: int = 6, throughput: float = 1.0) -> dict:
    """A summary as `cadence bench` and `cadence sim` write it, with these percentiles (ms)."""
    overall: dict = {"request_throughput": throughput}
    for key in KEYS:
        m, _, q = key.partition("_")
        overall.setdefault(m, {})[q] = ms[key] / 1000
    return {"overall": overall, "meta": {"num_requests": num_requests}}


def _flat(ms: float, **scaled: float) -> dict[str, float]:
    """Every percentile at `ms`, those named in `scaled` multiplied by their factor."""
    return {k: ms * scaled.get(k, 1.0) for k in KEYS}


def test_real_vs_real_counts_each_repeat_against_the_first_and_sim_against_the_mean() -> None:
    """Two loads, three real runs each. TTFT p50 of the repeats over the first: 1.10 and 1.30 at the
    first load, 0.90 and 1.00 at the second; ITL p90: 1.5 and 1.5, then 1.0 and 1.0; every other
    cell the same in every run. The simulator reads each load's mean of the runs exactly."""
    runs_a = [_flat(100), _flat(100, ttft_p50=1.1, itl_p90=1.5), _flat(100, ttft_p50=1.3, itl_p90=1.5)]
    runs_b = [_flat(200), _flat(200, ttft_p50=0.9), _flat(200)]
    mean = [{k: sum(r[k] for r in runs) / len(runs) for k in KEYS} for runs in (runs_a, runs_b)]
    groups = {"chat_seed1": [(0.3, 0.6, _summary(runs_a[0]), _summary(mean[0])),
                             (0.6, 1.2, _summary(runs_b[0]), _summary(mean[1]))]}
    repeats = {"chat_seed1": [[_summary(r) for r in runs_a], [_summary(r) for r in runs_b]]}

    by_key, spreads = sf.real_vs_real(groups, repeats)
    assert by_key["ttft_p50"] == pytest.approx([1.1, 1.3, 0.9, 1.0])
    assert by_key["itl_p90"] == pytest.approx([1.5, 1.5, 1.0, 1.0])
    assert spreads["ttft_p50"].median == pytest.approx(1.05) and spreads["ttft_p50"].within == 3
    assert spreads["itl_p90"].median == pytest.approx(1.25) and spreads["itl_p90"].within == 2
    # 6 gated percentiles x 2 loads x 2 repeats after the first; 1 TTFT p50 and 2 ITL p90 cells out.
    assert sf.gated_within(spreads) == (21, 24)

    text = sf.summary(groups, None, repeats).splitlines()
    # Against the first run, sim (the mean) misses ITL p90 at the first load only (133.3 over 100).
    assert text[0] == ("11 of 12 p50/p90 cells within 15% (92%) over 1 workload x seed groups "
                       "(sim against the first of 3 real runs)")
    assert "sim against the mean of the real runs: 12 of 12 p50/p90 cells within 15% (100%)" in text
    rr = next(i for i, line in enumerate(text) if line.startswith("real vs real: "))
    assert text[rr].startswith("real vs real: 21 of 24 p50/p90 cells within 15% (88%)")
    assert text[rr + 1] == "| metric | median real_b/real_a | 10th-90th percentile | min-max | within 15% |"
    assert "| ttft p50 | 1.05 | 0.93-1.24 | 0.90-1.30 | 3/4 |" in text[rr:]
    assert "| itl p90 | 1.25 | 1.00-1.50 | 1.00-1.50 | 2/4 |" in text[rr:]
    assert "| itl p99 (not gated) | 1.00 | 1.00-1.00 | 1.00-1.00 | 4/4 |" in text[rr:]

    # The group's own table: every run beside the first, and each over the first.
    real = sf.real_table(groups["chat_seed1"], repeats["chat_seed1"]).splitlines()
    assert real[0] == ("| load | rate (req/s) | metric | run 1 (ms) | run 2 (ms) | run 3 (ms) | run 2/run 1 "
                       "| run 3/run 1 |")
    assert "| 30% | 0.600 | ttft p50 | 100.0 | 110.0 | 130.0 | 1.10 | 1.30 |" in real


def test_one_run_per_load_keeps_the_summary_as_it_was() -> None:
    groups = {"chat_seed1": [(0.3, 0.6, _summary(_flat(100)), _summary(_flat(90)))]}
    single = sf.summary(groups, None, {"chat_seed1": [[_summary(_flat(100))]]})
    assert single == sf.summary(groups) and "real vs real" not in single and "mean" not in single


class _FakeCommands:
    """`served`, `cadence bench`, `cadence sim` and the server's /metrics, as sim_fidelity calls them.
    A real run's percentiles are 100 ms, TTFT 50% higher in a repeat; a simulation's are 100 ms;
    simulated saturation is 2 requests/s."""

    def __init__(self) -> None:
        self.logs: list[str] = []  # the serve log of every server started, in order
        self.benches: list[tuple[str, str]] = []  # (serve log of the server up, bench --out)
        self.sims: list[str] = []
        self.up: str | None = None

    @contextlib.contextmanager
    def served(self, cmd, ready_url, log_path, **kwargs):
        assert self.up is None and "serve" in cmd  # one server at a time
        self.up = Path(log_path).name
        self.logs.append(self.up)
        try:
            yield None
        finally:
            self.up = None

    def run(self, cmd: list[str]) -> None:
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        n = int(cmd[cmd.index("--num-requests") + 1]) if "--num-requests" in cmd else 6
        if "bench" in cmd:
            assert self.up is not None, "a real run without a server"
            self.benches.append((self.up, out.name))
            repeat = "_r" in out.name[5:]
            doc = _summary(_flat(100, ttft_p50=1.5 if repeat else 1, ttft_p90=1.5 if repeat else 1), n)
        else:
            self.sims.append(out.name)
            doc = _summary(_flat(100), n, throughput=2.0)
        (out / "summary.json").write_text(json.dumps(doc))

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(sf, "served", self.served)
        monkeypatch.setattr(sf, "_run", self.run)
        monkeypatch.setattr(sf.httpx, "get", lambda url, timeout: type("R", (), {"text": "# metrics\n"})())


def test_repeats_run_on_fresh_servers_in_rotated_order_and_sim_only_reads_them(tmp_path, monkeypatch,
                                                                               capsys) -> None:
    fake = _FakeCommands()
    fake.install(monkeypatch)
    out = tmp_path / "fid"
    common = ["--workloads", "chat", "--seeds", "1", "--num-requests", "6", "--out", str(out)]
    assert sf.main([*common, "--fractions", "0.5,0.25", "--repeat", "2"]) == 0
    printed = capsys.readouterr().out

    group = out / "chat_seed1"
    # Each real run on a server of its own, the first load's repeats in order, the next one's rotated.
    assert fake.logs == ["serve_0.5.log", "serve_0.5_r2.log", "serve_0.25_r2.log", "serve_0.25.log"]
    assert fake.benches == [("serve_0.5.log", "real_1.000"), ("serve_0.5_r2.log", "real_1.000_r2"),
                            ("serve_0.25_r2.log", "real_0.500_r2"), ("serve_0.25.log", "real_0.500")]
    assert fake.sims == ["saturation", "sim_1.000", "sim_0.500"]  # one simulation per load
    assert sorted(d.name for d in group.iterdir()) == ["real_0.500", "real_0.500_r2", "real_1.000", "real_1.000_r2",
                                                       "saturation", "sim_0.500", "sim_1.000"]
    assert all((group / d / "server_metrics.txt").is_file() for d in ("real_1.000", "real_1.000_r2"))
    # Repeats' TTFT p50 and p90 50% above the first's: 4 of 6 gated cells per load hold.
    assert "real vs real: 8 of 12 p50/p90 cells within 15% (67%)" in printed
    assert "| 50% | 1.000 | ttft p50 | 100.0 | 150.0 | 1.50 |" in printed
    assert "12 of 12 p50/p90 cells within 15% (100%) over 1 workload x seed groups (sim against the first" in printed
    assert "sim against the mean of the real runs: 8 of 12" in printed  # TTFT mean 125 ms: 100/125 = 0.80
    assert printed.strip().endswith((out / "table.md").read_text().strip())

    # --sim-only: no server, no real run; each load simulated again, every recorded repeat read.
    fake.logs.clear(), fake.benches.clear(), fake.sims.clear()
    assert sf.main([*common, "--sim-only"]) == 0
    again = capsys.readouterr().out
    assert fake.logs == [] and fake.benches == [] and fake.sims == ["sim_0.500", "sim_1.000"]
    assert "real vs real: 8 of 12 p50/p90 cells within 15% (67%)" in again

    # The docs' figures read the first real run of each load only.
    assert len(fig.fmt_sim_fidelity(out).splitlines()) == 2 + 2 * 6


def test_record_validation_carries_real_vs_real_only_when_repeated(tmp_path, monkeypatch, capsys) -> None:
    _FakeCommands().install(monkeypatch)
    profiles = {}
    for repeat in ("1", "3"):
        profile = tmp_path / f"profile_{repeat}.json"
        shutil.copy(default_profile_path(), profile)
        assert sf.main(["--workloads", "chat", "--seeds", "1", "--num-requests", "6", "--fractions", "0.5",
                        "--repeat", repeat, "--profile", str(profile), "--out", str(tmp_path / repeat),
                        "--record-validation"]) == 0
        profiles[repeat] = json.loads(profile.read_text())
    capsys.readouterr()
    from cadence.sim.fidelity import RealVsReal

    assert "real_vs_real" not in profiles["1"]["validation"]
    v = Validation.from_profile(profiles["3"])
    assert v is not None and v.real_vs_real == RealVsReal(within=8, cells=12, repeats=3)  # 2 repeats x 6 cells
    assert v.gated_within() == (6, 6)  # sim/real stays against the first run

    from cadence.cli import main

    assert main(["sim", "--workload", "chat", "--num-requests", "4", "--rate", "1", "--profile",
                 str(tmp_path / "profile_3.json")]) == 0
    assert "real vs real 8 of 12 (67%) over 3 runs each" in capsys.readouterr().out


def test_sim_only_without_step_scatter_keeps_the_mean_priced_runs_beside(tmp_path, monkeypatch, capsys) -> None:
    fake = _FakeCommands()
    flags: list[bool] = []
    run = fake.run
    monkeypatch.setattr(fake, "run", lambda cmd: (flags.append("--no-step-scatter" in cmd), run(cmd))[1])
    fake.install(monkeypatch)
    out = tmp_path / "fid"
    common = ["--workloads", "chat", "--seeds", "1", "--num-requests", "6", "--out", str(out)]
    assert sf.main([*common, "--fractions", "0.5"]) == 0
    fake.sims.clear(), flags.clear()
    assert sf.main([*common, "--sim-only", "--no-step-scatter"]) == 0
    assert fake.sims == ["sim_1.000_mean"] and flags == [True]
    assert sorted(d.name for d in (out / "chat_seed1").iterdir()) == ["real_1.000", "saturation", "sim_1.000",
                                                                     "sim_1.000_mean"]
    with pytest.raises(SystemExit):
        sf.main([*common, "--sim-only", "--no-step-scatter", "--record-validation"])
    assert "--record-validation" in capsys.readouterr().err
