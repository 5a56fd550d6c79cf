"""What structured output costs a server under load: plain traffic against a mix where a fraction of
the requests (half by default) ask for JSON that follows a schema.

    .venv/bin/python benchmarks/bench_structured_mix.py [--concurrency 8] [--num-requests 40] [--rounds 3]

Each cell is a fresh `cadence serve` (the default model) and one `cadence bench` run against it:
the chat workload, `--concurrency` streams, `--num-requests` requests, exact output lengths
(`ignore_eos` and `min_tokens`). The plain and the mixed cell of a round send the same prompts with
the same lengths (the same seed); in the mixed one, `cadence bench --structured-fraction` gives the
fraction of requests chosen by that seed the built-in extraction schema as their
`response_format`. A constrained request stops where its JSON is complete, which may come before
its `max_tokens`: the table gives each side's mean output tokens per request so that this shows.
Before its run each cell sends one short request of its own kind, untimed, so that the grammar
library's one-time loading (about 2 s, on the first constrained request a server sees) is not
counted as the cost of the constraint. The order of the two cells flips every round. It prints
each cell's output tokens/s and p95 inter-token latency, and the mixed / plain ratios (their
median over the rounds).

Server and client share the machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from cadence.bench.client import EXTRACTION_RESPONSE_FORMAT
from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]


@dataclass
class Cell:
    tok_s: float
    itl_p95: float
    tokens_per_request: float  # mean output tokens of the completed requests
    structured_tokens: float | None  # the same, over the requests sent with the schema
    errors: int


def one_cell(mixed: bool, rnd: int, args: argparse.Namespace, out: Path) -> Cell:
    name = f"{'mixed' if mixed else 'plain'}_r{rnd}"
    serve = [*CADENCE, "serve", "--host", "127.0.0.1", "--port", str(args.port), *(["--tiny"] if args.tiny else [])]
    bench = [*CADENCE, "bench", "--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "chat",
             "--workload", "chat", "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
             "--seed", str(args.seed + rnd), "--no-progress", "--label", name, "--out", str(out / name)]
    if args.max_output_tokens:
        bench += ["--max-output-tokens", str(args.max_output_tokens)]
    if mixed:
        bench += ["--structured-fraction", str(args.fraction)]
    with served(serve, f"http://127.0.0.1:{args.port}/health", out / f"{name}.log", cwd=ROOT, timeout=300):
        warm_up(args.port, mixed)
        subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    summary = json.loads((out / name / "summary.json").read_text())["overall"]
    records = [json.loads(line) for line in (out / name / "requests.jsonl").read_text().splitlines() if line]
    done = [r for r in records if r["status"] == 200 and r["error"] is None]
    structured = [r["output_tokens"] for r in done if r.get("structured")]
    return Cell(tok_s=float(summary["output_token_throughput"]), itl_p95=float(summary["itl"]["p95"]),
                tokens_per_request=statistics.fmean(r["output_tokens"] for r in done) if done else 0.0,
                structured_tokens=statistics.fmean(structured) if structured else None, errors=summary["errors"])


def warm_up(port: int, structured: bool) -> None:
    body: dict = {"messages": [{"role": "user", "content": "Describe a town by a river."}], "max_tokens": 8}
    if structured:
        body["response_format"] = EXTRACTION_RESPONSE_FORMAT
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()


def _row(name: str, c: Cell) -> str:
    schema = f"{c.structured_tokens:.1f}" if c.structured_tokens is not None else "-"
    return (f"| {name} | {c.tok_s:.1f} | {c.itl_p95 * 1000:.1f} | {c.tokens_per_request:.1f} | {schema} | "
            f"{c.errors} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8, help="streams (default %(default)s)")
    p.add_argument("--num-requests", type=int, default=40, help="requests per cell (default %(default)s)")
    p.add_argument("--fraction", type=float, default=0.5,
                   help="the mixed cells' --structured-fraction (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="plain/mixed pairs, order flipped each round "
                                                         "(default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="round r uses seed + r (default %(default)s)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="clamp the workload's output lengths")
    p.add_argument("--tiny", action="store_true", help="serve the tiny random model (a check that the script runs)")
    p.add_argument("--port", type=int, default=8024)
    p.add_argument("--out", default=str(ROOT / "results/structured_mix"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| cell | output tok/s | p95 ITL ms | tokens/request | tokens/schema request | errors |",
             "|---|---|---|---|---|---|"]
    tok_ratios, itl_ratios = [], []
    for rnd in range(args.rounds):
        order = (False, True) if rnd % 2 == 0 else (True, False)
        cells = {mixed: one_cell(mixed, rnd, args, out) for mixed in order}
        plain, mixed = cells[False], cells[True]
        tok_ratios.append(mixed.tok_s / plain.tok_s)
        itl_ratios.append(mixed.itl_p95 / plain.itl_p95)
        for row in (_row(f"plain, round {rnd}", plain), _row(f"mixed, round {rnd}", mixed)):
            lines.append(row)
            print(row, flush=True)
    lines += ["", f"mixed / plain output tok/s per round: {', '.join(f'{r:.3f}' for r in tok_ratios)} "
                  f"(median {statistics.median(tok_ratios):.3f})",
              f"mixed / plain p95 ITL per round: {', '.join(f'{r:.3f}' for r in itl_ratios)} "
              f"(median {statistics.median(itl_ratios):.3f})"]
    text = "\n".join(lines)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
