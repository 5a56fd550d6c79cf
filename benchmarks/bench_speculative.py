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

With `--interleave`, the single-stream cells run the three modes side by side instead: three
servers (off, fixed k, adaptive k) stay up together, and each request is sent to each of them in
turn, the order rotating per request, so a slow moment of a shared machine falls on every mode
alike; a cell's figure per mode is its requests' output tokens over their time (each request
timed from its send to its last token), and every request's text must be the same from the three
servers (greedy output does not change with speculation; the script exits 1 where it does). Idle
servers use no CPU. The servers live for the whole run, so each round after the first opens the
grounded prompts with its number ("Round 2. ..."): no round finds its prompts in the prefix cache,
as no fresh server would.

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
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from cadence.bench.launch import served
from cadence.bench.prompts import PromptBuilder, ServerTokenizer
from cadence.workload import builtin_workload, read_jsonl

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
    port = args.port + 3 if args.interleave else args.port  # the interleaved servers hold the first three
    serve = serve_command(mode, k, port, args)
    source = ["--requests-file", str(out / "grounded.jsonl")] if workload == "grounded" else ["--workload", "chat"]
    num = args.num_requests if streams == 1 else max(args.num_requests, 2 * streams)
    bench = [*CADENCE, "bench", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "chat", *source,
             "--concurrency", str(streams), "--num-requests", str(num), "--temperature", "0", "--no-exact-output",
             "--seed", str(round_seed(args, rnd)), "--no-progress", "--label", name, "--out", str(out / name)]
    if args.max_output_tokens:
        bench += ["--max-output-tokens", str(args.max_output_tokens)]
    with served(serve, f"http://127.0.0.1:{port}/health", out / f"{name}.log", cwd=ROOT, timeout=600):
        warm_up(port)
        before = spec_counters(port)
        subprocess.run(bench, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        after = spec_counters(port)
    rows, drafted, accepted = (after[c] - before[c] for c in SPEC_COUNTERS)
    summary = json.loads((out / name / "summary.json").read_text())["overall"]
    tpot = summary["tpot"]["mean"]
    return Cell(tok_s=float(summary["output_token_throughput"] or 0.0),
                tpot_ms=float(tpot) * 1000 if tpot is not None else float("nan"),
                acceptance=accepted / drafted if drafted else None, mean_k=drafted / rows if rows else None,
                errors=int(summary["errors"]))


def round_seed(args: argparse.Namespace, rnd: int) -> int:
    return args.seed if args.same_seed else args.seed + rnd


def serve_command(mode: str, k: int, port: int, args: argparse.Namespace) -> list[str]:
    return [*CADENCE, "serve", "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(args.num_threads),
            *(["--tiny"] if args.tiny else []), *spec_config(mode, k, args.method, args.draft),
            *shlex.split(args.serve_args)]


def request_bodies(workload: str, rnd: int, args: argparse.Namespace, out: Path, port: int) -> list[dict]:
    """The single-stream cell's requests as chat bodies, as `cadence bench --endpoint chat` sends
    them (the chat mix's prompts sized by the server's tokenizer, as its `--tokenizer auto` does)."""
    if workload == "grounded":
        reqs = read_jsonl(out / "grounded.jsonl").requests
        texts: list[str | None] = [None] * len(reqs)
    else:
        w = builtin_workload("chat", args.num_requests, round_seed(args, rnd))
        tok = ServerTokenizer(f"http://127.0.0.1:{port}")
        try:
            texts = PromptBuilder(tok, round_seed(args, rnd)).build_all(w)
        finally:
            tok.close()
        reqs = w.requests
    bodies = []
    for req, text in zip(reqs, texts, strict=True):
        msgs = req.messages if req.messages is not None else (("user", text or ""),)
        if workload == "grounded" and rnd:  # its own prompts each round: none in the prefix cache yet
            msgs = ((msgs[0][0], f"Round {rnd}. {msgs[0][1]}"), *msgs[1:])
        max_tokens = min(req.output_tokens, args.max_output_tokens or req.output_tokens)
        bodies.append({"messages": [{"role": r, "content": c} for r, c in msgs], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    return bodies


@dataclass
class Timed:
    text: str
    tokens: int
    seconds: float  # send to last token
    ttft: float


def timed_request(port: int, body: dict) -> Timed:
    """One streamed chat request: its text, output tokens (the usage chunk), time and TTFT."""
    parts: list[str] = []
    tokens, ttft = 0, None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            for choice in obj.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    parts.append(delta)
            if obj.get("usage"):
                tokens = int(obj["usage"]["completion_tokens"])
    seconds = time.perf_counter() - t0
    return Timed("".join(parts), tokens, seconds, seconds if ttft is None else ttft)


def interleaved_cell(workload: str, rnd: int, args: argparse.Namespace, out: Path, ports: dict[str, int]
                     ) -> tuple[dict[str, Cell], int]:
    """One single-stream cell with the three modes side by side (`--interleave`): each request to
    each mode's server in turn. Returns the cells and how many requests' texts differed from off."""
    bodies = request_bodies(workload, rnd, args, out, ports["off"])
    before = {m: spec_counters(p) for m, p in ports.items()}
    got: dict[str, list[Timed]] = {m: [] for m in MODES}
    for i, body in enumerate(bodies):
        j = (i + rnd) % 3
        for mode in MODES[j:] + MODES[:j]:
            got[mode].append(timed_request(ports[mode], body))
    after = {m: spec_counters(p) for m, p in ports.items()}
    differ = sum(any(got[m][i].text != got["off"][i].text for m in MODES) for i in range(len(bodies)))
    cells = {}
    for mode, runs in got.items():
        rows, drafted, accepted = (after[mode][c] - before[mode][c] for c in SPEC_COUNTERS)
        tpots = [(r.seconds - r.ttft) / (r.tokens - 1) for r in runs if r.tokens > 1]
        cells[mode] = Cell(tok_s=sum(r.tokens for r in runs) / sum(r.seconds for r in runs),
                           tpot_ms=1000 * statistics.fmean(tpots) if tpots else float("nan"),
                           acceptance=accepted / drafted if drafted else None, mean_k=drafted / rows if rows else None,
                           errors=0)
    return cells, differ


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
    p.add_argument("--same-seed", action="store_true", help="every round uses --seed: the same requests again")
    p.add_argument("--no-grounded", action="store_true", help="leave out the grounded@1 cell")
    p.add_argument("--tiny", action="store_true", help="serve the tiny random model (a check that the script runs)")
    p.add_argument("--serve-args", default="", help="extra `cadence serve` flags for every cell, e.g. "
                   "\"--cost-profile PATH\" (the step-cost profile adaptive k prices drafts with)")
    p.add_argument("--interleave", action="store_true", help="single-stream cells: the three modes' servers up "
                   "together, each request sent to each in turn (module docstring)")
    p.add_argument("--port", type=int, default=8031, help="the server's port; with --interleave the three use "
                   "this one and the next two (default %(default)s)")
    p.add_argument("--out", default=str(ROOT / "results/speculative"))
    args = p.parse_args()
    if args.method == "draft_model" and not args.draft:
        p.error("--method draft_model needs --draft PATH (make one with python -m cadence.model.make_draft)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grounded_requests(out / "grounded.jsonl", args.num_requests, args.grounded_output_tokens)
    cells = [] if args.no_grounded else [("grounded", 1, args.k)]
    cells += [("chat", int(s), args.k) for s in args.streams.split(",") if s]
    cells += [("chat", s, k) for s, k in args.loaded_cell]
    header = ["| cell | round | mode | output tok/s | TPOT ms | x tok/s | x TPOT | acceptance | mean k | errors |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines = list(header)
    print("\n".join(header), flush=True)
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    differed = 0
    with ExitStack() as stack:
        ports = dict(zip(MODES, range(args.port, args.port + 3), strict=True)) if args.interleave else {}
        for mode, port in ports.items():
            stack.enter_context(served(serve_command(mode, args.k, port, args), f"http://127.0.0.1:{port}/health",
                                       out / f"interleaved_{mode}.log", cwd=ROOT, timeout=600))
            warm_up(port)
        for rnd in range(args.rounds):
            for workload, streams, k in cells:
                if ports and streams == 1 and k == args.k:
                    got, differ = interleaved_cell(workload, rnd, args, out, ports)
                    differed += differ
                else:
                    order = MODES[rnd % 3:] + MODES[: rnd % 3]
                    got = {mode: one_cell(workload, streams, mode, rnd, args, out, k) for mode in order}
                lines += _round_rows(got, f"{workload}@{streams}" + ("" if k == args.k else f" k{k}"), rnd, ratios)
    lines += ["", "| cell | mode | median x tok/s | median x TPOT | per round x tok/s |", "|---|---|---|---|---|"]
    for (cell, mode), rs in ratios.items():
        if mode == "off":
            continue
        lines.append(f"| {cell} | {mode} | {statistics.median(r for r, _ in rs):.3f} | "
                     f"{statistics.median(p for _, p in rs):.3f} | {', '.join(f'{r:.3f}' for r, _ in rs)} |")
    if differed:
        lines.append(f"\n{differed} request(s) answered differently with speculation: greedy output changed")
    text = "\n".join(lines)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 1 if differed else 0


def _round_rows(got: dict[str, Cell], cell: str, rnd: int, ratios: dict[tuple[str, str], list[tuple[float, float]]]
                ) -> list[str]:
    """A cell's rows for one round, printed as they come; its ratios to off go into `ratios`."""
    lines = []
    off = got["off"]
    for mode in MODES:
        c = got[mode]
        rt, rp = c.tok_s / off.tok_s if off.tok_s else float("nan"), c.tpot_ms / off.tpot_ms
        ratios.setdefault((cell, mode), []).append((rt, rp))
        row = (f"| {cell} | {rnd} | {mode} | {c.tok_s:.1f} | {c.tpot_ms:.1f} | {rt:.3f} | "
               f"{rp:.3f} | {_fmt(c.acceptance, '.1%')} | {_fmt(c.mean_k, '.2f')} | {c.errors} |")
        lines.append(row)
        print(row, flush=True)
    return lines


if __name__ == "__main__":
    sys.exit(main())
