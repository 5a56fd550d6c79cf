"""Served throughput and latency: cadence against a baseline, side by side, through the OpenAI API.

    .venv/bin/python benchmarks/bench_serve.py [--concurrencies 1,8,16,32] [--num-requests 128]
        [--baseline HEAD~1] [--llama-server auto|PATH|none] [--serve-args "..."] [--out results/serve]

For each concurrency, every server under test is started fresh, driven by `cadence bench` with the
built-in `chat` workload (same seed: same prompts, same exact output lengths, streaming chat
completions, fixed number of concurrent users), and stopped; the servers take turns at each
concurrency (in turned order at every other one) so background load hits them alike. Servers:
  cadence      this working tree (`cadence serve`, the default model)
  --baseline   cadence at another git revision (a temporary `git worktree`, same venv)
  llama.cpp    `llama-server` on the same GGUF, when the binary is on PATH (or given); skipped
               with a note otherwise
It prints output tokens/s, p95 TTFT and p50/p95 inter-token latency per server and the ratios
against cadence, and keeps every run's summary.json under --out.

The server and the client share the machine: on 2 cores the client's own CPU use is part of what
is measured, for every server alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    health: str = "/health"


def run_one(server: Server, port: int, conc: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [*server.cmd, "--port", str(port)]
    with served(cmd, f"http://127.0.0.1:{port}{server.health}", out / f"{server.name}-serve.log", env=server.env,
                cwd=ROOT, append=True):
        d = out / f"{server.name}-c{conc}"
        bench = [sys.executable, "-m", "cadence.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
                 "--endpoint", "chat", "--workload", "chat", "--concurrency", str(conc),
                 "--num-requests", str(args.num_requests or max(24, 6 * conc)), "--seed", str(args.seed), "--no-progress",
                 "--label", f"{server.name} c={conc}", "--out", str(d), *shlex.split(args.bench_args)]
        subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads((d / "summary.json").read_text())["overall"]


def servers(args: argparse.Namespace, tmp: Path) -> list[Server]:
    extra = shlex.split(args.serve_args)
    env = dict(os.environ)
    out = [Server("cadence", [sys.executable, "-m", "cadence.cli", "serve", *extra], env)]
    if args.baseline:
        tree = tmp / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        benv = {**env, "PYTHONPATH": str(tree / "src")}
        out.append(Server(f"cadence@{args.baseline}", [sys.executable, "-m", "cadence.cli", "serve", *extra], benv))
    binary = shutil.which("llama-server") if args.llama_server == "auto" else (
        None if args.llama_server == "none" else args.llama_server)
    if binary:
        from cadence.model.loader import default_model_path

        out.append(Server("llama.cpp", [binary, "-m", str(default_model_path()), "--parallel", str(args.llama_slots),
                                        "-c", str(4096 * args.llama_slots), "--host", "127.0.0.1"], env))
    elif args.llama_server != "none":
        print("note: no llama-server binary found (pass --llama-server PATH): llama.cpp not measured")
    return out


def row(name: str, s: dict) -> str:
    return (f"{name:<22} {s['output_token_throughput']:>9.1f} {s['ttft']['p95']:>9.3f} "
            f"{1e3 * s['itl']['p50']:>8.1f} {1e3 * s['itl']['p95']:>8.1f} {s['completed']:>5}/{s['requests']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrencies", default="1,8,16,32")
    ap.add_argument("--num-requests", type=int, default=0,
                    help="requests per run (default: max(24, 6 x concurrency), so the drain tail stays short)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline", default="", help="a git revision of cadence to compare against")
    ap.add_argument("--llama-server", default="auto", help="auto (llama-server on PATH), a path, or none")
    ap.add_argument("--llama-slots", type=int, default=16)
    ap.add_argument("--serve-args", default="", help="extra `cadence serve` flags for both cadence servers")
    ap.add_argument("--bench-args", default="",
                    help="extra `cadence bench` flags for every run, e.g. '--temperature 1 --top-p 0.95'")
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--out", default="results/serve")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        under_test = servers(args, Path(tmp))
        try:
            results: dict[int, dict[str, dict]] = {}
            for i, conc in enumerate(int(c) for c in args.concurrencies.split(",")):
                # The order turns at each concurrency: the server that runs second measured 5-9% faster
                # at one stream (the same two commits, swapped: 0.91x one way, 1.02x the other).
                order = under_test if i % 2 == 0 else under_test[::-1]
                runs = {s.name: run_one(s, args.port, conc, args, out) for s in order}
                results[conc] = {s.name: runs[s.name] for s in under_test}
                print(f"\nconcurrency {conc} ({args.num_requests or max(24, 6 * conc)} chat requests, load average "
                      f"{os.getloadavg()[0]:.1f})")
                print(f"{'server':<22} {'out tok/s':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8}  done")
                for name, s in results[conc].items():
                    print(row(name, s))
                base = results[conc]["cadence"]["output_token_throughput"]
                for name, s in results[conc].items():
                    if name != "cadence":
                        print(f"  cadence / {name}: {base / s['output_token_throughput']:.2f}x output tok/s")
                sys.stdout.flush()
            (out / "results.json").write_text(json.dumps(results, indent=1))
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / "baseline")], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
