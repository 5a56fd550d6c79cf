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

Serve-flag variants of this tree, in one run:

    .venv/bin/python benchmarks/bench_serve.py --variants 'bf16=;kv8=--kv-cache-dtype int8;act8=--activation-dtype
        int8;both=--kv-cache-dtype int8 --activation-dtype int8' [--cells chat1,chat8,chat32,decode2k,prefill4k]
        [--rounds 2]

Each variant is `cadence serve` of this tree with `--serve-args` and its own flags; the first is the
reference. Every round runs every cell (`CELLS`) once per variant, each on a fresh server, the
variants in an order that turns from cell to cell and round to round. Before each cell's run the
driver times torch's bfloat16 2048^3 matmul (`bench_runner.matmul_gflops`) with no server busy; the
table gives each figure's "mm" as that GFLOP/s over the best of the whole run, so a figure taken
while the machine was busy shows it. It prints, per cell, each variant's figure per round and its
ratio to the reference in the same round (and the median), and writes results.json under --out.
With `--warm` every variant's server is started once and kept up (ports --port, --port + 1, ...),
warmed with two requests, and the runs alternate between them in the same turned order: the
servers see the same moments of the machine, run by run, without a start-up between them. Round r
sends the requests of seed --seed + r to every variant, so no round finds an earlier round's
prompts in the servers' prefix caches.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
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
    workload = ["--workload", "chat", "--num-requests", str(args.num_requests or max(24, 6 * conc))]
    return run_bench(server, port, conc, workload, out / f"{server.name}-c{conc}", f"{server.name} c={conc}", args)


def run_bench(server: Server, port: int, conc: int, workload: list[str], d: Path, label: str,
              args: argparse.Namespace, serve_extra: tuple[str, ...] = ()) -> dict:
    """`server` started fresh (plus `serve_extra` flags), driven by `cadence bench` with `workload`'s
    flags at `conc` concurrent requests; its summary's "overall" (results under `d`)."""
    with serving(server, port, d.parent, serve_extra):
        return bench_once(port, conc, workload, d, label, args)


def serving(server: Server, port: int, logs: Path, serve_extra: tuple[str, ...] = ()) -> AbstractContextManager:
    """`server` up on `port` (plus `serve_extra` flags) while the context lasts, its log under `logs`."""
    cmd = [*server.cmd, *serve_extra, "--port", str(port)]
    return served(cmd, f"http://127.0.0.1:{port}{server.health}", logs / f"{server.name}-serve.log",
                  env=server.env, cwd=ROOT, append=True)


def bench_once(port: int, conc: int, workload: list[str], d: Path, label: str, args: argparse.Namespace,
               seed: int | None = None) -> dict:
    """`cadence bench` with `workload`'s flags at `conc` concurrent requests against the server on
    `port` (seeded `seed`, else --seed); its summary's "overall" (results under `d`)."""
    seed = args.seed if seed is None else seed
    bench = [sys.executable, "-m", "cadence.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
             "--endpoint", "chat", *workload, "--concurrency", str(conc), "--seed", str(seed),
             "--no-progress", "--label", label, "--out", str(d), *shlex.split(args.bench_args)]
    subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((d / "summary.json").read_text())["overall"]


# -- serve-flag variants of this tree (--variants) ---------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One measurement: `cadence bench` flags at a concurrency, and the figure read from its summary."""

    label: str
    conc: int
    requests: int  # default requests per run (--num-requests overrides)
    workload: tuple[str, ...]  # cadence bench flags, less --num-requests and --concurrency
    figure: str  # the figure's name in the table
    read: Callable[[dict, int, Path], float]  # (summary "overall", streams, run directory) -> the figure
    serve_extra: tuple[str, ...] = ()  # cadence serve flags this cell needs, for every variant
    record_steps: bool = False  # the server writes its steps to steps.jsonl in the run directory


def _output_tok_s(s: dict, streams: int, d: Path) -> float:
    return s["output_token_throughput"]


def _decode_tok_s(s: dict, streams: int, d: Path) -> float:
    """Tokens a second of the server's all-decode steps with every stream in them (from its step
    log): `streams` over their median duration. The steps that decode beside a prompt's chunk, while
    the other streams are still being prefilled, are not this figure."""
    full = [json.loads(line) for line in (d / "steps.jsonl").read_text().splitlines()]
    times = [x["duration"] for x in full if x["prefill_tokens"] == 0 and x["decode_seqs"] == streams]
    if not times:
        raise RuntimeError(f"{d}: no step decoded all {streams} streams at once (outputs too short?)")
    return streams / statistics.median(times)


