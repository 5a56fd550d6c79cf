"""The simulator's fast-forward: decode stretches, steps ahead that would each schedule the same
plain decodes (and at most one prompt chunk of the same size) and nothing else.

It drives an engine core's scheduler and KV cache manager from outside, through the
scheduler's public surface (`StretchScheduler` lists what it uses) and an executor that costs
whole runs of steps (`DecodeRunExecutor`, checked once when a `FastForward` is made). The
scheduler itself knows one mode: single steps. When every running request is a plain decode, no waiting request can
be admitted and nothing is about to end, the next steps are all alike: each feeds every running
request its last token, gives a block to those whose next position starts one, and publishes the
blocks they fill. `plan_stretch` finds how many such steps lie ahead, changing
nothing; the executor costs them in one call (`DecodeRun`); `apply_stretch` then
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
- a deadline falls due (`FastForward.plan` checks the step times against the earliest deadline);
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
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol, runtime_checkable

from cadence.boundary import RequestDelta
from cadence.clock import Clock
from cadence.config import SchedulerConfig
from cadence.engine.core import EngineCore
from cadence.executor.cost_model import DecodeRun
from cadence.kv.manager import KVCacheManager
from cadence.request import Request, RequestStatus
from cadence.sched.features import shared_keys
from cadence.sched.preempt import PreemptionPolicy
from cadence.sched.queue import RequestQueue
from cadence.sched.records import final_delta, token_delta
from cadence.sim.bulk_steps import account_decodes, peek_is_stable, step_blocks

_RUNNING = RequestStatus.RUNNING


@runtime_checkable
class DecodeRunExecutor(Protocol):
    """An executor that costs whole runs of plain-decode steps (the simulator's `SimExecutor`).

    It samples `token_id` for every plain decode and advances `clock` by each step's cost;
    `decode_run_costs` gives each step's cost of a run, charging nothing (`first_step`: how many
    steps after those charged so far the run's first comes), and `charge_decode_run`
    says that the leading steps of those costs ran (`end`: the clock reading after them)."""

    token_id: int
    clock: Clock | None

    def decode_run_costs(self, run: DecodeRun, first_step: int = 0) -> list[float]: ...

    def charge_decode_run(self, costs: Sequence[float], end: float | None = None) -> None: ...

    @property
    def prices_shared_context(self) -> bool: ...


class StretchScheduler(Protocol):
    """What the fast-forward reads and changes of a scheduler (`Scheduler` has it): its state,
    the decisions it would take, and the bookkeeping of steps run all at once."""

    running: list[Request]
    waiting: RequestQueue
    preemption: PreemptionPolicy
    config: SchedulerConfig
    kv: KVCacheManager
    max_model_len: int
    is_static: bool

    @property
    def step_count(self) -> int: ...

    @property
    def revision(self) -> int: ...

    @property
    def next_deadline(self) -> float: ...

    @property
    def has_pending_deltas(self) -> bool: ...

    def eligible(self) -> Callable[[Request], bool] | None: ...

    def chunk(self, req: Request, num_computed: int, budget: int) -> int: ...

    def stop_status(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]: ...

    def finish(self, req: Request, status: RequestStatus, now: float, *, stop_reason: str | int | None = None) -> None: ...

    def steps_ran_outside(self, num_steps: int, last_start: float, *, num_computed: int, num_prompt_tokens: int,
                          num_sampled: int, first_token_latencies: Sequence[tuple[str, float]] = (),
                          went_on: list[str], finished_ids: Sequence[str] = ()) -> None: ...


class FastForward:
    """Plans decode stretches on one engine core, costs them, and applies them: the same state as
    stepping the core that many times. Make one with `FastForward.of(core)`."""

    def __init__(self, core: EngineCore, executor: DecodeRunExecutor) -> None:
        if executor.clock is not core.clock:
            raise ValueError("the executor must advance the engine core's own clock")
        if not core.decode_ids:
            raise ValueError("the engine core must report plain decodes as ids (decode_ids): a stretch makes no delta for them")
        self.core = core
        self.executor = executor
        self._planned: DecodeStretch | None = None
        self._planned_at = (0, 0)

    @classmethod
    def of(cls, core: EngineCore) -> FastForward | None:
        """The fast-forward of `core`, or None where its executor costs no decode runs on its clock
        or it reports plain decodes as deltas (`decode_ids` off)."""
        ex = core.executor
        if not isinstance(ex, DecodeRunExecutor) or ex.clock is not core.clock or not core.decode_ids:
            return None
        return cls(core, ex)

    def plan(self, max_steps: int) -> DecodeStretch | None:
        """The next steps, if they would each schedule the same plain decodes (fewer once some
        finish) and at most one prompt chunk of the same size, possibly up to its last chunk after
        which that request decodes too (the module doc says when), with the costs and end times on
        the core's clock of their first run of alike steps (the rest: `cost`); None otherwise.
        Changes nothing: the caller then applies some leading part of it with `apply` before
        anything else touches the core. Steps that would start at or after a pending deadline are
        left out."""
        now = self.core.clock.now()
        sched = self.core.scheduler
        stretch = plan_stretch(sched, now, self.executor.token_id, max_steps)
        self._planned = None
        if stretch is None:
            return None
        if self.executor.prices_shared_context:  # its runs then count their rows' shared keys
            tables = sched.kv.block_tables
            stretch.tables = tuple(tables.get(r.request_id, ()) for r in stretch.requests)
            stretch.block_size = sched.kv.block_size
        runs = stretch.runs  # (more than one where requests leave mid-stretch, and no deadline is pending)
        costs = self.executor.decode_run_costs(runs[0])
        # Clock readings after each step: one addition per step, as the clock advances by each
        # cost (the first element, `now`, is dropped in place rather than sliced off).
        ends = list(accumulate(costs, initial=now))
        del ends[0]
        if stretch.not_after < math.inf:  # steps that would start at or after the deadline are dropped
            assert len(runs) == 1
            num_steps = bisect_left(ends, stretch.not_after, 0, len(costs) - 1) + 1 if now < stretch.not_after else 0
            if not num_steps:
                return None
            if num_steps < len(costs):
                del costs[num_steps:], ends[num_steps:]
            stretch.num_steps = num_steps
        stretch.start_time = now
        stretch.costs, stretch.step_ends, stretch.pending_runs = costs, ends, runs[1:]
        self._planned, self._planned_at = stretch, (sched.step_count, sched.revision)
        return stretch

    def cost(self, stretch: DecodeStretch, num_steps: int) -> None:
        """Cost the stretch's steps up to `num_steps` (`costs` and `step_ends` grow a run at a time:
        the same additions onto the clock's reading as costing them all at once)."""
        costs, ends = stretch.costs, stretch.step_ends
        while len(costs) < num_steps:
            more = self.executor.decode_run_costs(stretch.pending_runs.pop(0), len(costs))
            more_ends = list(accumulate(more, initial=ends[-1]))
            del more_ends[0]
            costs += more
            ends += more_ends

    def apply(self, stretch: DecodeStretch, num_steps: int) -> list[RequestDelta]:
        """Run the first `num_steps` steps of the stretch just planned (0 drops it): the same state
        as that many `EngineCore.step` calls. Returns what they would have, together: the final
        deltas of the requests they finish (and a joined request's first-token delta), in step
        order; the core's `last_decoded` lists the requests that went on in the last one, and its
        `last_stats` sums the steps (see `apply_stretch`). Raises RuntimeError if the stretch is not
        the one planned last, or the core moved since (a step, a request added or ended)."""
        if stretch is not self._planned:
            raise RuntimeError("not the decode stretch planned last on this core")
        self._planned = None
        core, sched = self.core, self.core.scheduler
        if (sched.step_count, sched.revision) != self._planned_at or core.clock.now() != stretch.start_time:
            raise RuntimeError("the engine core moved since the decode stretch was planned; plan again")
        if not num_steps:
            return []
        self.cost(stretch, num_steps)
        # The step ends are the costs summed onto the clock's reading at planning, which has not
        # moved since (nothing ran on this core): the clock's additions are done.
        end = stretch.step_ends[num_steps - 1]
        costs = stretch.costs if num_steps == len(stretch.costs) else stretch.costs[:num_steps]
        self.executor.charge_decode_run(costs, end)
        deltas = apply_stretch(sched, stretch, num_steps)
        core.steps_ran(end - stretch.start_time)
        return deltas


# ------------------------------------------------------------------ planning
def plan_stretch(s: StretchScheduler, now: float, token: int, max_steps: int) -> DecodeStretch | None:
    """The steps from `now` on that would each schedule the running requests' plain decodes
    (those left, once some finish), every decode sampling `token`, and at most the prompt
    chunk of the last running request (up to `max_steps`; None if none). Changes nothing
    (see the module doc)."""
    running = s.running
    if not running or len(running) > s.config.max_num_batched_tokens or s.has_pending_deltas:
        return None  # with more running requests than the token budget, some wait their turn
    prefill, chunk = _stretch_prefill(s)
    decodes = running[:-1] if prefill is not None else running
    not_after = s.next_deadline
    # Nothing waits, no deadline is pending, no fair-share counters: a stretch may go on past
    # finishing requests, and a prompt's last chunk may join it (see the module doc).
    waiting = s.waiting
    quiet = not waiting and not waiting.tracks_service and not_after == math.inf
    if prefill is not None and not quiet and prefill.num_tokens - prefill.num_computed_tokens <= chunk:
        return None  # its last chunk comes next, and may leave budget to the waiting queue
    # Each request's last step (by length), capped at max_steps; None unless all are plain decodes.
    last = _decode_last_steps(s, decodes, token, max_steps) if now < not_after else None
    if last is None:
        return None
    finish_step = min(last, default=max_steps)
    if finish_step < 0:
        return None
    # The stretch ends with the step in which the first requests finish, unless nothing waits:
    # then the others go on without them (a prompt chunk aside: its size is what they leave).
    num_steps = min((max(last) if prefill is None and quiet else finish_step) + 1, max_steps)
    kv = s.kv
    tables = kv.block_tables
    bs = kv.block_size
    starts = [r.num_computed_tokens for r in decodes]
    first = first_allocations(starts, [len(tables.get(r.request_id, ())) for r in decodes], bs)
    prefill_blocks = None
    join = -1
    join_chunk = 0
    if prefill is not None:
        start, end = prefill.num_computed_tokens, prefill.num_tokens
        held = len(tables.get(prefill.request_id, ()))
        prefill_blocks = (start, held, chunk, end)
        join = (end - start - 1) // chunk  # its chunks before the last
        join_chunk = end - start - join * chunk
        join_last = _join_last(s, prefill, token, join, join_chunk, max_steps) \
            if quiet and finish_step >= join else None
        joined_steps = -1 if join_last is None else min(max(join_last, max(last, default=0)) + 1, max_steps)
        if joined_steps > join:
            assert join_last is not None
            num_steps = joined_steps
            # It joins as the last row: its first decode (at position `end`) in step join + 1.
            vstart = end - join - 1
            decodes = [*decodes, prefill]
            starts.append(vstart)
            # (Its chunks leave it the blocks its prompt fills.)
            first += first_allocations((vstart,), (max(held, kv.num_blocks_needed(end)),), bs)
            last.append(join_last)
        else:
            num_steps, join = min(num_steps, join), -1  # it stops before the last chunk
    if num_steps < 1:
        return None
    # Steps the free blocks last (what the stretch frees counts for nothing); a step short of blocks preempts.
    num_steps = steps_within(first, bs, num_steps, kv.num_free_blocks, prefill_blocks, last)
    if num_steps <= join:  # the blocks run out before the join: the stretch stops before it
        decodes, join = decodes[:-1], -1
        del starts[-1], first[-1], last[-1]
    if num_steps < 1:
        return None
    # (A static batch admits only when it is empty; a prompt chunk spends the whole budget.)
    if waiting and not s.is_static and prefill is None:
        limits = _waiting_limits(s, starts, first, num_steps)
        if limits is None:
            return None
        num_steps = steps_within(first, bs, limits[1], limits[0])
        if num_steps < 1:
            return None
    stretch = DecodeStretch(s.step_count, tuple(decodes), tuple(starts), first, token, num_steps, not_after,
                            tuple(last))
    if prefill is not None:
        stretch.prefill, stretch.prefill_start, stretch.chunk = prefill, prefill.num_computed_tokens, chunk
        if join >= 0:
            stretch.join, stretch.join_chunk = join, join_chunk
    return stretch


def _stretch_prefill(s: StretchScheduler) -> tuple[Request | None, int]:
    """The running request whose prompt chunks a stretch may carry, and its chunk: the last
    one, if it is in its prompt, with the budget the others leave (one token each); (None, 0)
    if none or where its chunks but the last would not spend the whole budget (see the module
    doc; the planner decides whether its last chunk may join)."""
    cfg, running = s.config, s.running
    last = running[-1]
    chunk = cfg.max_num_batched_tokens - (len(running) - 1)
    if last.num_tokens - last.num_computed_tokens < 2:
        return None, 0  # a decode (or a last chunk of one token, which does not join: see _join_last)
    threshold = cfg.long_prefill_token_threshold
    if (not cfg.enable_chunked_prefill or (threshold and threshold < chunk) or chunk < 2
            or s.waiting.tracks_service):
        return None, 0
    return last, chunk


def _decode_last_steps(s: StretchScheduler, decodes: Sequence[Request], token: int, max_steps: int) -> list[int] | None:
    """The step in which each of `decodes` samples its last token (by length), capped at
    `max_steps`; None unless each is a plain decode that `token` does not stop."""
    max_len = s.max_model_len
    last = [0] * len(decodes)
    for i in range(len(decodes) - 1, -1, -1):  # newest first: the likeliest to be mid-prefill
        req = decodes[i]
        outputs = req.output_token_ids
        start = req.num_computed_tokens
        sp = req.sampling_params
        if (not outputs or start != len(req.prompt_token_ids) + len(outputs) - 1 or not sp.plain_decode
                or req.last_token_time is None or token in req.eos_token_ids or token in sp.stop_token_ids):
            return None
        # Step j appends output len(outputs) + j + 1 at context start + j + 2 (as a single step's update).
        last[i] = min(max_steps, sp.max_tokens - len(outputs) - 1, max_len - start - 2)
    return last


def _join_last(s: StretchScheduler, req: Request, token: int, join: int, last_chunk: int, max_steps: int) -> int | None:
    """The step in which `req`, running its last chunk (`last_chunk` tokens) in step `join` of a
    stretch and decoding from the next, samples its last token (by length), capped at
    `max_steps`; None if it may not join (see the module doc)."""
    sp = req.sampling_params
    if (last_chunk < 2 or req.output_token_ids or not sp.plain_decode or token in req.eos_token_ids
            or token in sp.stop_token_ids):
        return None
    # Step join + k samples output k + 1, the context then num_tokens + k + 1 (as a single step's update).
    return min(max_steps, join + max(0, min(sp.max_tokens - 1, s.max_model_len - req.num_tokens - 1)))


def _waiting_limits(s: StretchScheduler, starts: list[int], first: list[int], num_steps: int) -> tuple[float, int] | None:
    """With requests waiting: (blocks, steps) a stretch of up to `num_steps` steps may take
    while the waiting loop gives up on the same request for the same reason every step (see
    the module doc); None if the first step would admit it or preempt for it. `first`: each
    running request's first allocation step."""
    cfg, running = s.config, s.running
    none = math.inf, num_steps  # no limit
    budget = cfg.max_num_batched_tokens - len(running)
    if budget <= 0:
        return none  # the loop never looks
    if not peek_is_stable(s.waiting):
        return None
    head = s.waiting.peek(s.eligible())
    if head is None:
        return none
    if s.preemption.victim_for(head, running) is not None:
        return None  # the policy would preempt for it, for a seat or for blocks
    if len(running) >= cfg.max_num_seqs:
        return none  # no seat, and none will be taken from a running request
    kv = s.kv
    bs = kv.block_size
    computed, num_cached = kv.get_computed_blocks(head)
    n = s.chunk(head, num_cached, budget)  # (no partial prefill runs beside a stretch)
    if n and kv.blocks_to_take(head, n, computed) <= kv.num_free_blocks - blocks_allocated(first, bs, 1):
        return None  # the first step admits it
    return _hit_limits(kv, head, computed.block_ids, starts, num_steps, blocks_allocated(first, bs, num_steps))


def _hit_limits(kv: KVCacheManager, head: Request, hit: tuple[int, ...], starts: list[int], num_steps: int,
                num_blocks: int) -> tuple[float, int]:
    """(blocks, steps) before `head`'s prefix-cache hit (`hit`, its first blocks) could change: an
    allocation evicting a hit block from the free queue, or a running request publishing the
    block that the hit would continue with (it could be the same content). The stretch
    would have `num_steps` steps taking `num_blocks` blocks."""
    steps = num_steps
    if not kv.enable_prefix_caching:
        return math.inf, steps
    pool = kv.pool
    free_hits = {b for b in hit if pool.blocks[b].ref_cnt == 0}
    blocks: float = pool.free_rank(free_hits, num_blocks + 1) if free_hits else math.inf
    bs = kv.block_size
    if len(hit) < (head.num_tokens - 1) // bs:  # the hit could still grow
        last = (len(hit) + 1) * bs - 1  # the position whose decode fills block len(hit)
        for start in starts:
            if start <= last:  # it fills that block in step last - start: the stretch ends there
                steps = min(steps, last - start + 1)
    return blocks, steps


# ------------------------------------------------------------------ applying
def apply_stretch(s: StretchScheduler, stretch: DecodeStretch, num_steps: int) -> list[RequestDelta]:
    """Apply the first `num_steps` steps of `stretch`, planned on this very state, as that many
    single steps would; `stretch.step_ends[j]` is the clock reading after step j (the `now`
    its update sees). Returns the final deltas of the requests that finish in them (and the
    first-token delta of a joined request that goes on past its join step), in step order,
    then scheduling order (what those steps would have returned, all together);
    `last_decoded` lists the requests that went on in the last one. The iteration stats of
    those steps come as one: their counters summed, without the per-token latencies (one
    entry per token is what a stretch exists to avoid)."""
    assert stretch.step == s.step_count, "the scheduler moved since the stretch was planned"
    assert 0 < num_steps <= stretch.num_steps
    reqs, starts, last = stretch.requests, stretch.starts, stretch.last_steps
    ends = stretch.step_ends
    join = stretch.join
    # Each request's steps: all of them, or up to the one in which it finishes.
    done = [min(num_steps, j + 1) for j in last]
    # The rows that decoded throughout, and their outputs (a joined row's come from step join on).
    rows, outs = (reqs, done) if join < 0 else (reqs[:-1], [*done[:-1], max(0, done[-1] - join)])
    tokens = [stretch.token] * num_steps
    for req, k in zip(reqs, outs, strict=True):
        req.output_token_ids.extend(tokens if k == num_steps else tokens[:k])  # first: the blocks published below hash them
    _stretch_blocks(s.kv, stretch, num_steps, done)
    for req, start, k in zip(rows, starts, done, strict=False):  # (a joined row, last, is left to _stretch_prompt)
        req.num_computed_tokens = start + k
        req.last_token_time = ends[k - 1]
    if s.waiting.tracks_service:
        assert all(k == num_steps for k in done), "fair share: no request leaves mid-stretch"
        account_decodes(s.waiting, reqs, num_steps)
    num_computed = num_sampled = sum(outs)
    prompt_tokens = 0
    first_token: list[tuple[str, float]] = []
    if stretch.prefill is not None:
        prompt_tokens = _stretch_prompt(stretch, num_steps, done[-1] if join >= 0 else 0, first_token)
        num_computed += prompt_tokens - (join >= 0 and outs[-1] > 0)  # (a joined row's first token is sampled, not fed)
    finishing = min(last, default=num_steps) < num_steps or 0 <= join < num_steps
    finished: list[str] = []  # those of the last step: the next step's output would carry them
    deltas = _finish_stretch(s, stretch, num_steps, finished) if finishing else []
    # (A joined row decoded in the last step only if that came after its join.)
    went_on = reqs if join < 0 or num_steps - 1 > join else rows
    s.steps_ran_outside(num_steps, ends[num_steps - 2] if num_steps > 1 else stretch.start_time,
                        num_computed=num_computed, num_prompt_tokens=prompt_tokens, num_sampled=num_sampled,
                        first_token_latencies=first_token,
                        went_on=[r.request_id for r in went_on if r.status is _RUNNING], finished_ids=finished)
    return deltas


def _stretch_prompt(stretch: DecodeStretch, num_steps: int, done: int, first_token: list[tuple[str, float]]) -> int:
    """A stretch's prompt row after its first `num_steps` steps (`done`: its steps, if it joins):
    its progress, and its first token's time if it joined (its latency added to `first_token`).
    Returns the prompt tokens computed."""
    req, join, ends = stretch.prefill, stretch.join, stretch.step_ends
    assert req is not None
    if join < 0 or num_steps <= join:  # still in its prompt
        prompt_tokens = stretch.chunk * num_steps
        req.num_computed_tokens = stretch.prefill_start + prompt_tokens
        return prompt_tokens
    req.num_computed_tokens = stretch.starts[-1] + done
    req.first_token_time = ends[join]
    req.last_token_time = ends[done - 1]
    first_token.append((req.tenant, ends[join] - req.arrival_time))
    return stretch.chunk * join + stretch.join_chunk


def _finish_stretch(s: StretchScheduler, stretch: DecodeStretch, num_steps: int, finished: list[str]) -> list[RequestDelta]:
    """The requests that finish in the first `num_steps` steps (length limits): what a single
    step's update does for them, in step order, then scheduling order. (Their blocks return
    to the pool after the stretch's allocations and publications rather than between them: a
    free never touches a block's hash, nor the blocks at the head of the free queue that the
    stretch's allocations take, since `steps_within` counts no freed block.) Only those of the
    last step stay listed in `finished`: the next step's output would have carried the others.
    Returns their final deltas, with a joined request's first-token delta in its place."""
    deltas = []
    token, ends, join = stretch.token, stretch.step_ends, stretch.join
    # A joined row that goes on past its join step: its first token's delta, after those of
    # the requests finishing in that step (it is the last row).
    first_token = join if 0 <= join < num_steps and stretch.last_steps[-1] > join else -1
    done = -1  # the last step that finished requests
    for step, rows in stretch.finish_groups().items():
        if step >= num_steps:
            break
        if 0 <= first_token < step:
            deltas.append(token_delta(stretch.requests[-1], token, ()))
            first_token = -1
        done = step
        finished.clear()  # (those of an earlier step went out with the step after it)
        for i in rows:
            req = stretch.requests[i]
            status, stop_reason = s.stop_status(req, token)
            assert status is RequestStatus.FINISHED_LENGTH, f"{req.request_id}: planned to finish by length"
            s.finish(req, status, ends[step], stop_reason=stop_reason)
            finished.append(req.request_id)
            deltas.append(final_delta(req, (token,)))
    if first_token >= 0:
        deltas.append(token_delta(stretch.requests[-1], token, ()))
    if done < num_steps - 1:
        finished.clear()
    return deltas


def _stretch_blocks(kv: KVCacheManager, stretch: DecodeStretch, num_steps: int, done: list[int]) -> None:
    """The block operations of a stretch's first `num_steps` steps, in single-step order: each step
    allocates for the rows entering a new block, then publishes the blocks rows filled, both in
    scheduling order. Only those events are visited (one per decode row every `block_size`
    steps; the prompt chunk's row, after the decodes, has both every step: `allocate_slots`
    and `cache_computed_blocks` do nothing where it needs no block and fills none; a joined
    row has the chunk's events up to its join, then a decode's). `done`: each row's steps,
    the last of which it may finish in."""
    bs = kv.block_size
    reqs, starts, join = stretch.requests, stretch.starts, stretch.join
    # (step, 0 allocate | 1 publish, row); one comprehension each (most rows of a short stretch have none).
    # (A joined row's first decode allocation comes after its join: see first_allocations in plan_stretch.)
    events = [(j, 0, i) for i, (first, end) in enumerate(zip(stretch.first_allocations, done, strict=True))
              for j in range(first, end, bs)]
    caching = kv.enable_prefix_caching  # (publishing is a no-op otherwise)
    if caching:  # start + j + 1 fills a block (a joined row's are added below)
        events += [(j, 1, i) for i, (start, end) in enumerate(zip(starts if join < 0 else starts[:-1], done,
                                                                    strict=False))
                   for j in range((-start - 1) % bs, end, bs)]
    prefill = stretch.prefill
    row = -1
    rows: Sequence[Request]
    if prefill is None:
        rows, row_starts, widths, cap = reqs, starts, [1] * len(reqs), None
    else:
        row = len(reqs) - 1 if join >= 0 else len(reqs)  # the prompt's row: after the decodes
        events += [(j, kind, row) for j in range(num_steps if join < 0 else min(num_steps, join + 1)) for kind in (0, 1)]
        rows = reqs if join >= 0 else (*reqs, prefill)
        row_starts, widths = (*starts[:row], stretch.prefill_start), [1] * row + [stretch.chunk]
        cap = None
        if join >= 0:  # its tokens stop at its prompt's end in step join, then grow by one a step
            vstart = starts[-1]
            cap = (row, vstart)
            if caching:
                j0 = (-vstart - 1) % bs
                if j0 <= join:
                    j0 += ((join - j0) // bs + 1) * bs
                events += [(j, 1, row) for j in range(j0, done[-1], bs)]
    events.sort()
    if step_blocks(kv, rows, row_starts, widths, events, cap):
        return
    # One by one (a block it publishes may duplicate a cached block that it evicts).
    allocate, publish = kv.allocate_slots, kv.cache_computed_blocks
    chunks_row = row
    chunks_end = num_steps if join < 0 else join + 1
    for j, kind, i in events:
        if i == chunks_row and j < chunks_end:
            _stretch_chunk(kv, stretch, j, kind)
            continue
        req = rows[i]
        if kind:
            req.num_computed_tokens = starts[i] + j + 1
            publish(req)
        else:
            req.num_computed_tokens = starts[i] + j
            if allocate(req, 1) is None:
                raise AssertionError(f"{req.request_id}: the stretch ran out of blocks")


def _stretch_chunk(kv: KVCacheManager, stretch: DecodeStretch, step: int, publish: int) -> None:
    """Step `step` of a stretch's prompt chunks: its blocks allocated (0), or those it filled published (1)."""
    req, chunk = stretch.prefill, stretch.chunk
    assert req is not None
    end = stretch.prefill_end  # (its last chunk, with a join, may be shorter)
    if publish:
        req.num_computed_tokens = int(min(stretch.prefill_start + chunk * (step + 1), end))
        kv.cache_computed_blocks(req)
    else:
        req.num_computed_tokens = stretch.prefill_start + chunk * step
        if kv.allocate_slots(req, int(min(chunk, end - req.num_computed_tokens))) is None:
            raise AssertionError(f"{req.request_id}: the stretch ran out of blocks")


# ------------------------------------------------------------------ the stretch and its block arithmetic
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
    num_steps: int  # steps planned; `FastForward.plan` may cut them at a deadline
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
    start_time: float = 0.0  # clock reading at the first step (set by `FastForward.plan`)
    costs: list[float] = field(default_factory=list)  # each step's cost (FastForward)
    step_ends: list[float] = field(default_factory=list)  # clock reading after each step (FastForward)
    # Runs not costed yet: past the first finishes, steps are costed a run at a time as they are
    # needed (FastForward.cost), so that a stretch cut short costs little more than it ran.
    pending_runs: list[DecodeRun] = field(default_factory=list)
    # With `block_size` (an executor that prices shared decode keys), each row's block table at
    # planning: the blocks a row takes during the stretch are fresh, so these hold every block two
    # rows can share, and a run's shared keys are the same in each of its steps.
    tables: tuple[tuple[int, ...], ...] = ()
    block_size: int = 0

    def _shared(self, rows: Sequence[int], step: int) -> int:
        """The shared decode keys (`shared_keys`) of step `step` when `rows` (ascending: scheduling
        order) decode in it."""
        if not self.block_size:
            return 0
        starts, tables = self.starts, self.tables
        return shared_keys(((starts[i] + step + 1, tables[i]) for i in rows), self.block_size)

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
        shared = self._shared(range(n), 0)
        out = [DecodeRun(n, total, top, join, self.chunk, self.prefill_start, shared=shared)] if join else []
        out.append(DecodeRun(n, total + join * n, top + join, 1, self.join_chunk,
                             self.prefill_start + join * self.chunk, sampled=1, shared=shared))
        return out + self._runs_from(join + 1, 0, 0)

    def _runs_from(self, a: int, chunk: int, chunk_start: int) -> list[DecodeRun]:
        """The runs of steps `a`.. (rows whose last step is before `a` have left), with `chunk` a
        step beside them."""
        starts, last, n = self.starts, self.last_steps, self.num_steps
        if a >= n:
            return []
        if not last or min(last) >= n - 1:  # every row decodes in every step
            return [DecodeRun(len(starts), sum(starts) + a * len(starts), max(starts) + a if starts else 0, n - a, chunk,
                              chunk_start, shared=self._shared(range(len(starts)), a))]
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
            out.append(DecodeRun(rows, suffix_sum[p] + a * rows, suffix_max[p] + a, b - a, chunk, chunk_start + a * chunk,
                                 shared=self._shared(sorted(order[p:]), a)))
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
