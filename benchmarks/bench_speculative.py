"""What speculative decoding (n-gram drafts, or a draft model's) does to a served model's throughput:
off, fixed k and adaptive k, on an input-grounded workload and on the chat mix.

    .venv/bin/python benchmarks/bench_speculative.py [--rounds 3] [--num-requests 16] [--k 4]
    .venv/bin/python benchmarks/bench_speculative.py --method draft_model --draft DIR   # drafts from a draft model
    .venv/bin/python benchmarks/bench_speculative.py --loaded-cell 64:8   # also chat at 64 streams, k 8
    .venv/bin/python benchmarks/bench_speculative.py --tiny --rounds 1 --num-requests 2   # a check that it runs

Each cell is a fresh `cadence serve` (the default model, `--num-threads 2`) and one `cadence bench`
run against it, greedy (`--temperature 0`), the model stopping where it likes within each request's
output length (`--no-exact-output`: the exact lengths `cadence bench` forces otherwise come with
`min_tokens`, under which no request speculates; greedy output is the same with speculation as
without, so every mode generates the same tokens). The cells:

- `grounded@1`: an input-grounded workload at one stream: each request shows the model a function
  from Python's standard library (`inspect.getsource` of the functions in `GROUNDED_SOURCES`, the
  text the interpreter running this script ships) and asks for it back with a docstring added, so
  the answer quotes its input: where n-gram drafts pay;
- `chat@1`, `chat@8`, `chat@32`: `cadence bench`'s built-in chat mix at 1, 8 and 32 streams;
- with `--loaded-cell 64:8`, also `chat@64 k8`: the chat mix at 64 streams with k = 8, where fixed k
  loses throughput to speculation off in model time (benchmarks/spec_replay.py) and adaptive k
  does not.

Each is run with speculation off, with drafts at fixed k (`"adaptive": false`) and with
adaptive k (the default); the drafts are n-gram lookups (`--method ngram`, the default) or a draft
model's (`--method draft_model --draft DIR`, for example one `python -m cadence.model.make_draft`
wrote), in an order that rotates every round. It prints per cell the output
tokens/s, the mean TPOT, the acceptance rate and the mean k per verification row (from the
server's /metrics, counted over the timed run), and the ratios of tokens/s and TPOT to the cell
with speculation off, per round and their median over the rounds.

Server and client share the machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from cadence.bench.launch import served

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]
MODES = ("off", "fixed", "adaptive")
# Functions of the standard library whose source the grounded prompts quote (stable text, shipped
# with every Python).
GROUNDED_SOURCES = ("textwrap.TextWrapper._wrap_chunks", "textwrap.dedent", "textwrap.indent", "shlex.split",
                    "shlex.quote", "fnmatch.translate", "fnmatch.filter", "string.capwords", "glob.glob",
                    "difflib.SequenceMatcher.find_longest_match", "calendar.monthrange",
                    "json.encoder.py_encode_basestring", "csv.Sniffer._guess_quote_and_delimiter", "heapq.merge",
                    "heapq.nsmallest", "difflib.get_close_matches")
# (Python source only: functions written in C, and the modules the interpreter freezes into itself
# such as posixpath, have none for `inspect.getsource` to read.)
SPEC_COUNTERS = ("cadence:spec_decode_num_drafts_total", "cadence:spec_decode_num_draft_tokens_total",
                 "cadence:spec_decode_num_accepted_tokens_total")


@dataclass
class Cell:
    tok_s: float
    tpot_ms: float
    acceptance: float | None  # accepted over verified draft tokens
    mean_k: float | None  # draft tokens per verification row
    errors: int


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def grounded_requests(path: Path, num: int, max_tokens: int) -> None:
    """The grounded workload as a `cadence bench --requests-file`: one function's source per request."""
    lines = []
    for i in range(num):
        src = inspect.getsource(_resolve(GROUNDED_SOURCES[i % len(GROUNDED_SOURCES)]))
        src = "\n".join(src.splitlines()[:60])  # long functions cut, so prompts stay a few hundred tokens
        text = ("Here is a Python function. Write it out again exactly, with a one-line docstring added "
                f"under its signature.\n\n```python\n{src}\n```")
        lines.append(json.dumps({"prompt_tokens": max(1, len(text) // 4), "output_tokens": max_tokens,
                                 "messages": [{"role": "user", "content": text}]}))
    path.write_text("\n".join(lines) + "\n")


def spec_config(mode: str, k: int, method: str = "ngram", draft: str | None = None) -> list[str]:
    if mode == "off":
        return []
    cfg: dict[str, object] = {"method": method, "num_speculative_tokens": k, "adaptive": mode == "adaptive"}
    if method == "ngram":
        cfg.update(prompt_lookup_min=2, prompt_lookup_max=4)
    else:
        cfg["model"] = draft
    return ["--speculative-config", json.dumps(cfg)]


def spec_counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0]
        if name in out:
            out[name] = float(value)
    return out


