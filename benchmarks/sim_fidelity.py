"""Simulator fidelity: `cadence sim` against real `cadence bench` runs, same workload, same load.

    .venv/bin/python benchmarks/sim_fidelity.py [--calibrate] [--num-requests 120] [--fractions 0.3,0.6,0.85]
        [--workloads chat] [--seeds 0] [--profile src/cadence/sim/profiles/default.json]
        [--repeat 1] [--record-validation] [--out results/sim_fidelity]

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
4. `--repeat N` makes each real run N times, each on a fresh server, the order of the repeats
   rotated from one load to the next so that drift over the run spreads over all of them
   (real_RATE, real_RATE_r2, ...; the simulation runs once: it is deterministic). Each group then
   also prints every repeat over the first (real/real), and the summary adds sim/real against the
   mean of the repeats and real vs real counted like sim/real: how close the real system comes to
   itself on this machine, the bound on how close any simulator can come.
5. `--no-step-scatter` simulates every step at its shape's mean, even with a profile that measured
   how served steps scatter around it (`cadence sim --no-step-scatter`), and keeps those
   simulations as sim_RATE_mean beside the scattered sim_RATE: with `--sim-only`, one set of real
   runs judges both.

The server, the client and this script share the machine; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
Row = tuple[float, float, dict, dict]  # (fraction of saturation, rate, real summary, simulated summary)
Repeats = dict[str, list[list[dict]]]  # per group, per load (in its rows' order): every real run, the first first


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd[2:] if cmd[:2] == CADENCE[:2] else cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def saturation(args: argparse.Namespace, out: Path) -> float:
    d = out / "saturation"
    _run([*CADENCE, "sim", "--workload", args.workload, "--num-requests", str(args.saturation_requests),
          "--rate", "1000", "--seed", str(args.seed), "--profile", args.profile, "--out", str(d),
          "--num-threads", "1", *_scatter_flag(args)])
    return _summary(d)["overall"]["request_throughput"]


def _scatter_flag(args: argparse.Namespace) -> list[str]:
    return ["--no-step-scatter"] if args.no_step_scatter else []


def _common(args: argparse.Namespace, rate: float, num_requests: int) -> list[str]:
    """The workload options a real run and its simulation share; `args.workload` and `args.seed` name the group."""
    return ["--workload", args.workload, "--num-requests", str(num_requests), "--rate", f"{rate:.4f}",
            "--seed", str(args.seed)]


def real_dir(out: Path, rate: float | str, repeat: int) -> Path:
    """Where real run `repeat` (1 is the first) at `rate` is kept: real_RATE, then real_RATE_r2, ..."""
    r = rate if isinstance(rate, str) else f"{rate:.3f}"
    return out / (f"real_{r}" if repeat == 1 else f"real_{r}_r{repeat}")


def recorded_reals(out: Path) -> dict[str, list[Path]]:
    """The real runs kept under one group's folder: by rate as written (ascending), each rate's repeats in order."""
    by_rate: dict[str, dict[int, Path]] = {}
    for d in out.glob("real_*"):
        rate, _, k = d.name[5:].partition("_r")
        by_rate.setdefault(rate, {})[int(k) if k else 1] = d
    for rate, reps in by_rate.items():
        if 1 not in reps:
            raise SystemExit(f"{out}: repeats of the real run at {rate} req/s without the first ({real_dir(out, rate, 1)})")
    return {rate: [reps[k] for k in sorted(reps)] for rate, reps in sorted(by_rate.items(), key=lambda kv: float(kv[0]))}


def real_run(args: argparse.Namespace, rate: float, real: Path) -> dict:
    """One `cadence bench` run against the server on `args.port`, kept in `real`."""
    _run([*CADENCE, "bench", *_common(args, rate, args.num_requests), "--base-url", f"http://127.0.0.1:{args.port}",
          "--no-progress", "--out", str(real)])
    # The server's own view (engine-side latencies) beside the client's, to tell the two apart.
    (real / "server_metrics.txt").write_text(httpx.get(f"http://127.0.0.1:{args.port}/metrics", timeout=10).text)
    return _summary(real)


def simulate(args: argparse.Namespace, rate: float, out: Path, num_requests: int) -> dict:
    """`cadence sim` of the same workload at `rate`, kept in sim_RATE."""
    sim = out / (f"sim_{rate:.3f}_mean" if args.no_step_scatter else f"sim_{rate:.3f}")
    _run([*CADENCE, "sim", *_common(args, rate, num_requests), "--profile", args.profile, "--num-threads", "1",
          "--out", str(sim), *_scatter_flag(args)])
    return _summary(sim)


def repeat_order(repeats: int, load_index: int) -> list[int]:
    """The repeats of one load in the order they run: rotated by one from a load to the next, so a
    machine that slows down (or speeds up) during the benchmark does not always favour the same repeat."""
    return [(load_index + j) % repeats + 1 for j in range(repeats)]


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


def real_table(rows: list[Row], reals: list[list[dict]], metrics: list[tuple[str, str]] = REPORTED) -> str:
    """Every real run of each load beside the first, and each repeat over the first (real/real)."""
    n = max(len(r) for r in reals)
    head = ("| load | rate (req/s) | metric | " + " | ".join(f"run {k} (ms)" for k in range(1, n + 1)) + " | "
            + " | ".join(f"run {k}/run 1" for k in range(2, n + 1)) + " |")
    lines = [head, "|" + "---|" * (3 + n + n - 1)]
    for (frac, rate, _, _), runs in zip(rows, reals, strict=True):
        for m, q in metrics:
            values = [r["overall"][m][q] for r in runs] + [None] * (n - len(runs))
            first = values[0]
            cells = [_ms(v) for v in values] + [f"{v / first:.2f}" if first and v is not None else "n/a"
                                                for v in values[1:]]
            lines.append(f"| {frac:.0%} | {rate:.3f} | {m} {q} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def most_repeats(repeats: Repeats | None) -> int:
    """The most real runs any load has (1 where none was repeated)."""
    return max((len(runs) for loads in (repeats or {}).values() for runs in loads), default=1)


def mean_summary(runs: list[dict]) -> dict:
    """A summary whose every reported percentile is the mean over the real runs (None where one lacks it)."""
    overall: dict[str, dict[str, float | None]] = {}
    for m, q in REPORTED:
        values = [r["overall"][m][q] for r in runs]
        overall.setdefault(m, {})[q] = None if None in values else statistics.fmean(values)
    return {"overall": overall}


def against_mean(groups: dict[str, list[Row]], repeats: Repeats) -> dict[str, list[Row]]:
    """Each group's rows with the mean of the real runs in place of the first."""
    return {name: [(frac, rate, mean_summary(runs), sim) for (frac, rate, _, sim), runs in
                   zip(rows, repeats[name], strict=True)] for name, rows in groups.items()}


