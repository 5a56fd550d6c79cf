"""Simulator fidelity: `cadence sim` against real `cadence bench` runs, same workload, same load.

    .venv/bin/python benchmarks/sim_fidelity.py [--calibrate] [--num-requests 120] [--fractions 0.3,0.6,0.85]
        [--workloads chat] [--seeds 0] [--profile src/cadence/sim/profiles/default.json]
        [--record-validation] [--out results/sim_fidelity]

1. Saturation is the simulated request throughput of the workload when every request arrives at
   once (the engine is never idle; the tail is short next to the run for a few hundred requests).
2. For each workload, seed and fraction of its saturation, a fresh `cadence serve` (default
   model, one torch thread, as calibrated; fresh so that no prefix cache carries over between
   loads) is benchmarked with `cadence bench` at that Poisson rate, and `cadence sim` runs the
   same workload (same seed: same sizes, same arrival times) with the same engine options.
3. Each group (workload, seed) prints p50, p90 and p99 of TTFT, ITL and end-to-end latency, real
   and simulated, and sim/real. The summary over every group counts the p50/p90 cells within 15%
   and gives the median and the 10th-90th percentile spread of sim/real per metric (p99 reported,
   not counted). `--record-validation` writes that spread into the profile (`validation`), where
   `cadence sim` and `cadence sim plan` read it (cadence.sim.fidelity). Every run's summaries and
   the server's /metrics at the end are kept under --out/WORKLOAD_seedSEED/.

The server, the client and this script share the machine; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]
METRICS = [("ttft", "p50"), ("ttft", "p90"), ("itl", "p50"), ("itl", "p90"), ("e2e", "p50"), ("e2e", "p90")]
REPORTED = [(m, q) for m in ("ttft", "itl", "e2e") for q in ("p50", "p90", "p99")]


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd[2:] if cmd[:2] == CADENCE[:2] else cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def saturation(args: argparse.Namespace, out: Path) -> float:
    d = out / "saturation"
    _run([*CADENCE, "sim", "--workload", args.workload, "--num-requests", str(args.saturation_requests),
          "--rate", "1000", "--seed", str(args.seed), "--profile", args.profile, "--out", str(d),
          "--num-threads", "1"])
    return _summary(d)["overall"]["request_throughput"]


def one_load(args: argparse.Namespace, rate: float, out: Path) -> tuple[dict, dict]:
    """One real run and its simulation; `args.workload` and `args.seed` name the group."""
    common = ["--workload", args.workload, "--num-requests", str(args.num_requests), "--rate", f"{rate:.4f}",
              "--seed", str(args.seed)]
    real, sim = out / f"real_{rate:.3f}", out / f"sim_{rate:.3f}"
    _run([*CADENCE, "bench", *common, "--base-url", f"http://127.0.0.1:{args.port}", "--no-progress",
          "--out", str(real)])
    # The server's own view (engine-side latencies) beside the client's, to tell the two apart.
    (real / "server_metrics.txt").write_text(httpx.get(f"http://127.0.0.1:{args.port}/metrics", timeout=10).text)
    _run([*CADENCE, "sim", *common, "--profile", args.profile, "--num-threads", "1", "--out", str(sim)])
    return _summary(real), _summary(sim)


def table(rows: list[tuple[float, float, dict, dict]], metrics: list[tuple[str, str]] = METRICS) -> str:
    head = "| load | rate (req/s) | metric | real (ms) | sim (ms) | sim/real |\n|---|---|---|---|---|---|"
    lines = [head]
    for frac, rate, real, sim in rows:
        for m, q in metrics:
            a, b = real["overall"][m][q], sim["overall"][m][q]
            ratio = f"{b / a:.2f}" if a and b is not None else "n/a"
            lines.append(f"| {frac:.0%} | {rate:.3f} | {m} {q} | {_ms(a)} | {_ms(b)} | {ratio} |")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f}"


def ratios(groups: dict[str, list[tuple[float, float, dict, dict]]]) -> dict[str, list[float]]:
    """sim/real of every cell, by percentile key (ttft_p50, ...), over every group and load."""
    out: dict[str, list[float]] = {}
    for rows in groups.values():
        for _, _, real, sim in rows:
            for m, q in REPORTED:
                a, b = real["overall"][m][q], sim["overall"][m][q]
                if a and b is not None:
                    out.setdefault(f"{m}_{q}", []).append(b / a)
    return out


def spreads_of(by_key: dict[str, list[float]]) -> dict[str, Any]:
    """Each percentile key's `RatioSpread` (median, 10th-90th percentile, cells within 15%)."""
    from cadence.sim.fidelity import RatioSpread

    return {k: RatioSpread.of(v) for k, v in by_key.items()}


