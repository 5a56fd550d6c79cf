"""Is a decode step cheaper when its rows share the blocks of a common prefix?

    .venv/bin/python benchmarks/shared_context.py ROWS CONTEXT SHARED [--repeats 30] [--num-threads 1]
    .venv/bin/python benchmarks/shared_context.py 16 1024 960

Builds the engine (the default model, or `--model`) and times, straight through its model
runner, two decode steps of ROWS rows at CONTEXT tokens of context each:

- distinct: every row's context in blocks of its own;
- shared: the first SHARED tokens (whole blocks of them) of every row's context in the same
  blocks, the rest in blocks of its own, as rows whose prompts share a prefix through the prefix
  cache hold them.

Both have the same shape (`StepFeatures`) but for `decode_context_shared`, the keys re-read from
blocks an earlier row of the step read: (ROWS - 1) x the shared tokens. Each row's own blocks are
a run of consecutive blocks, the runs a few blocks apart, as calibration lays them
(sim/calibrate.py). The two steps are warmed up, then timed alternately (the order swapping every
round, so that a slow moment of a shared machine lands on both), and each keeps its median. Prints
both medians, their ratio, the shared keys, and what a key re-read costs beside a key read once
if every other key costs the same: 1 - (distinct - shared) / (shared keys x distinct's price per
key, estimated from the distinct step as a whole: an upper bound on that price).

Run it on a quiet machine, with the thread count you serve with.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.config import EngineConfig
from cadence.engine.builder import build_engine
from cadence.executor.cost_model import StepFeatures
from cadence.sim.calibrate import _SP

_GAP = 3  # free blocks between one row's run and the next


def decode_step(rows: int, context: int, shared: int, block_size: int, first_block: int, rng: random.Random,
                vocab: int) -> SchedulerOutput:
    """One decode step of `rows` rows at `context` tokens, the first `shared` tokens (whole blocks)
    of each in common blocks (0: none), the blocks numbered from `first_block` on."""
    per_row = -(-context // block_size)
    common_blocks = shared // block_size
    common = tuple(range(first_block, first_block + common_blocks))
    at = first_block + common_blocks + _GAP
    out = []
    for j in range(rows):
        own = per_row - common_blocks
        table = common + tuple(range(at, at + own))
        at += own + _GAP
        out.append(ScheduledRequest(f"d{j}", (rng.randrange(vocab),), context - 1, table, True, _SP))
    return SchedulerOutput(step=1, scheduled=tuple(out), num_batched_tokens=rows)


def blocks_needed(rows: int, context: int, shared: int, block_size: int) -> int:
    """The span of block ids `decode_step` numbers from its first block on."""
    per_row = -(-context // block_size)
    common = shared // block_size
    return common + _GAP + rows * (per_row - common + _GAP)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", type=int, help="decode rows in the step")
    p.add_argument("context", type=int, help="each row's context, in tokens")
    p.add_argument("shared", type=int, help="leading tokens of every context in common blocks")
    p.add_argument("--repeats", type=int, default=30, help="timed runs of each step (default 30)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1, as the shipped profile)")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the default model)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (checks the script, times nothing real)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 <= args.shared < args.context or args.rows < 1 or args.repeats < 1:
        p.error("need rows >= 1, repeats >= 1 and 0 <= shared < context")
    torch.set_num_threads(args.num_threads)
    cfg = EngineConfig.from_options(**({"model": args.model} if args.model else {}))
    engine = build_engine(cfg, tiny=args.tiny)
    runner, bs, num_blocks = engine.core.executor, cfg.cache.block_size, engine.core.num_blocks
    need = blocks_needed(args.rows, args.context, 0, bs) + blocks_needed(args.rows, args.context, args.shared, bs)
    if need > num_blocks:
        p.error(f"the two steps need {need} KV blocks, the cache has {num_blocks}")
    rng = random.Random(args.seed)
    base = rng.randrange(0, num_blocks - need + 1)
    distinct = decode_step(args.rows, args.context, 0, bs, base, rng, engine.vocab_size)
    shared = decode_step(args.rows, args.context, args.shared, bs, base + blocks_needed(args.rows, args.context, 0, bs),
                         rng, engine.vocab_size)
    keys = StepFeatures.from_output(shared, bs).decode_context_shared
    times: dict[str, list[float]] = {"distinct": [], "shared": []}
    steps = {"distinct": distinct, "shared": shared}
    for _ in range(3):
        for out in steps.values():
            runner.execute(out)
    for i in range(args.repeats):
        for name in ("distinct", "shared") if i % 2 == 0 else ("shared", "distinct"):
            t0 = time.perf_counter()
            runner.execute(steps[name])
            times[name].append(time.perf_counter() - t0)
    a, b = statistics.median(times["distinct"]), statistics.median(times["shared"])
    per_key = a / (args.rows * args.context)
    print(f"rows={args.rows} context={args.context} shared={args.shared} (block size {bs}, "
          f"{torch.get_num_threads()} thread(s), {args.repeats} runs each)")
    print(f"distinct {a * 1e3:.2f} ms, shared {b * 1e3:.2f} ms, ratio {b / a:.3f}; {keys} keys re-read")
    if keys:
        print(f"a re-read key costs at least {(a - b) / (keys * per_key):.0%} less than a key read once")


if __name__ == "__main__":
    main()