def _prefill_tok_s(s: dict, streams: int, d: Path) -> float:
    """Prompt tokens a second of one prompt alone: its tokens over the median time to first token."""
    return s["prompt_tokens"] / s["completed"] / s["ttft"]["p50"]


def _random(prompt: int, output: int) -> tuple[str, ...]:
    return ("--dataset-name", "random", "--random-input-len", str(prompt), "--random-output-len", str(output),
            "--ignore-eos")


CELLS = {
    "chat1": Cell("chat mix, 1 stream", 1, 3, ("--workload", "chat"), "output tok/s", _output_tok_s),
    "chat8": Cell("chat mix, 8 streams", 8, 8, ("--workload", "chat"), "output tok/s", _output_tok_s),
    "chat32": Cell("chat mix, 32 streams", 32, 32, ("--workload", "chat"), "output tok/s", _output_tok_s),
    # 32 contexts of 2,112 tokens need ~1.5 GiB of bfloat16 K/V: every variant gets room for all 32 at
    # once, so the bfloat16 cache's smaller capacity does not turn this into fewer streams. Prompt
    # chunks of 4,096 tokens: the 32 prompts take 16 steps, so the first streams have output left when
    # the last prompt is in and every stream decodes together (the figure's steps).
    "decode2k": Cell("decode, 2,048-token contexts, 32 streams", 32, 32, _random(2048, 64), "decode tok/s",
                     _decode_tok_s, ("--kv-cache-memory", "2GiB", "--max-num-batched-tokens", "4096"), True),
    "prefill4k": Cell("prefill, one 4,096-token prompt", 1, 1, _random(4096, 1), "prefill tok/s", _prefill_tok_s),
}


def parse_variants(spec: str) -> list[tuple[str, list[str]]]:
    """'bf16=;kv8=--kv-cache-dtype int8' -> [("bf16", []), ("kv8", ["--kv-cache-dtype", "int8"])]."""
    out: list[tuple[str, list[str]]] = []
    for part in (p.strip() for p in spec.split(";")):
        name, eq, flags = part.partition("=")
        name = name.strip()
        if not part or not eq or not name:
            raise ValueError(f"--variants: {part!r} is not NAME=FLAGS (an empty FLAGS is the default server)")
        if name in (n for n, _ in out):
            raise ValueError(f"--variants: {name!r} is named twice")
        out.append((name, shlex.split(flags)))
    if len(out) < 2:
        raise ValueError("--variants: give at least two (the first is the reference the others are compared to)")
    return out


def turned(items: list, k: int) -> list:
    """items rotated left by k: each variant takes each place in turn from cell to cell."""
    k %= len(items)
    return items[k:] + items[:k]


def variant_table(cells: list[str], names: list[str], figures: dict, mm: dict) -> str:
    """The table: figures[cell][name] and mm[cell][name] are per-round lists (figure, matmul share)."""
    lines = []
    ref = names[0]
    for cell in cells:
        c = CELLS[cell]
        lines.append(f"\n{c.label} ({c.figure}; mm: matmul GFLOP/s before the run / the run's best)")
        lines.append(f"{'variant':<10} {'per round: figure [mm]':<40} {'vs ' + ref + ' per round':<24} median")
        for name in names:
            vals = figures[cell][name]
            per_round = "  ".join(f"{v:8.1f} [{m:.2f}]" for v, m in zip(vals, mm[cell][name], strict=True))
            ratios = [v / r for v, r in zip(vals, figures[cell][ref], strict=True)]
            shown = " ".join(f"{x:.2f}" for x in ratios)
            lines.append(f"{name:<10} {per_round:<40} {shown:<24} {statistics.median(ratios):.2f}x")
    return "\n".join(lines)


def matmul_probe() -> Callable[[], float]:
    """bench_runner's bfloat16 2048^3 matmul GFLOP/s, measured in this process. Importing
    bench_runner sets OMP_WAIT_POLICY for this process's torch; the servers keep the environment
    this script was started with."""
    had = os.environ.get("OMP_WAIT_POLICY")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_runner import matmul_gflops

    if had is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    import torch

    return lambda: matmul_gflops(torch.bfloat16)


