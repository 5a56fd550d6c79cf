"""One knob at a time: the runs behind the results in docs/benchmarking.md.

    .venv/bin/python benchmarks/knobs.py [--only static,seqs,chunked,prefix,policy] [--out results/knobs]

Each experiment starts `cadence serve` (the default model) once per setting of one knob, runs the
same `cadence bench` command against it (same workload, seed, arrival times and prompt text), stops
it, and prints `cadence bench compare` of the two runs. Everything lands under --out/<experiment>/
(summary.json, requests.jsonl, latency CDFs; sweep.png for the sweep). Sized for a 2-core CPU
machine: about 20 minutes in all. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]


@dataclass
class Experiment:
    name: str
    question: str
    settings: list[tuple[str, list[str]]]  # (label, `cadence serve` flags)
    bench: list[str]  # `cadence bench` arguments after the server URL


EXPERIMENTS = [
    Experiment(
        "static", "static vs continuous batching, chat, offered load swept",
        [("static", ["--scheduler", "static"]), ("continuous", [])],
        ["sweep", "--workload", "chat", "--rates", "0.5,1,2", "--num-requests", "40"],
    ),
    Experiment(
        "seqs", "max_num_seqs 16 vs 64 at 4 requests/s, chat",
        [("seqs16", ["--max-num-seqs", "16"]), ("seqs64", ["--max-num-seqs", "64"])],
        ["run", "--workload", "chat", "--rate", "4", "--num-requests", "100"],
    ),
    Experiment(
        "chunked", "chunked prefill off vs on, long-prompt-mix at 0.4 requests/s",
        # Without chunking a step must hold a whole prompt: the token budget has to cover the longest
        # (4,096 + chat template), or the server refuses those prompts with a 400.
        [("unchunked", ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4608"]),
         ("chunked", ["--enable-chunked-prefill"])],
        ["run", "--workload", "long-prompt-mix", "--rate", "0.4", "--num-requests", "40", "--slo", "itl=0.5"],
    ),
    Experiment(
        "prefix", "prefix caching off vs on, shared-prefix at 1 request/s",
        [("no-cache", ["--no-enable-prefix-caching"]), ("cache", ["--enable-prefix-caching"])],
        ["run", "--workload", "shared-prefix", "--rate", "1", "--num-requests", "60", "--slo", "ttft=1"],
    ),
    Experiment(
        "policy", "fcfs vs fair share, mixed-tenants at 3 requests/s (past saturation: policies matter under contention)",
        [("fcfs", ["--policy", "fcfs"]), ("fair", ["--policy", "fair"])],
        ["run", "--workload", "mixed-tenants", "--rate", "3", "--num-requests", "120", "--slo", "ttft=2"],
    ),
]


def run(exp: Experiment, out: Path, port: int, seed: int) -> list[Path]:
    dirs = []
    for label, flags in exp.settings:
        d = out / exp.name / label
        d.mkdir(parents=True, exist_ok=True)
        cmd = [*CADENCE, "serve", "--port", str(port), *flags]
        with served(cmd, f"http://127.0.0.1:{port}/ready", d / "serve.log", cwd=ROOT):
            bench = [*CADENCE, "bench", *exp.bench[:1], "--base-url", f"http://127.0.0.1:{port}", *exp.bench[1:],
                     "--endpoint", "chat", "--seed", str(seed), "--label", label, "--out", str(d), "--no-progress"]
            print("$ cadence serve " + " ".join(flags) + "\n$ " + " ".join(bench[2:]), flush=True)
            subprocess.run(bench, check=True, cwd=ROOT)
        dirs.append(d)
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(e.name for e in EXPERIMENTS))
    ap.add_argument("--out", default="results/knobs")
    ap.add_argument("--port", type=int, default=8792)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    wanted = args.only.split(",")
    for exp in EXPERIMENTS:
        if exp.name not in wanted:
            continue
        print(f"\n=== {exp.name}: {exp.question} (load average {os.getloadavg()[0]:.1f})", flush=True)
        a, b = run(exp, Path(args.out), args.port, args.seed)
        # Two runs: the metric-by-metric ratios; two sweeps: a table per load and sweep_compare.png.
        subprocess.run([*CADENCE, "bench", "compare", str(a), str(b), "--out", str(Path(args.out) / exp.name)],
                       check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