def real_pairs(groups: dict[str, list[Row]], repeats: Repeats) -> dict[str, list[Row]]:
    """Rows of (first real run, a later one): `ratios` of them are real_b/real_a, each repeat over the first."""
    return {name: [(frac, rate, runs[0], later) for (frac, rate, _, _), runs in
                   zip(rows, repeats[name], strict=True) for later in runs[1:]] for name, rows in groups.items()}


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


def gated_within(spreads: dict[str, Any]) -> tuple[int, int]:
    """(cells within 15%, cells) over the gated percentiles (p50, p90)."""
    from cadence.sim.fidelity import GATED_QUANTILES

    gated = [s for k, s in spreads.items() if int(k.rpartition("_p")[2]) in GATED_QUANTILES]
    return sum(s.within for s in gated), sum(s.cells for s in gated)


def _counted(within: int, cells: int) -> str:
    from cadence.sim.fidelity import WITHIN

    return f"{within} of {cells} p50/p90 cells within {WITHIN:.0%} ({within / max(cells, 1):.0%})"


def _spread_table(by_key: dict[str, list[float]], spreads: dict[str, Any], ratio: str) -> list[str]:
    """Each percentile's median, 10th-90th percentile, min-max and cells within 15% of `ratio`."""
    from cadence.sim.fidelity import GATED_QUANTILES

    lines = [f"| metric | median {ratio} | 10th-90th percentile | min-max | within 15% |", "|---|---|---|---|---|"]
    for k, s in spreads.items():
        r = by_key[k]
        lines.append(f"| {k.replace('_', ' ')}{'' if int(k.rpartition('_p')[2]) in GATED_QUANTILES else ' (not gated)'}"
                     f" | {s.median:.2f} | {s.low:.2f}-{s.high:.2f} | {min(r):.2f}-{max(r):.2f} | {s.within}/{s.cells} |")
    return lines