def summary(groups: dict[str, list[tuple[float, float, dict, dict]]], spreads: dict[str, Any] | None = None) -> str:
    """Cells within 15% over the gated percentiles, and each percentile's median and spread
    (`spreads`: those already computed from `groups`)."""
    from cadence.sim.fidelity import GATED_QUANTILES, WITHIN

    by_key = ratios(groups)
    spreads = spreads if spreads is not None else spreads_of(by_key)
    num_groups = len(groups)
    gated = [s for k, s in spreads.items() if int(k.rpartition("_p")[2]) in GATED_QUANTILES]
    within, cells = sum(s.within for s in gated), sum(s.cells for s in gated)
    lines = [f"{within} of {cells} p50/p90 cells within {WITHIN:.0%} ({within / max(cells, 1):.0%}) over "
             f"{num_groups} workload x seed groups",
             "| metric | median sim/real | 10th-90th percentile | min-max | within 15% |", "|---|---|---|---|---|"]
    for k, s in spreads.items():
        r = by_key[k]
        lines.append(f"| {k.replace('_', ' ')}{'' if int(k.rpartition('_p')[2]) in GATED_QUANTILES else ' (not gated)'}"
                     f" | {s.median:.2f} | {s.low:.2f}-{s.high:.2f} | {min(r):.2f}-{max(r):.2f} | {s.within}/{s.cells} |")
    return "\n".join(lines)


def record_validation(profile: str, spreads: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the sim/real spread into the profile's `validation` block."""
    import datetime

    from cadence.host_load import cpu_model
    from cadence.sim.fidelity import Validation

    v = Validation(spreads, datetime.date.today().isoformat(), f"{cpu_model()}, {os.cpu_count()} cores",
                   tuple(args.workloads.split(",")), tuple(int(x) for x in args.seeds.split(",")),
                   tuple(float(f) for f in args.fractions.split(",")))
    path = Path(profile)
    doc = json.loads(path.read_text())
    doc["validation"] = v.as_dict()
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote the validation into {path}: {v.describe()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", "--workload", default="chat", help="comma-separated built-in workloads")
    p.add_argument("--seeds", "--seed", default="0", help="comma-separated seeds")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--saturation-requests", type=int, default=400)
    p.add_argument("--fractions", default="0.3,0.6,0.85")
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--profile", default=str(ROOT / "src/cadence/sim/profiles/default.json"))
    p.add_argument("--out", default=str(ROOT / "results/sim_fidelity"))
    p.add_argument("--calibrate", action="store_true", help="calibrate a fresh profile first (about 4 minutes)")
    p.add_argument("--sim-only", action="store_true",
                   help="keep the real runs already under --out and simulate them again with --profile "
                        "(compare profiles on the same real runs)")
    p.add_argument("--record-validation", action="store_true",
                   help="write the sim/real spread into the profile (read by `cadence sim` and `sim plan`)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        # Step times on a shared machine depend on what else runs: calibrate under today's conditions.
        args.profile = str(out / "profile.json")
        _run([*CADENCE, "calibrate", "--num-threads", "1", "--out", args.profile])
    groups: dict[str, list[tuple[float, float, dict, dict]]] = {}
    for workload in args.workloads.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            args.workload, args.seed = workload, seed
            name = f"{workload}_seed{seed}"
            groups[name] = run_group(args, out / name)
    spreads = spreads_of(ratios(groups))
    text = (f"profile: {args.profile}\n{args.num_requests} requests per load, load average "
            f"{os.getloadavg()[0]:.2f} at the end\n\n" + "\n\n".join(
                f"{name}\n" + table(rows, REPORTED) for name, rows in groups.items()) + "\n\n"
            + summary(groups, spreads))
    (out / "table.md").write_text(text + "\n")
    print(text)
    if args.record_validation:
        record_validation(args.profile, spreads, args)
    return 0


def resimulate(args: argparse.Namespace, out: Path) -> list[tuple[float, float, dict, dict]]:
    """The real runs kept under `out`, each simulated again with `args.profile` (same rates)."""
    sat = _summary(out / "saturation")["overall"]["request_throughput"]
    rows = []
    for real in sorted(out.glob("real_*"), key=lambda d: float(d.name[5:])):
        rate = float(real.name[5:])
        common = ["--workload", args.workload, "--num-requests", str(_summary(real)["meta"]["num_requests"]),
                  "--rate", f"{rate:.4f}", "--seed", str(args.seed)]
        sim = out / f"sim_{real.name[5:]}"
        _run([*CADENCE, "sim", *common, "--profile", args.profile, "--num-threads", "1", "--out", str(sim)])
        rows.append((rate / sat, rate, _summary(real), _summary(sim)))
    return rows


def run_group(args: argparse.Namespace, out: Path) -> list[tuple[float, float, dict, dict]]:
    """Saturation, then each load on a fresh server, for one workload and seed."""
    if args.sim_only:
        return resimulate(args, out)
    out.mkdir(parents=True, exist_ok=True)
    sat = saturation(args, out)
    print(f"{args.workload}, seed {args.seed}: simulated saturation {sat:.3f} req/s", flush=True)
    rows = []
    for frac in (float(f) for f in args.fractions.split(",")):
        # A fresh server per load: the same seed sends the same prompts, and a warm prefix cache
        # from the previous load would skip their prefills (the simulator starts cold too).
        cmd = [*CADENCE, "serve", "--num-threads", "1", "--port", str(args.port)]
        with served(cmd, f"http://127.0.0.1:{args.port}/ready", out / f"serve_{frac:g}.log", cwd=ROOT, timeout=120):
            real, sim = one_load(args, frac * sat, out)
        rows.append((frac, frac * sat, real, sim))
        print(table(rows[-1:], REPORTED), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
