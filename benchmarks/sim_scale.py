"""Simulator scale: CPU seconds of a `cadence sim` command, this tree against a git revision, alternating.

    .venv/bin/python benchmarks/sim_scale.py [--baseline REV] [--rounds 2] [--repeat N]
        [--sim-args "--trace traces/azure_llm_2023_conv.csv --rate-scale 5 --replicas 128 --router least-loaded"]

The scale question is "100,000 requests in under a minute on one core": the Azure
conversation trace replayed five times (`--repeat 5`, 96,830 requests), the default. Other
`--sim-args` run as given unless `--repeat` is too. This machine's speed
moves by 1.5x from one hour to the next, so a single timing says little; this script runs the
command for this tree and for `--baseline` (checked out into a temporary worktree) one after the
other, `--rounds` times, and prints each run's CPU seconds (user + system of the child, the
simulator is single-threaded) and the ratio of the medians. It also checks that both sides print
the same report, but for the "simulated in" line. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "azure_llm_2023_conv.csv"
DEFAULT_SIM_ARGS = f"--trace {TRACE} --rate-scale 5 --replicas 128 --router least-loaded"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_sim(src: Path, sim_args: list[str]) -> tuple[float, str]:
    """CPU seconds of one `cadence sim` with `src` first on the path, and its report."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = _cpu_seconds()
    out = subprocess.run([sys.executable, "-m", "cadence.cli", "sim", *sim_args], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
    return _cpu_seconds() - before, out


def comparable(report: str) -> str:
    """The report without the line that says how long the simulation took."""
    return "\n".join(line for line in report.splitlines() if "simulated in" not in line)


def simulated_seconds(report: str) -> str:
    for line in report.splitlines():
        if "simulated in" in line:
            return line.split("simulated in ", 1)[1].split("s ", 1)[0]
    return "?"


def sim_command(sim_args: str, repeat: int | None) -> list[str]:
    """The sim command's arguments: `sim_args`, with `--repeat` (5 by default for the default
    workload, the issue's scale question; for another workload only if asked)."""
    if repeat is None and sim_args == DEFAULT_SIM_ARGS:
        repeat = 5
    return [*shlex.split(sim_args), *(["--repeat", str(repeat)] if repeat is not None else [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="a git revision to run alongside (default: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=None,
                    help="--repeat of the sim command (default: 5, the issue's 100,000, with the default "
                         "--sim-args; none added to other --sim-args)")
    ap.add_argument("--sim-args", default=DEFAULT_SIM_ARGS, help="the rest of the sim command")
    args = ap.parse_args(argv)
    if args.rounds < 1 or (args.repeat is not None and args.repeat < 1):
        ap.error("--rounds and --repeat must be >= 1")
    sim_args = sim_command(args.sim_args, args.repeat)
    sides = {"this tree": ROOT / "src"}
    worktree = None
    if args.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="cadence-baseline-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        sides[args.baseline] = worktree / "src"
    times: dict[str, list[float]] = {name: [] for name in sides}
    reports: dict[str, str] = {}
    try:
        print(f"$ cadence sim {' '.join(sim_args)}", flush=True)
        print(f"{'round':<7}{'side':<24}{'CPU s':>9}{'simulating s':>14}", flush=True)
        for r in range(1, args.rounds + 1):
            for name, src in sides.items():
                cpu, report = run_sim(src, sim_args)
                times[name].append(cpu)
                reports.setdefault(name, report)
                print(f"{r:<7}{name:<24}{cpu:>9.1f}{simulated_seconds(report):>14}", flush=True)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, m in medians.items():
        print(f"median {name}: {m:.1f} s of CPU")
    if args.baseline:
        ratio = medians["this tree"] / medians[args.baseline]
        same = comparable(reports["this tree"]) == comparable(reports[args.baseline])
        print(f"this tree / {args.baseline}: {ratio:.3f} (reports {'identical' if same else 'DIFFER'})")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