def summary(groups: dict[str, list[Row]], spreads: dict[str, Any] | None = None,
            repeats: Repeats | None = None) -> str:
    """Cells within 15% over the gated percentiles, and each percentile's median and spread
    (`spreads`: those already computed from `groups`). Where the real runs were repeated
    (`repeats`), sim/real is against the first run, then again against their mean, and real vs
    real counts each repeat against the first the same way."""
    by_key = ratios(groups)
    spreads = spreads if spreads is not None else spreads_of(by_key)
    n = most_repeats(repeats)
    first = f" (sim against the first of {n} real runs)" if n > 1 else ""
    lines = [f"{_counted(*gated_within(spreads))} over {len(groups)} workload x seed groups{first}",
             *_spread_table(by_key, spreads, "sim/real")]
    if repeats is None or n < 2:
        return "\n".join(lines)
    by_mean = ratios(against_mean(groups, repeats))
    mean_spreads = spreads_of(by_mean)
    lines += ["", f"sim against the mean of the real runs: {_counted(*gated_within(mean_spreads))}",
              *_spread_table(by_mean, mean_spreads, "sim/mean")]
    lines += ["", *real_vs_real_lines(groups, repeats)]
    return "\n".join(lines)


def real_vs_real(groups: dict[str, list[Row]], repeats: Repeats) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """real_b/real_a of every cell (each repeat over the first), by percentile key, and their spreads."""
    by_key = ratios(real_pairs(groups, repeats))
    return by_key, spreads_of(by_key)


def real_vs_real_lines(groups: dict[str, list[Row]], repeats: Repeats) -> list[str]:
    by_key, spreads = real_vs_real(groups, repeats)
    return [f"real vs real: {_counted(*gated_within(spreads))}, each later real run against the first "
            f"(up to {most_repeats(repeats)} runs per load)",
            *_spread_table(by_key, spreads, "real_b/real_a")]


