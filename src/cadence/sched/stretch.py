"""Decode stretches: steps ahead that would each schedule the same plain decodes (and at most one
prompt chunk of the same size) and nothing else.

The simulator's fast-forward. When every running request is a plain decode, no waiting request can
be admitted and nothing is about to end, the next steps are all alike: each feeds every running
request its last token, gives a block to those whose next position starts one, and publishes the
blocks they fill. `Scheduler.plan_decode_stretch` finds how many such steps lie ahead, changing
nothing; the executor costs them in one call (`DecodeRun`); `Scheduler.apply_decode_stretch` then
applies the first m of them at once: per request once, per block boundary once, per step a few
operations. The block pool sees the same operations in the same order as m single steps (each
step's allocations in scheduling order, then its publications), so block ids, evictions and
published hashes come out identical, and so does everything else the steps change.

Requests finish only by length (their output limit or `max_model_len`; a stretch is only planned
when the executor's scripted token is no stop token of any running request), so the step in which
each one finishes is known ahead (`last_steps`). A step in which some finish applies like the
others, then finishes them in scheduling order. If nothing waits (and no deadline is pending, and
no fair-share counters are kept), the stretch goes on past it with the requests left: a freed seat
or freed blocks could only matter to a waiting request, and the blocks the stretch takes are
counted against those free at its start, so its allocations never reach the freed ones at the
tail of the free queue (the frees can wait for the end). Its steps then form runs of alike steps
(`runs`), costed one run at a time as the caller reaches them. Otherwise the stretch ends with the
step in which the first requests finish. It ends before the first step in which anything else
could differ:

- the blocks the steps allocate would outrun the free queue (the single step then preempts);
- a deadline falls due (the engine core checks the step times against the earliest deadline);
- the waiting queue's next request could be admitted or preempt a running one. With requests
  waiting, the scheduler looks at the policy's next one every step and gives up on it; it gives
  up for the same reason at every step of a stretch as long as the request, its prefix-cache hit
  and the running set stay the same, since the free blocks only shrink (nothing is freed). So a
  stretch needs the policy's choice not to move with service (fair share with one tenant waiting
  at most), and stops short of allocating a free block that the request's hit counts on, and of
  a step where a running request publishes the block that would extend the hit.

One request may still be in its prompt: the last running one (where admission puts it). Each step
then also gives it the chunk the decodes leave of the token budget (allocated after theirs,
published after theirs, as a single step orders its rows). Since its chunks spend the whole
budget, the waiting queue is never looked at in such a stretch, whatever it holds. Its last chunk
is no larger (often smaller): it samples the request's first token and may leave budget to the waiting queue. With
requests waiting (or a deadline pending, or fair-share counters), the stretch stops before it.
With nothing waiting, the last chunk is a step of the stretch (`join`) and the request goes on as
one more decode row from the next step (it *joins*: the last row of `requests`, with the start
that puts its first decode, one past its prompt, at the step after `join`); no decode may finish
before that step, since the chunk is what the decodes leave of the budget. (No stretch carries
chunks under fair share, whose counters would interleave the chunk's prompt tokens with the
decodes' outputs, nor with unchunked prefill or a chunk threshold below the chunk. A request
coming back from preemption with outputs, or a last chunk of one token, which the executor prices
as a decode, does not join: the stretch stops before it.)

Anything else (a request not yet decoding elsewhere, penalties or logprobs, more running requests
than the token budget) plans no stretch: the single step runs. Arrivals are the caller's bound: the
simulator applies a stretch only up to the first step that starts at or after a request reaches
the replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cadence.request import Request
from cadence.sched.output import DecodeRun


@dataclass
class DecodeStretch:
    """Steps planned on one scheduler state; valid until that scheduler does anything else."""

    step: int  # the scheduler's step count when planned (the stretch's first step is step + 1)
    # The running requests that decode, in scheduling order (with `join`, the last is still in its
    # prompt at planning and decodes after its join step).
    requests: tuple[Request, ...]
    # Each one's computed tokens before the first step: step j decodes at start + j. (A joined
    # row's is made up so that this holds after its join: its prompt length - join - 1.)
    starts: tuple[int, ...]
    first_allocations: list[int]  # the step at which each one first takes a block (first_allocations)
    token: int  # what every decode samples
    num_steps: int  # steps planned; the engine core may cut them at a deadline
    not_after: float  # the earliest pending deadline: no step of the stretch may start at or after it
    # Each request's last step: it samples its last token there (by length) and leaves. Values at or
    # past `num_steps` go on after the stretch. With the waiting queue empty, a stretch runs past
    # the first finishes with the requests left (see "Finishing" in the module doc).
    last_steps: tuple[int, ...] = ()
    prefill: Request | None = None  # the running request in its prompt, scheduled after the decodes
    prefill_start: int = 0  # its computed tokens before the first step
    chunk: int = 0  # the prompt tokens it gets in each step (but the last, with `join`)
    # The step in which `prefill` runs its last chunk (`join_chunk` tokens) and samples its first
    # token (-1: none in the stretch); it then decodes as the last row of `requests` (see the module doc).
    join: int = -1
    join_chunk: int = 0
    start_time: float = 0.0  # clock reading at the first step (set by the engine core)
    costs: list[float] = field(default_factory=list)  # each step's cost (engine core)
    step_ends: list[float] = field(default_factory=list)  # clock reading after each step (engine core)
    # Runs not costed yet: past the first finishes, steps are costed a run at a time as they are
    # needed (EngineCore.cost_stretch), so that a stretch cut short costs little more than it ran.
    pending_runs: list[DecodeRun] = field(default_factory=list)

    def finish_groups(self) -> dict[int, list[int]]:
        """The steps in which requests finish, in order, each with its rows in scheduling order."""
        n = self.num_steps
        groups: dict[int, list[int]] = {}
        for i, j in sorted(enumerate(self.last_steps), key=lambda e: e[1]):
            if j >= n:
                break
            groups.setdefault(j, []).append(i)
        return groups

    @property
    def prefill_end(self) -> float:
        """Where the prompt row's chunks stop: its prompt's end with `join`, else never in the stretch."""
        return self.prefill_start + self.chunk * self.join + self.join_chunk if self.join >= 0 else math.inf

    @property
    def runs(self) -> list[DecodeRun]:
        """The stretch's steps as runs of alike steps: a new run wherever requests have left, and
        with `join` one run before it, one of its step, and the runs after it with the joined row."""
        join = self.join
        if join < 0:
            return self._runs_from(0, self.chunk, self.prefill_start)
        decodes = self.starts[:-1]  # (all of them decode through the join step: see the module doc)
        n, total, top = len(decodes), sum(decodes), max(decodes, default=0)
        out = [DecodeRun(n, total, top, join, self.chunk, self.prefill_start)] if join else []
        out.append(DecodeRun(n, total + join * n, top + join, 1, self.join_chunk,
                             self.prefill_start + join * self.chunk, sampled=1))
        return out + self._runs_from(join + 1, 0, 0)

    def _runs_from(self, a: int, chunk: int, chunk_start: int) -> list[DecodeRun]:
        """The runs of steps `a`.. (rows whose last step is before `a` have left), with `chunk` a
        step beside them."""
        starts, last, n = self.starts, self.last_steps, self.num_steps
        if a >= n:
            return []
        if not last or min(last) >= n - 1:  # every row decodes in every step
            return [DecodeRun(len(starts), sum(starts) + a * len(starts), max(starts) + a if starts else 0, n - a, chunk,
                              chunk_start)]
        # Rows by their last step; the rows of a run are a suffix of that order (its sums and maxima
        # taken from the back), and a run ends after each step in which some leave.
        order = sorted(range(len(starts)), key=last.__getitem__)
        size = len(order)
        suffix_sum, suffix_max = [0] * (size + 1), [0] * (size + 1)
        for p in range(size - 1, -1, -1):
            s = starts[order[p]]
            suffix_sum[p] = suffix_sum[p + 1] + s
            suffix_max[p] = max(suffix_max[p + 1], s)  # (positions are >= 0)
        out, p = [], 0
        while p < size and last[order[p]] < a:  # left before step a
            p += 1
        while a < n:
            assert p < size, "every row left before the stretch's last step"
            b = min(last[order[p]] + 1, n)  # the run ends after the next rows' last step
            rows = size - p
            out.append(DecodeRun(rows, suffix_sum[p] + a * rows, suffix_max[p] + a, b - a, chunk, chunk_start + a * chunk))
            while p < size and last[order[p]] < b:
                p += 1
            a = b
        return out

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]


def first_allocations(starts: Sequence[int], blocks_held: Sequence[int], block_size: int) -> list[int]:
    """The step at which each decode row first takes a block: when its position (its start plus
    the step) is the first past the blocks it holds. It takes another every `block_size` steps."""
    return [held * block_size - start for start, held in zip(starts, blocks_held, strict=True)]


def blocks_allocated(first: Sequence[int], block_size: int, num_steps: int, last: Sequence[int] = ()) -> int:
    """Blocks the first `num_steps` steps take together (`first`: `first_allocations`; `last`, if
    given: each row's last step, after which it takes none)."""
    if not last:
        return sum((num_steps - 1 - j) // block_size + 1 for j in first if j < num_steps)
    return sum((min(num_steps - 1, k) - j) // block_size + 1 for j, k in zip(first, last, strict=True)
               if j < num_steps and j <= k)


def chunk_blocks(prefill: tuple[int, int, int, int] | None, block_size: int, num_steps: int) -> int:
    """Blocks a prompt's first `num_steps` chunks take: `prefill` is (computed tokens, blocks held,
    chunk size, prompt length: the last chunk stops there); its table grows to cover what the
    chunks reach."""
    if prefill is None:
        return 0
    start, held, chunk, end = prefill
    return max(0, -(-min(start + chunk * num_steps, end) // block_size) - held)


def steps_within(first: Sequence[int], block_size: int, num_steps: int, num_blocks: float,
                 prefill: tuple[int, int, int, int] | None = None, last: Sequence[int] = ()) -> int:
    """The most leading steps, up to `num_steps`, whose allocations together take at most `num_blocks`:
    the decode rows' (`first`: `first_allocations`; `last`: see `blocks_allocated`), and with `prefill`
    a prompt's chunks' (`chunk_blocks`). (Blocks that finishing rows free count for nothing: the
    allocations then never reach them in the free queue, so the order of frees and takes is moot.)"""

    def taken(steps: int) -> int:
        return blocks_allocated(first, block_size, steps, last) + chunk_blocks(prefill, block_size, steps)

    if taken(num_steps) <= num_blocks:
        return num_steps
    lo, hi = 0, num_steps  # lo steps fit, hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if taken(mid) <= num_blocks:
            lo = mid
        else:
            hi = mid
    return lo
