"""`cadence calibrate`: measure real steps of the real model and fit the simulator's cost model.

Two phases:
1. A sweep of step shapes run straight through the model runner with synthetic
   `ScheduledRequest`s: prefill chunks at several context offsets, decode batches at several
   context lengths (some with a prefix their rows share), and mixed steps (one chunk beside a decode batch), each warmed up once and
   timed as the median of repeats, taken in rounds over all shapes. The cost model is fitted on these (held-out error printed).
2. The engine's own overhead per step (scheduling, KV bookkeeping, detokenization): a short real
   run of the engine core; the step wall time minus the runner's time, fitted as a constant plus
   a cost per scheduled request, is added to the model.

Each request of a shape gets its own run of consecutive KV blocks, placed at random in a cache of
the served size (a block pool hands blocks out in order): re-reading a few hot blocks for every
request would flatter attention, scattering every block would overcharge it. Shapes the cache
could not hold are skipped.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.config import EngineConfig
from cadence.engine.builder import Engine, build_engine
from cadence.executor.cost_model import StepCostModel, StepFeatures, machine_info
from cadence.request import Request, SamplingParams
from cadence.sim.replay import RecordingExecutor

_WARM_ENOUGH_S = 0.3
_SP = SamplingParams(max_tokens=1 << 20)  # the server's default sampling (temperature 1): same sampler cost


@dataclass(frozen=True)
class Shape:
    """One step to time: prefill chunks as (tokens, start position, samples), decode contexts."""

    chunks: tuple[tuple[int, int, bool], ...] = ()
    decode_contexts: tuple[int, ...] = ()
    # Leading tokens of every decode context held in the same blocks (whole blocks of it): a prompt
    # prefix the rows share through the prefix cache.
    shared_prefix: int = 0

    @property
    def max_context(self) -> int:
        ends = [n + s for n, s, _ in self.chunks] + list(self.decode_contexts)
        return max(ends, default=1)


# Decode batches whose rows share a prefix: (rows, context, shared tokens), as served traffic with a
# common system prompt makes them; beside the sweep's equal-context batches of the same sizes.
SHARED_DECODES = ((8, 2048, 1920), (16, 1024, 960), (32, 640, 512), (64, 256, 192))
SHARED_DECODES_QUICK = ((16, 1024, 960), (64, 256, 192))
# Short prompt chunks over a cached context: (chunk tokens, cached tokens before it, decode rows beside).
CACHED_CHUNKS = ((40, 512, 0), (40, 512, 8), (24, 1024, 16), (40, 2048, 4))
CACHED_CHUNKS_QUICK = ((40, 512, 8),)


def sweep_shapes(max_seqs: int, max_tokens: int, max_len: int, *, quick: bool = False, seed: int = 0) -> list[Shape]:
    """Shapes an engine with these limits produces: chunk sizes up to the token budget at several
    offsets, decode batches up to the sequence cap at equal and at spread-out context lengths, and
    mixed steps (a chunk filling what a decode batch leaves of the budget, and a short one). Sized to keep the
    sweep near 3 minutes (quick: 30 s) for a 135M model on two CPU cores."""
    rng = random.Random(seed)
    cap = lambda vals, top: sorted({min(top, v) for v in vals})  # noqa: E731
    chunks = cap((64, 512) if quick else (16, 64, 128, 256, 512), max_tokens)
    starts = [s for s in ((0, 1024) if quick else (0, 512, 2048)) if s < max_len]
    batches = cap((1, 16, 64) if quick else (1, 4, 8, 16, 32, 64), max_seqs)
    ctxs = [c for c in ((256, 2048) if quick else (256, 1024, 3072)) if c <= max_len] or [max_len]
    spread = max(17, min(max_len, 4096) // 2)
    shapes = [Shape(chunks=((n, st, True),)) for n in chunks for st in starts if n + st <= max_len]
    shapes += [Shape(decode_contexts=(c,) * b) for b in batches for c in ctxs]
    for b in batches[1:]:
        shapes.append(Shape(decode_contexts=tuple(rng.randint(16, spread) for _ in range(b))))
        for _ in range(1 if quick else 2):
            dec = tuple(rng.randint(16, spread) for _ in range(b - 1))
            n = max(2, max_tokens - len(dec))
            st = rng.choice(starts)
            if n + st <= max_len:
                shapes.append(Shape(chunks=((n, st, rng.random() < 0.5),), decode_contexts=dec))
        if not quick:  # a chat prompt joining running decodes: a short chunk beside the batch
            n = min(rng.choice((48, 160)), max_tokens - b + 1)
            if n >= 2:
                shapes.append(Shape(chunks=((n, 0, True),), decode_contexts=dec))
    # Last, so that the shapes above (and their tables in `time_shapes`) draw what they drew before.
    shapes += [Shape(decode_contexts=(c,) * b, shared_prefix=sh) for b, c, sh in
               (SHARED_DECODES_QUICK if quick else SHARED_DECODES) if b <= max_seqs and c <= max_len]
    # A prompt whose leading blocks the prefix cache held: a short chunk over a long cached context,
    # alone and beside running decodes (served traffic with a common system prompt makes these).
    for n, st, b in (CACHED_CHUNKS_QUICK if quick else CACHED_CHUNKS):
        dec = tuple(rng.randint(16, spread) for _ in range(min(b, max_seqs - 1)))
        if n + st <= max_len and n + len(dec) <= max_tokens:
            shapes.append(Shape(chunks=((n, st, True),), decode_contexts=dec))
    return shapes


def _output(shape: Shape, block_size: int, num_blocks: int, vocab: int, rng: random.Random) -> SchedulerOutput:
    """The step as the scheduler would send it. Each request gets its own run of consecutive blocks,
    the runs placed at random in a cache of the served size, as a block pool hands out blocks in
    order from its free queue: re-reading the same few hot blocks for every request would make
    attention look cheaper than it is, and scattering every block at random, dearer. A shape's
    shared prefix is one more run, at the head of every decode row's table."""
    common = shape.shared_prefix // block_size  # whole blocks only: the prefix cache shares no partial one
    need = [-(-(st + n) // block_size) for n, st, _ in shape.chunks] + [
        -(-c // block_size) - common for c in shape.decode_contexts] + ([common] if common else [])
    spare = num_blocks - sum(need)
    # Random gaps between the runs: sorted cut points over the spare blocks, in a shuffled order.
    cuts = sorted(rng.randint(0, spare) for _ in need)
    order = list(range(len(need)))
    rng.shuffle(order)
    starts, at = [0] * len(need), 0
    for k, i in enumerate(order):
        starts[i] = at + cuts[k]
        at += need[i]
    tables = [tuple(range(st, st + k)) for st, k in zip(starts, need, strict=True)]
    if common:
        head = tables.pop()
        tables[len(shape.chunks):] = [head + t for t in tables[len(shape.chunks):]]
    rows = []
    for i, (n, start, sample) in enumerate(shape.chunks):
        ids = tuple(rng.randrange(vocab) for _ in range(n))
        rows.append(ScheduledRequest(f"p{i}", ids, start, tables[i], sample, _SP))
    for j, ctx in enumerate(shape.decode_contexts):
        table = tables[len(shape.chunks) + j]
        rows.append(ScheduledRequest(f"d{j}", (rng.randrange(vocab),), ctx - 1, table, True, _SP))
    return SchedulerOutput(step=1, scheduled=tuple(rows), num_batched_tokens=sum(r.num_tokens for r in rows))


def fits(shape: Shape, block_size: int, num_blocks: int) -> bool:
    """Whether the engine's KV cache could hold this step at all (larger shapes never occur)."""
    need = sum(-(-(st + n) // block_size) for n, st, _ in shape.chunks)
    common = shape.shared_prefix // block_size
    return need + sum(-(-c // block_size) - common for c in shape.decode_contexts) + common <= num_blocks


def time_shapes(runner: Any, shapes: list[Shape], block_size: int, num_blocks: int, vocab: int, repeats: int,
                progress: bool = True) -> list[tuple[StepFeatures, float]]:
    """(features, median seconds) per shape: one untimed warm-up run each, then `repeats` rounds,
    each timing every shape once. Interleaved rather than back to back: on a shared machine a
    slow moment (another process, a frequency dip) then costs one timing of several shapes, which
    their medians drop, not every timing of one shape (measured: back-to-back repeats gave
    held-out errors from 2% to 8% between calibrations of the same engine)."""
    rng = random.Random(0)
    outs = [_output(shape, block_size, num_blocks, vocab, rng) for shape in shapes]
    times: list[list[float]] = [[] for _ in shapes]

    def timed(out: SchedulerOutput) -> float:
        t0 = time.perf_counter()
        runner.execute(out)
        return time.perf_counter() - t0

    for k, out in enumerate(outs):
        first = timed(out)
        # The first run of a new shape pays for allocations; for a long step that is noise, so it counts.
        if first > _WARM_ENOUGH_S:
            times[k].append(first)
    for r in range(repeats):
        for k, out in enumerate(outs):
            if len(times[k]) < repeats:
                times[k].append(timed(out))
        if progress:
            print(f"  round {r + 1}/{repeats}: {len(shapes)} shapes timed", flush=True)
    return [(StepFeatures.from_output(out, block_size), statistics.median(t)) for out, t in zip(outs, times, strict=True)]


def measure_overhead(engine: Engine, num_requests: int, prompt: int, output: int) -> dict[str, float]:
    """Engine overhead per step beyond the runner's time: fit seconds = per_step + per_seq * seqs."""
    from cadence.engine.output_processor import OutputProcessor

    core = engine.core
    rec = RecordingExecutor(core.executor, core.clock)
    core.executor = rec  # the core calls executor.execute each step; timing wraps it
    proc = OutputProcessor(engine.tokenizer)
    rng = random.Random(1)
    sp = SamplingParams(max_tokens=output, ignore_eos=True)
    try:
        for i in range(num_requests):
            ids = [rng.randrange(100, engine.vocab_size) for _ in range(prompt)]
            proc.add_request(f"ovh{i}", sp, ids)
            core.add_request(Request(f"ovh{i}", ids, sp))
        rows = []
        while core.has_unfinished_requests():
            n_before = len(rec.durations)
            t0 = time.perf_counter()
            proc.process(core.step())
            wall = time.perf_counter() - t0
            if len(rec.durations) > n_before:
                rows.append((len(rec.decisions[-1].scheduled), wall - rec.durations[-1]))
    finally:
        core.executor = rec.inner
    x = np.array([[1.0, n] for n, _ in rows])
    y = np.array([max(o, 0.0) for _, o in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    per_step, per_seq = (max(float(c), 0.0) for c in coef)
    return {"per_step": per_step, "per_seq": per_seq, "num_steps": len(rows), "median_s": float(np.median(y))}


def calibrate(config: EngineConfig, *, tiny: bool = False, quick: bool = False, repeats: int | None = None,
              progress: bool = True, served: bool = True, serve_log: str = "cadence_calibrate_serve.log") -> StepCostModel:
    """Build the engine named by `config`, time the sweep and the overhead, and fit a profile."""
    t_start = time.perf_counter()
    engine = build_engine(config, tiny=tiny)  # the KV cache as served: its size and layout matter
    runner = engine.core.executor
    overhead = measure_overhead(engine, 24 if quick else 48, 48, 24 if quick else 48)
    sc = config.scheduler
    max_len = min(engine.max_model_len, 4096)
    block, num_blocks = config.cache.block_size, engine.core.num_blocks
    shapes = [sh for sh in sweep_shapes(sc.max_num_seqs, sc.max_num_batched_tokens, max_len, quick=quick)
              if fits(sh, block, num_blocks)]
    if progress:
        print(f"engine overhead: {overhead['per_step'] * 1e3:.2f} ms/step + {overhead['per_seq'] * 1e6:.0f} us/request")
        print(f"timing {len(shapes)} step shapes of {engine.model_name} on {engine.device} ({engine.dtype})", flush=True)
    vocab = engine.vocab_size
    samples = time_shapes(runner, shapes, block, num_blocks, vocab, repeats or (2 if quick else 5), progress)
    meta = {
        "model": engine.model_name, "dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device),
        "torch_threads": torch.get_num_threads(), "machine": machine_info(),
        "kv_bytes_per_token": runner.kv_bytes_per_block(block) // block, "block_size": block,
        "kv_cache_dtype": engine.core.kv_cache_dtype,
        "max_model_len": engine.max_model_len, "calibrated_max_context": max_len,
        "sweep": {"shapes": len(shapes), "quick": quick, "max_num_seqs": sc.max_num_seqs,
                  "max_num_batched_tokens": sc.max_num_batched_tokens},
        "overhead_measurement": overhead, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    fitted = StepCostModel.fit(samples, metadata=meta)
    fitted.fit_report["samples"] = [{**f.to_dict(), "seconds": s} for f, s in samples]
    terms = {"per_step": overhead["per_step"], "per_seq": overhead["per_seq"]}
    request_path: dict[str, float] = {}  # not measured in process: no HTTP there
    if served and not tiny:
        # What a client of `cadence serve` sees supersedes the in-process estimate: it includes it.
        from cadence.sim.serving import fit_request_path, measure_serving_overhead

        if progress:
            print("measuring what serving adds to a step (cadence serve + a streaming client)", flush=True)
        del engine, runner  # the server loads its own copy of the model
        served_terms = measure_serving_overhead(config, fitted, vocab, batches=(1, 4) if quick else (1, 4, 16),
                                                log_path=serve_log)
        fitted.metadata["serving_overhead_measurement"] = served_terms
        terms = {"per_step": served_terms["per_step"], "per_seq": served_terms["per_seq"]}
        # The request path is what the probe's first tokens took beyond the steps as now priced.
        priced = dataclasses.replace(fitted, overhead=terms)
        request_path = fit_request_path(served_terms["request_path_probe"], priced)
        fitted.metadata["request_path_source"] = "cadence serve at idle"
    fitted.metadata["overhead_source"] = "served" if served and not tiny else "engine core, in process"
    fitted.metadata["calibration_seconds"] = round(time.perf_counter() - t_start, 1)
    return dataclasses.replace(fitted, overhead=terms, request_path=request_path)
