"""Disaggregated prefill and decode against colocated replicas, on this machine.

    .venv/bin/python benchmarks/bench_pd.py [--num-requests 60] [--rate 0.3] [--seeds 0] [--out results/pd]

Two servers in turn, each started fresh, the order rotating from seed to seed:
  pd         `cadence serve --prefill-replicas 1 --decode-replicas 1 --replica-threads 1`
  colocated  `cadence serve --replicas 2 --replica-threads 1`
each with the same engine flags (`--num-kv-blocks`, `--max-num-seqs`), sent the long-prompt mix
(`cadence bench --workload long-prompt-mix`: chats, and one request in five a document of about
2,500 tokens) with Poisson arrivals. Per run: TTFT p50/p95, ITL p50/p99, goodput under the SLOs
(`--slo`, default TTFT 5 s and ITL 0.2 s), and from the server's /metrics the KV moved (bytes,
per request) and the transfer time per request (mean).

`--scale-lengths 0.25 --num-requests 8` is a quick check that everything runs (not a measurement).
Servers, client and this script share the machine's cores: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]
SERVERS = ("pd", "colocated")
TRANSFER = ("cadence:kv_transfer_bytes_total", "cadence:kv_transfer_seconds_sum", "cadence:kv_transfer_seconds_count")


def serve_cmd(name: str, args: argparse.Namespace) -> list[str]:
    pools = ["--prefill-replicas", "1", "--decode-replicas", "1"] if name == "pd" else ["--replicas", "2"]
    return [*CADENCE, "serve", *pools, "--replica-threads", "1", "--num-kv-blocks", str(args.kv_blocks),
            "--max-num-seqs", str(args.max_num_seqs), "--port", str(args.port)]


def transfer_counters(port: int) -> dict[str, float]:
    """The fleet's summed KV transfer counters (zero on a colocated fleet)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    got = dict.fromkeys(TRANSFER, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in got and "replica" not in sample.labels:
                got[sample.name] += sample.value
    return got


def one_run(name: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    run = out / f"{name}_s{seed}"
    load = ["--workload", "long-prompt-mix", "--num-requests", str(args.num_requests), "--arrival", "poisson",
            "--rate", str(args.rate), "--seed", str(seed), "--scale-lengths", str(args.scale_lengths),
            *(x for s in args.slo for x in ("--slo", s))]
    with served(serve_cmd(name, args), f"http://127.0.0.1:{args.port}/health", out / f"{name}_s{seed}.log",
                cwd=ROOT, timeout=600):
        before = transfer_counters(args.port)
        cmd = [*CADENCE, "bench", *load, "--base-url", f"http://127.0.0.1:{args.port}", "--no-progress",
               "--label", f"{name} seed {seed}", "--out", str(run)]
        print("$ " + " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = transfer_counters(args.port)
    moved = {k: after[k] - before[k] for k in TRANSFER}
    overall = json.loads((run / "summary.json").read_text())["overall"]
    return {"server": name, "seed": seed, "overall": overall, "transfer": moved}


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}"


def table(rows: list[dict]) -> str:
    lines = ["| server | seed | TTFT p50 / p95 (ms) | ITL p50 / p99 (ms) | goodput | KV moved per request (MiB) | "
             "transfer per request (ms) |", "|---|---:|---|---|---:|---:|---:|"]
    for r in rows:
        o, t = r["overall"], r["transfer"]
        n = t["cadence:kv_transfer_seconds_count"]
        per_req = f"{t['cadence:kv_transfer_bytes_total'] / n / 2**20:.1f}" if n else "-"
        per_time = _ms(t["cadence:kv_transfer_seconds_sum"] / n) if n else "-"
        good = o.get("goodput_fraction")
        lines.append(f"| {r['server']} | {r['seed']} | {_ms(o['ttft']['p50'])} / {_ms(o['ttft']['p95'])} | "
                     f"{_ms(o['itl']['p50'])} / {_ms(o['itl'].get('p99'))} | "
                     f"{'n/a' if good is None else f'{good:.0%}'} | {per_req} | {per_time} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=0.3, help="requests/s (Poisson)")
    p.add_argument("--seeds", default="0", help="comma-separated")
    p.add_argument("--scale-lengths", type=float, default=1.0, help="scale the workload's prompt and output lengths")
    p.add_argument("--kv-blocks", type=int, default=600, help="KV blocks of each replica")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--slo", action="append", default=None, help="as cadence bench's (default ttft=5, itl=0.2)")
    p.add_argument("--port", type=int, default=18731)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "pd")
    args = p.parse_args()
    args.slo = args.slo or ["ttft=5", "itl=0.2"]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for k, seed in enumerate(int(s) for s in args.seeds.split(",")):
        order = SERVERS if k % 2 == 0 else SERVERS[::-1]
        rows += [one_run(name, seed, args, args.out) for name in order]
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
