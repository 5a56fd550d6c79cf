"""Colocated against disaggregated (xPyD) fleets in the simulator, with the synthetic GPU-like profile.

    .venv/bin/python benchmarks/sim_pd.py --out results/sim_pd [--sizes 4,16,64] [--quick]

For each fleet size N and each workload, `cadence sim` runs N colocated replicas (with 2,048-
and with 512-token prompt chunks) and the P/D splits with N/4, N/2 and 3N/4 prefill replicas (at least 1 of each), at a load that grows with N
(the same load per replica): the long-prompt mix at 10 requests/s per replica (100 requests per
replica), and the Azure code trace replayed N/4 times faster (4 replicas see it as recorded, 64
at 16 times its rate). The runs are simulations on virtual time: deterministic, not
timed. Writes each run's report under --out, rows.json, and table.md (the table in docs/fleet.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ENGINE = "--profile gpu-like-8b --kv-cache-memory 40GiB --max-num-seqs 256 --max-num-batched-tokens 2048"
SLOS = "--slo ttft=1 --slo itl=0.05"


def workloads(per_replica: int, trace_requests: int | None) -> dict[str, Callable[[int], str]]:
    """Each workload's load options at fleet size n (a function of n)."""
    limit = f" --num-requests {trace_requests}" if trace_requests else ""
    return {"long-prompt-mix": lambda n: f"--workload long-prompt-mix --num-requests {per_replica * n} --rate {10 * n}",
            "azure code": lambda n: f"--trace traces/azure_llm_2023_code.csv --rate-scale {n / 4:g}{limit}"}


def splits(n: int) -> list[int]:
    """Prefill replicas of the P/D fleets tried at size n."""
    return sorted({min(n - 1, max(1, round(n * s))) for s in (0.25, 0.5, 0.75)})


def commands(sizes: list[int], per_replica: int = 100, trace_requests: int | None = None) -> list[tuple[str, int, str, str]]:
    """(workload, size, fleet, the `cadence sim` command's options) of every run."""
    out = []
    for name, load in workloads(per_replica, trace_requests).items():
        for n in sizes:
            out.append((name, n, "colocated", f"{load(n)} {ENGINE} {SLOS} --replicas {n} --router prefix-affinity"))
            # The colocated answer to long prompts' interference: smaller chunks (vLLM's own advice).
            out.append((name, n, "colocated, 512-token chunks",
                        f"{load(n)} {ENGINE} {SLOS} --replicas {n} --router prefix-affinity "
                        "--max-num-batched-tokens 512"))
            for p in splits(n):
                out.append((name, n, f"{p}P{n - p}D",
                            f"{load(n)} {ENGINE} {SLOS} --prefill-replicas {p} --decode-replicas {n - p}"))
    return out


STRICT_ITL = 0.02  # a second, tighter objective on every gap between tokens, read from requests.jsonl


def run(runs: list[tuple[str, int, str, str]], out: Path) -> list[dict]:
    rows = []
    for k, (name, n, fleet, opts) in enumerate(runs):
        folder = out / f"run{k}"
        cmd = [sys.executable, "-m", "cadence.cli", "sim", *shlex.split(opts), "--out", str(folder)]
        print(f"[{k}] cadence sim {opts}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows.append(row(folder, name, n, fleet, opts))
    return rows


def row(folder: Path, name: str, n: int, fleet: str, opts: str) -> dict:
    """One run's figures, from its summary.json and requests.jsonl."""
    s = json.loads((folder / "summary.json").read_text())
    o, pd = s["overall"], s["meta"].get("disaggregated")
    return {"workload": name, "replicas": n, "fleet": fleet, "requests": o["requests"],
            "completed": o["completed"], "ttft_p95": o["ttft"]["p95"], "itl_p99": o["itl"]["p99"],
            "goodput": o["goodput"], "goodput_fraction": o["goodput_fraction"],
            "strict_fraction": strict_fraction(folder / "requests.jsonl", s["slos"]["ttft"], STRICT_ITL),
            "transfer_bytes_mean": pd["bytes_mean"] if pd else None,
            "transfer_s_p99": pd["seconds_p99"] if pd else None,
            "decode_admission_waits": pd["waited_for_decode_admission"] if pd else None,
            "command": f"cadence sim {opts}"}


def strict_fraction(requests: Path, ttft: float, itl: float) -> float:
    """The share of requests that succeeded with TTFT <= `ttft` and every gap between tokens <= `itl`."""
    good = total = 0
    for line in requests.read_text().splitlines():
        r = json.loads(line)
        total += 1
        times = r.get("token_times") or []
        ok = r.get("status") == 200 and r.get("error") is None and r.get("end_time") is not None
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        good += ok and r["first_token_time"] - r["send_time"] <= ttft and max(gaps, default=0.0) <= itl
    return good / total if total else 0.0


def _ms(v: float) -> str:
    return f"{v * 1e3:,.0f} ms"


def table(rows: list[dict]) -> str:
    """A row per run; the best of each size in bold."""
    best: dict[tuple[str, int], float] = {}
    best_strict: dict[tuple[str, int], float] = {}
    for r in rows:
        key = (r["workload"], r["replicas"])
        best[key] = max(best.get(key, 0.0), r["goodput_fraction"] or 0.0)
        best_strict[key] = max(best_strict.get(key, 0.0), r["strict_fraction"])
    lines = ["| workload | replicas | fleet | p95 TTFT | p99 ITL | goodput (TTFT <= 1 s, every ITL <= 50 ms) "
             f"| meet TTFT <= 1 s, every ITL <= {STRICT_ITL * 1e3:.0f} ms | KV moved per request | transfer p99 |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        good = f"{r['goodput']:.1f} req/s ({r['goodput_fraction']:.0%})"
        if (r["goodput_fraction"] or 0.0) == best[(r["workload"], r["replicas"])]:
            good = f"**{good}**"
        moved = "-" if r["transfer_bytes_mean"] is None else f"{r['transfer_bytes_mean'] / 1e6:.0f} MB"
        tp99 = "-" if r["transfer_s_p99"] is None else f"{r['transfer_s_p99'] * 1e3:.1f} ms"
        strict = f"{r['strict_fraction']:.0%}"
        if r["strict_fraction"] == best_strict[(r["workload"], r["replicas"])]:
            strict = f"**{strict}**"
        lines.append(f"| {r['workload']} | {r['replicas']} | {r['fleet']} | {_ms(r['ttft_p95'])} | {_ms(r['itl_p99'])} "
                     f"| {good} | {strict} | {moved} | {tp99} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/sim_pd", help="folder for the runs, rows.json and table.md")
    p.add_argument("--sizes", default="4,16,64", help="fleet sizes, comma-separated (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="sizes 4 and 8 only")
    p.add_argument("--requests-per-replica", type=int, default=100,
                   help="long-prompt-mix requests per replica (default %(default)s)")
    p.add_argument("--trace-requests", type=int, default=None, help="the trace's first N requests (default: all)")
    args = p.parse_args(argv)
    sizes = [4, 8] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 2:
        p.error("--sizes: fleet sizes of at least 2 (one prefill and one decode replica)")
    if args.requests_per_replica < 1 or (args.trace_requests is not None and args.trace_requests < 1):
        p.error("--requests-per-replica, --trace-requests: must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(commands(sizes, args.requests_per_replica, args.trace_requests), out)
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "table.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