def record_validation(profile: str, spreads: dict[str, Any], args: argparse.Namespace,
                      real: tuple[int, int, int] | None = None) -> None:
    """Write the sim/real spread into the profile's `validation` block, with `real` (real vs real:
    cells within 15%, cells, real runs per load) where the real runs were repeated."""
    import datetime

    from cadence.host_load import cpu_model
    from cadence.sim.fidelity import RealVsReal, Validation

    v = Validation(spreads, datetime.date.today().isoformat(), f"{cpu_model()}, {os.cpu_count()} cores",
                   tuple(args.workloads.split(",")), tuple(int(x) for x in args.seeds.split(",")),
                   tuple(float(f) for f in args.fractions.split(",")), None if real is None else RealVsReal(*real))
    path = Path(profile)
    doc = json.loads(path.read_text())
    doc["validation"] = v.as_dict()
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote the validation into {path}: {v.describe()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", "--workload", default="chat", help="comma-separated built-in workloads")
    p.add_argument("--seeds", "--seed", default="0", help="comma-separated seeds")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--saturation-requests", type=int, default=400)
    p.add_argument("--fractions", default="0.3,0.6,0.85")
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--profile", default=str(ROOT / "src/cadence/sim/profiles/default.json"))
    p.add_argument("--out", default=str(ROOT / "results/sim_fidelity"))
    p.add_argument("--repeat", type=int, default=1,
                   help="real runs per workload, seed and load, each on a fresh server (default 1); from 2, the "
                        "output adds real vs real: how close the real runs come to each other")
    p.add_argument("--calibrate", action="store_true", help="calibrate a fresh profile first (about 4 minutes)")
    p.add_argument("--sim-only", action="store_true",
                   help="keep the real runs already under --out and simulate them again with --profile "
                        "(compare profiles on the same real runs; every recorded repeat is read)")
    p.add_argument("--no-step-scatter", action="store_true",
                   help="simulate every step at its mean, without the profile's step-time scatter "
                        "(kept as sim_RATE_mean; with --sim-only, compare both on the same real runs)")
    p.add_argument("--record-validation", action="store_true",
                   help="write the sim/real spread into the profile (read by `cadence sim` and `sim plan`)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: expected a whole number >= 1, got {args.repeat}")
    if args.no_step_scatter and args.record_validation:
        p.error("--record-validation: the profile's validation must be of how `cadence sim` simulates with it "
                "(its scatter on); drop --no-step-scatter")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        # Step times on a shared machine depend on what else runs: calibrate under today's conditions.
        args.profile = str(out / "profile.json")
        _run([*CADENCE, "calibrate", "--num-threads", "1", "--out", args.profile])
    groups: dict[str, list[Row]] = {}
    repeats: Repeats = {}
    for workload in args.workloads.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            args.workload, args.seed = workload, seed
            name = f"{workload}_seed{seed}"
            groups[name], repeats[name] = run_group(args, out / name)
    spreads = spreads_of(ratios(groups))
    text = (f"profile: {args.profile}\n{args.num_requests} requests per load, load average "
            f"{os.getloadavg()[0]:.2f} at the end\n\n" + "\n\n".join(
                f"{name}\n" + group_tables(rows, repeats[name]) for name, rows in groups.items()) + "\n\n"
            + summary(groups, spreads, repeats))
    (out / "table.md").write_text(text + "\n")
    print(text)
    if args.record_validation:
        real = None
        if most_repeats(repeats) > 1:
            real = (*gated_within(real_vs_real(groups, repeats)[1]), most_repeats(repeats))
        record_validation(args.profile, spreads, args, real)
    return 0


def group_tables(rows: list[Row], reals: list[list[dict]]) -> str:
    """A group's sim/real table (against the first real run), and its real/real one where repeated."""
    text = table(rows, REPORTED)
    if reals and max(len(r) for r in reals) > 1:
        text += "\n\nreal/real\n" + real_table(rows, reals)
    return text


def resimulate(args: argparse.Namespace, out: Path) -> tuple[list[Row], list[list[dict]]]:
    """The real runs kept under `out` (every repeat), each rate simulated again with `args.profile`."""
    sat = _summary(out / "saturation")["overall"]["request_throughput"]
    rows, reals = [], []
    for rate_text, dirs in recorded_reals(out).items():
        rate = float(rate_text)
        runs = [_summary(d) for d in dirs]
        sim = simulate(args, rate, out, runs[0]["meta"]["num_requests"])
        rows.append((rate / sat, rate, runs[0], sim))
        reals.append(runs)
    return rows, reals


def run_group(args: argparse.Namespace, out: Path) -> tuple[list[Row], list[list[dict]]]:
    """Saturation, then each load's real runs, each on a fresh server, and its simulation, for one
    workload and seed."""
    if args.sim_only:
        return resimulate(args, out)
    out.mkdir(parents=True, exist_ok=True)
    sat = saturation(args, out)
    print(f"{args.workload}, seed {args.seed}: simulated saturation {sat:.3f} req/s", flush=True)
    rows, reals = [], []
    for i, frac in enumerate(float(f) for f in args.fractions.split(",")):
        rate = frac * sat
        runs: dict[int, dict] = {}
        for k in repeat_order(args.repeat, i):
            # A fresh server per run: the same seed sends the same prompts, and a warm prefix cache
            # from the previous run would skip their prefills (the simulator starts cold too).
            cmd = [*CADENCE, "serve", "--num-threads", "1", "--port", str(args.port)]
            log = out / (f"serve_{frac:g}.log" if k == 1 else f"serve_{frac:g}_r{k}.log")
            with served(cmd, f"http://127.0.0.1:{args.port}/ready", log, cwd=ROOT, timeout=120):
                runs[k] = real_run(args, rate, real_dir(out, rate, k))
        rows.append((frac, rate, runs[1], simulate(args, rate, out, args.num_requests)))
        reals.append([runs[k] for k in sorted(runs)])
        print(group_tables(rows[-1:], reals[-1:]), flush=True)
    return rows, reals


if __name__ == "__main__":
    sys.exit(main())