def run_variants(args: argparse.Namespace, out: Path) -> None:
    variants = parse_variants(args.variants)
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        raise SystemExit(f"--cells: unknown {', '.join(unknown)} (of {', '.join(CELLS)})")
    env = dict(os.environ)
    base = [sys.executable, "-m", "cadence.cli", "serve", *shlex.split(args.serve_args)]
    under_test = [Server(name, [*base, *flags], env) for name, flags in variants]
    names = [s.name for s in under_test]
    if args.warm:
        special = [c for c in cells if CELLS[c].serve_extra or CELLS[c].record_steps]
        if special:
            raise SystemExit(f"--warm: {', '.join(special)} need(s) servers of their own flags; leave them out")
    gflops = matmul_probe()
    figures: dict = {c: {n: [] for n in names} for c in cells}
    raw_mm: dict = {c: {n: [] for n in names} for c in cells}
    summaries: dict = {c: {n: [] for n in names} for c in cells}
    ports = {server.name: args.port + i for i, server in enumerate(under_test)}
    turn = 0
    with ExitStack() as stack:  # with --warm: the servers, stopped when the rounds end or fail
        if args.warm:  # every variant's server up for the whole run, on a port of its own, warmed once
            for server in under_test:
                stack.enter_context(serving(server, ports[server.name], out))
                bench_once(ports[server.name], 1, ["--workload", "chat", "--num-requests", "2"],
                           out / f"warm-{server.name}", f"{server.name} warm-up", args, args.seed + args.rounds)
        for r in range(args.rounds):
            for cell in cells:
                c = CELLS[cell]
                n = args.num_requests or c.requests
                for server in turned(under_test, turn):
                    raw_mm[cell][server.name].append(gflops())
                    d = out / f"r{r + 1}-{cell}-{server.name}"
                    record = ("--record-steps", str((d / "steps.jsonl").resolve())) if c.record_steps else ()
                    d.mkdir(parents=True, exist_ok=True)
                    workload, label = [*c.workload, "--num-requests", str(n)], f"{server.name} {cell} round {r + 1}"
                    # Warm servers keep their prefix caches: each round its own requests (seed + round),
                    # the same for every variant within it.
                    s = (bench_once(ports[server.name], c.conc, workload, d, label, args, args.seed + r) if args.warm else
                         run_bench(server, args.port, c.conc, workload, d, label, args, (*c.serve_extra, *record)))
                    figures[cell][server.name].append(c.read(s, min(c.conc, n), d))
                    summaries[cell][server.name].append(s)
                    print(f"round {r + 1} {cell:<10} {server.name:<10} {figures[cell][server.name][-1]:9.1f} "
                          f"{c.figure}, matmul {raw_mm[cell][server.name][-1]:.0f} GFLOP/s, load average "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
                turn += 1
    peak = max(v for per in raw_mm.values() for vs in per.values() for v in vs)
    mm = {c: {n: [v / peak for v in vs] for n, vs in per.items()} for c, per in raw_mm.items()}
    print(f"\nratios against {names[0]}; matmul peak of the run {peak:.0f} GFLOP/s (bfloat16 2048^3)")
    print(variant_table(cells, names, figures, mm))
    (out / "results.json").write_text(json.dumps(
        {"variants": dict(variants), "rounds": args.rounds, "matmul_peak_gflops": peak, "figures": figures,
         "matmul_gflops": raw_mm, "summaries": summaries}, indent=1))


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
    ap.add_argument("--variants", default="",
                    help="NAME=FLAGS;NAME=FLAGS...: serve-flag variants of this tree against the first, over --cells "
                         "(instead of --baseline, llama.cpp and --concurrencies)")
    ap.add_argument("--cells", default=",".join(CELLS), help=f"with --variants: of {', '.join(CELLS)}")
    ap.add_argument("--rounds", type=int, default=2, help="with --variants: rounds of every cell (default 2)")
    ap.add_argument("--warm", action="store_true",
                    help="with --variants: each variant's server started once (ports --port, --port + 1, ...) and "
                         "kept up, the runs alternating between them, instead of a fresh server per run: for "
                         "cells where start-up and a cold cache are not what is measured")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.variants:
        run_variants(args, out)
        return
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
