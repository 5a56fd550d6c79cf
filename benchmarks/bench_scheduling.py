"""The scheduling benchmarks, measured side by side in one run on the offline engine.

1. Continuous vs static batching at equal max_num_seqs on a mixed-length workload (all requests
   at t=0): output tokens/s and p50/p95 end-to-end latency. Goal: continuous >= 2x static
   throughput at no worse p95.
2. Prefix caching on a shared-system-prompt workload: prefill tokens computed (sum of
   IterationStats.num_prompt_tokens) and p50 TTFT, on vs off. Goal: >= 5x less prefill work.
3. Chunked prefill on chat plus 10% long documents, arrivals spread over engine steps: p99
   inter-token latency of the chat requests, chunked vs unchunked vs a chat-only run.
   Goal: chunked within 1.5x of chat-only p99 ITL.
4. Scheduler cost: see benchmarks/bench_scheduler_cost.py (not duplicated here).

The engine core is stepped directly, so every token gets a wall-clock timestamp. Each
configuration builds its own engine (options that differ need a new one) and is warmed up first.

    .venv/bin/python benchmarks/bench_scheduling.py          # the default model, bfloat16
    .venv/bin/python benchmarks/bench_scheduling.py --tiny   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence import LLM
from cadence.bench.report import percentile
from cadence.request import Request, SamplingParams
from cadence.workload import builtin_workload, read_azure_csv

SEED = 0
MIN_TOKEN_ID = 1000  # clear of the special tokens at the bottom of the vocabulary


@dataclass
class Job:
    """One request to submit at engine step `at_step` (0: before the first step)."""

    rid: str
    prompt: list[int]
    max_tokens: int
    at_step: int = 0
    tag: str = ""


@dataclass
class Trace:
    """What one run measured: per-request submit/token times and the prefill work done."""

    submit: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    prefill_tokens: int = 0
    cache_hits: int = 0
    start: float = 0.0
    end: float = 0.0

    def ttfts(self, tag: str | None = None) -> list[float]:
        return [ts[0] - self.submit[r] for r, ts in self.tokens.items() if ts and self._has(r, tag)]

    def e2es(self, tag: str | None = None) -> list[float]:
        return [ts[-1] - self.submit[r] for r, ts in self.tokens.items() if ts and self._has(r, tag)]

    def itls(self, tag: str | None = None) -> list[float]:
        return [b - a for r, ts in self.tokens.items() if self._has(r, tag) for a, b in zip(ts, ts[1:], strict=False)]

    def output_tokens(self) -> int:
        return sum(len(ts) for ts in self.tokens.values())

    def _has(self, rid: str, tag: str | None) -> bool:
        return tag is None or self.tags[rid] == tag


# ---------------------------------------------------------------------------------------------
# Driving the engine


def make_llm(tiny: bool, **options: Any) -> LLM:
    llm = LLM(tiny=tiny, dtype="bfloat16", **options)
    warm = [Job(f"warm{i}", random_prompt(random.Random(i), 48, llm), 4) for i in range(2)]
    run_jobs(llm, warm)
    return llm


def random_prompt(rng: random.Random, n: int, llm: LLM) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, llm.engine.vocab_size) for _ in range(n)]


def run_jobs(llm: LLM, jobs: Sequence[Job]) -> Trace:
    """Submit each job at its step, step the core until all finish, timestamp every token."""
    core = llm.engine.core
    pending = sorted(jobs, key=lambda j: j.at_step, reverse=True)
    trace = Trace(start=time.perf_counter())
    step = 0
    while pending or core.has_unfinished_requests():
        while pending and pending[-1].at_step <= step:
            submit(core, pending.pop(), trace)
        deltas = core.step()
        now = time.perf_counter()
        trace.prefill_tokens += core.last_stats.num_prompt_tokens
        trace.cache_hits += core.last_stats.prefix_cache_hits
        for d in deltas:
            trace.tokens[d.request_id].extend(now for _ in d.new_token_ids)
        step += 1
    trace.end = time.perf_counter()
    return trace


def submit(core: Any, job: Job, trace: Trace) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True)
    core.add_request(Request(job.rid, list(job.prompt), params))
    trace.submit[job.rid] = time.perf_counter()
    trace.tokens[job.rid] = []
    trace.tags[job.rid] = job.tag


# ---------------------------------------------------------------------------------------------
# Workloads (fixed seeds)


def chat_sizes(n: int, max_prompt: int) -> list[tuple[int, int]]:
    """(prompt, output) token counts from the built-in chat mix, prompts capped."""
    wl = builtin_workload("chat", n, seed=SEED)
    return [(min(r.prompt_tokens, max_prompt), r.output_tokens) for r in wl.requests]


DEFAULT_OUTPUT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "azure_llm_2023_code.csv"
MAX_MIXED_OUTPUT = 512


def mixed_length_jobs(llm: LLM, n: int, scale: float, trace: Path | None = None,
                      long: tuple[int, int] = (64, 128), long_share: float = 0.15) -> list[Job]:
    """Short prompts (chat's, capped at 32 tokens) and mixed output lengths: many short, a few long.

    With `trace` (an Azure LLM CSV), the output lengths are a seeded sample of the trace's
    GeneratedTokens, capped at 512: the code trace's are median 13, p90 55, p99 252, a production
    mix of exactly that shape. Without it, a synthetic stand-in: 85% of 8..32 tokens, 15% of 64..128
    (`long`, `long_share`: the long ones' range and share).
    Prompts are kept short because both modes do the same prefill work: what differs is how full
    the decode batch stays, and long prompts would only dilute that."""
    rng = random.Random(f"mixed:{SEED}")
    if trace is not None:
        lengths = [r.output_tokens for r in read_azure_csv(trace).requests]
        outs = [min(MAX_MIXED_OUTPUT, rng.choice(lengths)) for _ in range(n)]
    else:
        outs = [rng.randint(*long) if rng.random() < long_share else rng.randint(8, 32) for _ in range(n)]
    return [
        Job(f"m{i}", random_prompt(rng, p, llm), max(2, int(out * scale)))
        for i, ((p, _), out) in enumerate(zip(chat_sizes(n, 32), outs, strict=True))
    ]


def shared_prefix_jobs(llm: LLM, n: int, system_tokens: int) -> list[Job]:
    """One system prompt shared by all, a short question each, 8 output tokens; the first alone."""
    rng = random.Random(f"prefix:{SEED}")
    system = random_prompt(rng, system_tokens, llm)
    return [Job(f"p{i}", system + random_prompt(rng, rng.randint(12, 40), llm), 8) for i in range(n)]


def chunked_jobs(llm: LLM, n_chat: int, doc_tokens: int, with_docs: bool, gap: int) -> list[Job]:
    """Chat requests arriving every `gap` steps; with_docs adds 10% long documents mid-stream."""
    rng = random.Random(f"chunked:{SEED}")
    jobs = [
        Job(f"c{i}", random_prompt(rng, p, llm), min(max(o, 24), 64), at_step=i * gap, tag="chat")
        for i, (p, o) in enumerate(chat_sizes(n_chat, 256))
    ]
    n_docs = max(1, n_chat // 9)  # 10% of all requests
    docs = []
    for k in range(n_docs):
        at = (k + 1) * n_chat * gap // (n_docs + 1)
        size = rng.randint(int(doc_tokens * 0.9), doc_tokens)
        docs.append(Job(f"d{k}", random_prompt(rng, size, llm), 16, at_step=at, tag="doc"))
    return jobs + docs if with_docs else jobs


# ---------------------------------------------------------------------------------------------
# The benchmarks


Row = tuple[str, str, str, str, str]  # figure, value, ratio, goal, verdict


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def bench_batching(tiny: bool, n: int, scale: float, max_num_seqs: int = 8, trace: Path | None = None,
                   long: tuple[int, int] = (64, 128), long_share: float = 0.15, rounds: int = 1,
                   figures: dict[str, Any] | None = None) -> list[Row]:
    """The two modes run one after the other, `rounds` times (alternating, so a machine whose speed
    drifts favours neither): each figure is the median over the rounds."""
    runs: dict[str, list[Trace]] = {"continuous": [], "static": []}
    llms = {mode: make_llm(tiny, scheduler=mode, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
            for mode in runs}
    for _ in range(rounds):
        for mode, llm in llms.items():
            runs[mode].append(run_jobs(llm, mixed_length_jobs(llm, n, scale, trace, long, long_share)))
    del llms
    tput = {m: statistics.median(t.output_tokens() / (t.end - t.start) for t in ts) for m, ts in runs.items()}
    p50 = {m: statistics.median(percentile(t.e2es(), 50) for t in ts) for m, ts in runs.items()}
    p95 = {m: statistics.median(percentile(t.e2es(), 95) for t in ts) for m, ts in runs.items()}
    ratio = tput["continuous"] / tput["static"]
    ok = ratio >= 2.0 and p95["continuous"] <= p95["static"]
    round_ratios = [a.output_tokens() / (a.end - a.start) / (b.output_tokens() / (b.end - b.start))
                    for a, b in zip(runs["continuous"], runs["static"], strict=True)]
    each = ", ".join(f"{r:.2f}" for r in round_ratios)
    if figures is not None:
        figures["batching"] = batching_json(max_num_seqs, n, tput, p50, p95, round_ratios)
    return [
        (f"1 batching (max_num_seqs {max_num_seqs}): tok/s cont | static", f"{tput['continuous']:.1f} | {tput['static']:.1f}",
         f"{ratio:.2f}x", ">= 2x", verdict(ok)),
        *([(f"  ratio in each of {rounds} rounds", each, "", "", "")] if rounds > 1 else []),
        ("  e2e p50 s cont | static", f"{p50['continuous']:.2f} | {p50['static']:.2f}",
         f"{p50['static'] / p50['continuous']:.2f}x", "", ""),
        ("  e2e p95 s cont | static", f"{p95['continuous']:.2f} | {p95['static']:.2f}",
         f"{p95['static'] / p95['continuous']:.2f}x", "cont <= static", verdict(p95["continuous"] <= p95["static"])),
    ]


def batching_json(max_num_seqs: int, requests: int, tput: dict[str, float], p50: dict[str, float],
                  p95: dict[str, float], round_ratios: list[float]) -> dict[str, Any]:
    """The batching figures for --json: each mode's ("continuous", "static") tokens/s and e2e seconds."""
    return {"max_num_seqs": max_num_seqs, "requests": requests, "tok_s": tput, "e2e_p50_s": p50, "e2e_p95_s": p95,
            "round_ratios": round_ratios}


def run_prefix(llm: LLM, jobs: list[Job]) -> Trace:
    """The first request alone (its prefix gets cached), then the rest at once."""
    first = run_jobs(llm, jobs[:1])
    rest = run_jobs(llm, jobs[1:])
    rest.prefill_tokens += first.prefill_tokens
    rest.cache_hits += first.cache_hits
    return rest


def bench_prefix(tiny: bool, n: int, system_tokens: int) -> list[Row]:
    traces = {}
    for on in (True, False):
        llm = make_llm(tiny, enable_prefix_caching=on)
        traces[on] = run_prefix(llm, shared_prefix_jobs(llm, n, system_tokens))
        del llm
    work = {k: t.prefill_tokens for k, t in traces.items()}
    ttft = {k: percentile(t.ttfts(), 50) * 1000 for k, t in traces.items()}
    ratio = work[False] / max(1, work[True])
    return [
        ("2 prefix cache: prefill tokens on | off", f"{work[True]} | {work[False]}",
         f"{ratio:.2f}x", ">= 5x", verdict(ratio >= 5.0)),
        ("  TTFT p50 ms on | off (first excluded)", f"{ttft[True]:.0f} | {ttft[False]:.0f}",
         f"{ttft[False] / ttft[True]:.2f}x", "", ""),
    ]


def bench_chunked(tiny: bool, n_chat: int, doc_tokens: int, gap: int) -> list[Row]:
    chunked = make_llm(tiny, max_num_seqs=16, max_num_batched_tokens=128, enable_prefix_caching=False)
    chat_only = run_jobs(chunked, chunked_jobs(chunked, n_chat, doc_tokens, False, gap))
    mixed_chunked = run_jobs(chunked, chunked_jobs(chunked, n_chat, doc_tokens, True, gap))
    del chunked
    whole = make_llm(tiny, max_num_seqs=16, max_num_batched_tokens=doc_tokens + 512,
                     enable_chunked_prefill=False, enable_prefix_caching=False)
    mixed_whole = run_jobs(whole, chunked_jobs(whole, n_chat, doc_tokens, True, gap))
    del whole
    p99 = {k: percentile(t.itls("chat"), 99) * 1000
           for k, t in (("base", chat_only), ("chunked", mixed_chunked), ("whole", mixed_whole))}
    r_chunked = p99["chunked"] / p99["base"]
    r_whole = p99["whole"] / p99["base"]
    return [
        ("3 chunked: chat ITL p99 ms chat-only", f"{p99['base']:.1f}", "1.00x", "", ""),
        ("  + 10% docs, chunked (128 tok/step)", f"{p99['chunked']:.1f}", f"{r_chunked:.2f}x",
         "<= 1.5x chat-only", verdict(r_chunked <= 1.5)),
        ("  + 10% docs, unchunked", f"{p99['whole']:.1f}", f"{r_whole:.2f}x", "(reference)", ""),
    ]


def print_table(rows: Sequence[Row]) -> None:
    header: Row = ("figure", "value", "ratio", "goal", "")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(5)]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small random-weight model: a quick smoke run")
    ap.add_argument("--only", default="batching,prefix,chunked", help="comma-separated subset")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="batching: the sequence cap of both modes")
    ap.add_argument("--batching-requests", type=int, default=0,
                    help="batching: requests in the mix (default 12x max_num_seqs; 3x with --tiny)")
    ap.add_argument("--output-trace", default=str(DEFAULT_OUTPUT_TRACE),
                    help="batching: an Azure LLM CSV whose output lengths the mix samples ('' for the "
                         "synthetic 85%% short / 15%% long mix)")
    ap.add_argument("--long-outputs", default="64,128",
                    help="batching, synthetic mix: the long outputs' token range LO,HI (short: 8..32)")
    ap.add_argument("--long-share", type=float, default=0.15, help="batching, synthetic mix: the long outputs' share")
    ap.add_argument("--rounds", type=int, default=1, help="batching: alternating runs of each mode (medians)")
    ap.add_argument("--json", default="", help="also write the batching figures and the OpenMP settings to this file")
    args = ap.parse_args()
    try:
        lo, hi = (int(x) for x in args.long_outputs.split(","))
    except ValueError:
        ap.error(f"--long-outputs: expected LO,HI, got {args.long_outputs!r}")
    if not (1 <= lo <= hi) or not (0.0 <= args.long_share <= 1.0) or args.rounds < 1:
        ap.error("--long-outputs: 1 <= LO <= HI; --long-share: between 0 and 1; --rounds: >= 1")
    t0 = time.perf_counter()
    tiny = args.tiny
    trace = Path(args.output_trace) if args.output_trace else None
    if trace is not None and not trace.is_file():
        print(f"note: {trace} not found: the batching mix uses synthetic output lengths (--output-trace)")
        trace = None
    figures: dict[str, Any] = {}
    parts = {
        "batching": lambda: bench_batching(tiny, args.batching_requests or 3 * args.max_num_seqs, 0.5,
                                           args.max_num_seqs, trace, (lo, hi), args.long_share, args.rounds,
                                           figures) if tiny
        else bench_batching(tiny, args.batching_requests or 12 * args.max_num_seqs, 1.0, args.max_num_seqs, trace,
                            (lo, hi), args.long_share, args.rounds, figures),
        "prefix": lambda: bench_prefix(tiny, 8, 400) if tiny else bench_prefix(tiny, 24, 400),
        "chunked": lambda: bench_chunked(tiny, 18, 800, 2) if tiny else bench_chunked(tiny, 36, 1024, 3),
    }
    unknown = set(args.only.split(",")) - set(parts)
    if unknown:
        ap.error(f"--only: unknown part(s) {sorted(unknown)}; choose from {sorted(parts)}")
    rows = [row for name, part in parts.items() if name in args.only.split(",") for row in part()]
    from cadence.engine.builder import resolve_device

    model = ("tiny random model" if args.tiny else "default model, bfloat16") + f", on {resolve_device('auto')}"
    # The OpenMP wait policy moves the batching ratio (a sleeping thread makes thin steps dearer):
    # say which one ran, so a figure can be compared with its like.
    omp = ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ)
    print(f"\ncadence scheduling benchmarks ({model}, seed {SEED}, {omp or 'OpenMP defaults'}, "
          f"{time.perf_counter() - t0:.0f} s)")
    print_table(rows)
    print("4 scheduler cost: run .venv/bin/python benchmarks/bench_scheduler_cost.py (goal: < 5% of a step)")
    if args.json:
        env = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
        Path(args.json).write_text(json.dumps({"model": model, "omp_env": env, **figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