def warm_up(port: int) -> None:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def one_cell(workload: str, streams: int, mode: str, rnd: int, args: argparse.Namespace, out: Path,
             k: int | None = None) -> Cell:
    k = args.k if k is None else k
    name = f"{workload}{streams}{'' if k == args.k else f'k{k}'}_{mode}_r{rnd}"
    serve = [*CADENCE, "serve", "--host", "127.0.0.1", "--port", str(args.port), "--num-threads",
             str(args.num_threads), *(["--tiny"] if args.tiny else []), *spec_config(mode, k, args.method, args.draft),
             *shlex.split(args.serve_args)]
    source = ["--requests-file", str(out / "grounded.jsonl")] if workload == "grounded" else ["--workload", "chat"]
    num = args.num_requests if streams == 1 else max(args.num_requests, 2 * streams)
    bench = [*CADENCE, "bench", "--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "chat", *source,
             "--concurrency", str(streams), "--num-requests", str(num), "--temperature", "0", "--no-exact-output",
             "--seed", str(args.seed + rnd), "--no-progress", "--label", name, "--out", str(out / name)]
    if args.max_output_tokens:
        bench += ["--max-output-tokens", str(args.max_output_tokens)]
    with served(serve, f"http://127.0.0.1:{args.port}/health", out / f"{name}.log", cwd=ROOT, timeout=600):
        warm_up(args.port)
        before = spec_counters(args.port)
        subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        after = spec_counters(args.port)
    rows, drafted, accepted = (after[c] - before[c] for c in SPEC_COUNTERS)
    summary = json.loads((out / name / "summary.json").read_text())["overall"]
    tpot = summary["tpot"]["mean"]
    return Cell(tok_s=float(summary["output_token_throughput"] or 0.0),
                tpot_ms=float(tpot) * 1000 if tpot is not None else float("nan"),
                acceptance=accepted / drafted if drafted else None, mean_k=drafted / rows if rows else None,
                errors=int(summary["errors"]))


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _loaded_cell(text: str) -> tuple[int, int]:
    streams, _, k = text.partition(":")
    try:
        return int(streams), int(k)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STREAMS:K such as 64:8, got {text!r}") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds; the order of the modes rotates (default %(default)s)")
    p.add_argument("--num-requests", type=int, default=16,
                   help="requests per single-stream cell; at N streams at least 2N (default %(default)s)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default %(default)s)")
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram",
                   help="where the drafts come from (default %(default)s)")
    p.add_argument("--draft", default=None, help="with --method draft_model: the draft model (a GGUF file or "
                   "Hugging Face directory sharing the served model's tokenizer)")
    p.add_argument("--grounded-output-tokens", type=int, default=256,
                   help="output tokens of each grounded request (default %(default)s)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="clamp every workload's output lengths")
    p.add_argument("--streams", default="1,8,32", help="chat mix concurrencies (default %(default)s; \"\" for none)")
    p.add_argument("--loaded-cell", type=_loaded_cell, action="append", default=[], metavar="STREAMS:K",
                   help="also run the chat mix at STREAMS streams with K drafts, e.g. 64:8 (where fixed k loses "
                   "in the replay, benchmarks/spec_replay.py); repeatable")
    p.add_argument("--num-threads", type=int, default=2, help="the server's torch threads (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="round r uses seed + r (default %(default)s)")
    p.add_argument("--tiny", action="store_true", help="serve the tiny random model (a check that the script runs)")
    p.add_argument("--serve-args", default="", help="extra `cadence serve` flags for every cell, e.g. "
                   "\"--cost-profile PATH\" (the step-cost profile adaptive k prices drafts with)")
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--out", default=str(ROOT / "results/speculative"))
    args = p.parse_args()
    if args.method == "draft_model" and not args.draft:
        p.error("--method draft_model needs --draft PATH (make one with python -m cadence.model.make_draft)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grounded_requests(out / "grounded.jsonl", args.num_requests, args.grounded_output_tokens)
    cells = [("grounded", 1, args.k)] + [("chat", int(s), args.k) for s in args.streams.split(",") if s]
    cells += [("chat", s, k) for s, k in args.loaded_cell]
    header = ["| cell | round | mode | output tok/s | TPOT ms | x tok/s | x TPOT | acceptance | mean k | errors |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines = list(header)
    print("\n".join(header), flush=True)
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        order = MODES[rnd % 3:] + MODES[: rnd % 3]
        for workload, streams, k in cells:
            got = {mode: one_cell(workload, streams, mode, rnd, args, out, k) for mode in order}
            cell = f"{workload}@{streams}" + ("" if k == args.k else f" k{k}")
            off = got["off"]
            for mode in MODES:
                c = got[mode]
                rt, rp = c.tok_s / off.tok_s if off.tok_s else float("nan"), c.tpot_ms / off.tpot_ms
                ratios.setdefault((cell, mode), []).append((rt, rp))
                row = (f"| {cell} | {rnd} | {mode} | {c.tok_s:.1f} | {c.tpot_ms:.1f} | {rt:.3f} | "
                       f"{rp:.3f} | {_fmt(c.acceptance, '.1%')} | {_fmt(c.mean_k, '.2f')} | {c.errors} |")
                lines.append(row)
                print(row, flush=True)
    lines += ["", "| cell | mode | median x tok/s | median x TPOT | per round x tok/s |", "|---|---|---|---|---|"]
    for (cell, mode), rs in ratios.items():
        if mode == "off":
            continue
        lines.append(f"| {cell} | {mode} | {statistics.median(r for r, _ in rs):.3f} | "
                     f"{statistics.median(p for _, p in rs):.3f} | {', '.join(f'{r:.3f}' for r, _ in rs)} |")
    text = "\n".join(lines)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
