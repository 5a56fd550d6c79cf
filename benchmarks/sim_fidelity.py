"""Simulator fidelity: `cadence sim` against a real `cadence bench` run, same workload, same load.

    .venv/bin/python benchmarks/sim_fidelity.py [--calibrate] [--num-requests 120] [--fractions 0.3,0.6,0.85]
        [--profile src/cadence/sim/profiles/default.json] [--out results/sim_fidelity]

1. Saturation is the simulated request throughput of the workload when every request arrives at
   once (the engine is never idle; the tail is short next to the run for a few hundred requests).
2. For each fraction of it, a fresh `cadence serve` (default model, one torch thread, as
   calibrated; fresh so that no prefix cache carries over between loads) is benchmarked with `cadence bench` at that Poisson rate, and `cadence sim` runs the same workload
   (same seed: same sizes, same arrival times) with the same engine options.
3. The table gives p50 and p90 of TTFT, ITL and end-to-end latency, real and simulated, and the
   ratio sim/real. JSON summaries of every run are kept under --out.

The server, the client and this script share the machine; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]
METRICS = [("ttft", "p50"), ("ttft", "p90"), ("itl", "p50"), ("itl", "p90"), ("e2e", "p50"), ("e2e", "p90")]


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
    common = ["--workload", args.workload, "--num-requests", str(args.num_requests), "--rate", f"{rate:.4f}",
              "--seed", str(args.seed)]
    real, sim = out / f"real_{rate:.3f}", out / f"sim_{rate:.3f}"
    _run([*CADENCE, "bench", *common, "--base-url", f"http://127.0.0.1:{args.port}", "--no-progress",
          "--out", str(real)])
    # The server's own view (engine-side latencies) beside the client's, to tell the two apart.
    (real / "server_metrics.txt").write_text(httpx.get(f"http://127.0.0.1:{args.port}/metrics", timeout=10).text)
    _run([*CADENCE, "sim", *common, "--profile", args.profile, "--num-threads", "1", "--out", str(sim)])
    return _summary(real), _summary(sim)


def table(rows: list[tuple[float, float, dict, dict]]) -> str:
    head = "| load | rate (req/s) | metric | real (ms) | sim (ms) | sim/real |\n|---|---|---|---|---|---|"
    lines = [head]
    for frac, rate, real, sim in rows:
        for m, q in METRICS:
            a, b = real["overall"][m][q], sim["overall"][m][q]
            ratio = f"{b / a:.2f}" if a and b is not None else "n/a"
            lines.append(f"| {frac:.0%} | {rate:.3f} | {m} {q} | {_ms(a)} | {_ms(b)} | {ratio} |")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="chat")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--saturation-requests", type=int, default=400)
    p.add_argument("--fractions", default="0.3,0.6,0.85")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--profile", default=str(ROOT / "src/cadence/sim/profiles/default.json"))
    p.add_argument("--out", default=str(ROOT / "results/sim_fidelity"))
    p.add_argument("--calibrate", action="store_true", help="calibrate a fresh profile first (about 4 minutes)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        # Step times on a shared machine depend on what else runs: calibrate under today's conditions.
        args.profile = str(out / "profile.json")
        _run([*CADENCE, "calibrate", "--num-threads", "1", "--out", args.profile])
    sat = saturation(args, out)
    print(f"simulated saturation: {sat:.3f} req/s", flush=True)
    rows = []
    for frac in (float(f) for f in args.fractions.split(",")):
        # A fresh server per load: the same seed sends the same prompts, and a warm prefix cache
        # from the previous load would skip their prefills (the simulator starts cold too).
        cmd = [*CADENCE, "serve", "--num-threads", "1", "--port", str(args.port)]
        with served(cmd, f"http://127.0.0.1:{args.port}/ready", out / f"serve_{frac:g}.log", cwd=ROOT, timeout=120):
            real, sim = one_load(args, frac * sat, out)
        rows.append((frac, frac * sat, real, sim))
        print(table(rows[-1:]), flush=True)
    text = (f"profile: {args.profile}\nsaturation (simulated): {sat:.3f} req/s, {args.num_requests} requests of "
            f"{args.workload} per load, load average {os.getloadavg()[0]:.2f} at the end\n\n" + table(rows))
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
