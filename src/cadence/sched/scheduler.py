"""The scheduler: decides, each step, which requests advance and by how many tokens.

Pure Python: time comes in as `now`, work goes out as a frozen `SchedulerOutput`, results come
back as a `ModelOutput`. One step is `schedule(now)`, the executor, then `update(...)`:

1. Running requests first: a decode gets one token, a request mid-prefill its next chunk. When
   the KV cache has no block for one, a victim (the preemption policy's choice, possibly the
   request itself) is preempted by recompute and returns to the head of the waiting queue.
2. Then waiting requests in the queue policy's order while the token budget, `max_num_seqs` and
   blocks last; the prefix cache is consulted on admission.

`num_computed_tokens` advances in `update`, once the executor has written the KV, so a step
planned in `schedule` can be undone (a victim preempted later in the same plan) by forgetting it.

With `batch_decodes` (set when the executor accepts a `DecodeBatch`), plain decodes leave
`schedule` as one batch of columns and come back from `update` as ids in `last_decoded` instead of
a `RequestDelta` each. Every decision is the same either way: only the records differ, and
`update` still walks the step in scheduling order (the order requests finish in is the order
their blocks return to the pool).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cadence.config import CacheConfig, SchedulerConfig
from cadence.errors import AdmissionError, ErrorKind
from cadence.kv.manager import KVCacheManager
from cadence.metrics.stats import IterationStats, SchedulerStats
from cadence.request import Request, RequestStatus
from cadence.sched.admission import AdmissionControl
from cadence.sched.output import (
    NO_DECODES,
    DecodeBatch,
    ModelOutput,
    RequestDelta,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from cadence.sched.preempt import make_preemption_policy
from cadence.sched.queue import make_queue
from cadence.sched.records import decode_batch, final_delta, finished_stats, scheduled_request, token_delta
from cadence.sched.stretch import DecodeStretch, blocks_allocated, first_allocations, steps_within

_RUNNING = RequestStatus.RUNNING


@dataclass
class _Plan:
    """One step being planned: each scheduled request's row (in scheduling order) and what is left.

    A row is the request's record, or (batch mode) the `Request` itself for a plain decode, whose
    columns are read when the step's `DecodeBatch` is built. Either way nothing read (progress,
    outputs, the request's own block table) changes later in the same `schedule`, and a request
    preempted later in the plan has its row dropped.
    """

    budget: int
    rows: dict[str, ScheduledRequest | Request] = field(default_factory=dict)
    num_prefill: int = 0  # tokens of the records that are prefill (prompt chunks and recompute)
    preempted: list[str] = field(default_factory=list)

    def add(self, req: Request, n: int, block_table: tuple[int, ...]) -> None:
        self.rows[req.request_id] = scheduled_request(req, n, block_table)
        if _is_prefill(req, n):
            self.num_prefill += n
        self.budget -= n

    def num_tokens(self, rid: str) -> int:
        """Tokens planned for request `rid` (0 if none)."""
        row = self.rows.get(rid)
        if row is None:
            return 0
        return len(row.token_ids) if type(row) is ScheduledRequest else 1

    def undo(self, req: Request) -> None:
        """Forget `req`'s share of the plan (it was just preempted), if it had one."""
        n = self.num_tokens(req.request_id)
        if n:
            del self.rows[req.request_id]
            if _is_prefill(req, n):
                self.num_prefill -= n
            self.budget += n


def _is_prefill(req: Request, n: int) -> bool:
    """A decode is one token at an output position; prompt chunks and recompute are prefill.
    `req.num_computed_tokens` must still be where the chunk starts (it advances in `update`)."""
    return n != 1 or req.num_computed_tokens < len(req.prompt_token_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, kv: KVCacheManager, max_model_len: int, *,
                 batch_decodes: bool = False) -> None:
        config.validate()
        if max_model_len < 1:
            raise ValueError("max_model_len: must be >= 1")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = make_queue(config)
        self.preemption = make_preemption_policy(config)
        self.admission = AdmissionControl(config, max_model_len, kv.capacity_tokens)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.last_iteration_stats = IterationStats()
        self._static = config.scheduler == "static"
        self._batch_decodes = batch_decodes
        # Batch mode: requests whose plain decode gave one token in the last `update` and went on.
        # They get no RequestDelta; each one's new token is its last output token.
        self.last_decoded: list[str] = []
        self._salt_with_tenant = cache.tenant_isolation
        self._tenant_running: Counter[str] = Counter()
        self._deadlines: list[tuple[float, str]] = []
        self._finished_ids: list[str] = []  # not yet reported to the executor
        self._preempted_ids: list[str] = []  # likewise
        self._pending_deltas: list[RequestDelta] = []  # finishes decided inside schedule()
        # Sum of the running requests' computed tokens, kept as they change: stats() runs every step.
        self._num_live_tokens = 0
        self._stats = IterationStats()
        self._step = 0
        self._now = 0.0

    # ------------------------------------------------------------------ admission
    def add_request(self, request: Request, now: float, *, evict: bool = True) -> None:
        """Queue a request, or raise AdmissionError (too long, queue full, deadline passed)."""
        self.add_requests((request,), now, evict=evict)

    def add_requests(self, group: Sequence[Request], now: float, *, evict: bool = True) -> None:
        """Queue one client request's engine requests (its choices; one tenant) all or nothing, or
        raise AdmissionError. Admission may first drop queued requests to make room (the queue's
        policy decides; never with `evict` False): each ends FINISHED_EVICTED with its refusal in
        `error` and `retry_after`, its final delta out with the next `update`."""
        try:
            self._check_ids(group)
            evictions = self.admission.check(group, self.waiting, now, evict=evict)
        except AdmissionError as e:
            self._stats.rejections[e.kind.value] = self._stats.rejections.get(e.kind.value, 0) + 1
            raise
        for ev in evictions:
            victim = ev.request
            victim.retry_after = ev.error.retry_after
            self._finish(victim, RequestStatus.FINISHED_EVICTED, now, error=ev.error.message)
            self._pending_deltas.append(final_delta(victim))
        for request in group:
            self._enqueue(request)

    def _check_ids(self, group: Sequence[Request]) -> None:
        """Unique ids not in use, and one tenant (fair share weighs a group as its tenant's)."""
        ids = [r.request_id for r in group]
        taken = next((rid for rid in ids if rid in self.requests), None)
        if taken is None and len(group) > 1 and len(set(ids)) < len(ids):
            taken = next(rid for rid in ids if ids.count(rid) > 1)
        if taken is not None:
            raise AdmissionError(ErrorKind.INVALID_REQUEST, f"request id {taken!r} is already in use")
        if len(group) > 1 and len({r.tenant for r in group}) > 1:
            raise AdmissionError(ErrorKind.INVALID_REQUEST, "the requests of one group must share a tenant")

    def _enqueue(self, request: Request) -> None:
        if self._salt_with_tenant and request.cache_salt is None:
            request.cache_salt = request.tenant
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))

    # ------------------------------------------------------------------ scheduling
    def schedule(self, now: float) -> SchedulerOutput:
        self._step += 1
        self._now = now
        self._stats.step, self._stats.now = self._step, now
        self._expire_deadlines(now)
        # Static batching: admit only into an empty batch, then hold it until all members finish.
        may_admit = not self._static or not self.running
        plan = _Plan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if may_admit:
            self._schedule_waiting(plan)
        prefix = self.kv.pop_prefix_stats()
        self._stats.prefix_cache_queries += prefix.queries
        self._stats.prefix_cache_hits += prefix.hits
        return self._build_output(plan)

    def _chunk(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens to schedule for `req` this step given the budget; 0 means it waits."""
        cfg = self.config
        remaining = req.num_tokens - num_computed
        assert remaining >= 1, f"{req.request_id}: nothing left to compute"
        n = min(remaining, budget)
        if cfg.enable_chunked_prefill:
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
        elif n < remaining and remaining <= cfg.max_num_batched_tokens:
            return 0  # unchunked: wait for a step with room (longer ones, after a preemption, must chunk)
        return n

    def _schedule_running(self, plan: _Plan) -> None:
        allocate, table = self.kv.allocate_slots, self.kv.block_tables.get
        block_size = self.kv.block_size
        rows = plan.rows
        batch = self._batch_decodes
        for req in list(self.running):
            if plan.budget <= 0:
                break
            if req.status is not _RUNNING:
                continue  # preempted earlier in this loop
            # The common case, a decode, skips the chunk arithmetic (this loop runs per request per step).
            rid = req.request_id
            start = req.num_computed_tokens
            num_prompt = len(req.prompt_token_ids)
            remaining = num_prompt + len(req.output_token_ids) - start
            n = 1 if remaining == 1 else self._chunk(req, start, plan.budget)
            if n == 0:
                continue
            ids = table(rid, ())
            # Most steps the tokens fit in the blocks the request holds (a decode needs a new block
            # every `block_size` steps): then allocate_slots would return at once, so skip the call.
            if start + n > len(ids) * block_size:
                while allocate(req, n) is None:
                    victim = self.preemption.choose_victim(self.running)
                    self._preempt(victim, plan)
                    if victim is req:
                        break
                else:
                    ids = table(rid, ())
                if req.status is not _RUNNING:
                    continue  # it was its own victim
            # plan.add, inlined: this is the per-decode, per-step path.
            if n != 1 or start < num_prompt:
                rows[rid] = scheduled_request(req, n, ids)
                plan.num_prefill += n
            elif batch and req.sampling_params.plain_decode:
                rows[rid] = req  # a row of the step's DecodeBatch
            else:
                rows[rid] = scheduled_request(req, n, ids)
            plan.budget -= n

    def _eligible(self) -> Callable[[Request], bool] | None:
        """Which waiting requests may be admitted now (None: all): the per-tenant running cap."""
        cap = self.config.tenant_max_running
        return (lambda r: self._tenant_running[r.tenant] < cap) if cap is not None else None

    def _schedule_waiting(self, plan: _Plan) -> None:
        eligible = self._eligible()
        while self.waiting and (plan.budget > 0 or self._static):
            req = self.waiting.peek(eligible)
            if req is None:
                return
            seat_victim = None
            if len(self.running) >= self.config.max_num_seqs:
                seat_victim = self.preemption.victim_for(req, self.running)
                if seat_victim is None:
                    return
            computed, num_cached = self.kv.get_computed_blocks(req)
            n = self._admission_chunk(req, num_cached, plan)
            if n == 0 and not self._static:
                return
            if seat_victim is not None:
                self._preempt(seat_victim, plan)
            # Static batches reserve the whole prompt now, so members never wait for blocks mid-prefill.
            reserve = req.num_tokens - num_cached if self._static else n
            while self.kv.allocate_slots(req, reserve, computed) is None:
                victim = self.preemption.victim_for(req, self.running)
                if victim is None:
                    return
                self._preempt(victim, plan)
            self._admit(req, num_cached, n, plan)

    def _admission_chunk(self, req: Request, num_cached: int, plan: _Plan) -> int:
        n = self._chunk(req, num_cached, plan.budget) if plan.budget > 0 else 0
        if 0 < n < req.num_tokens - num_cached and self._num_partial(plan) >= self.config.max_num_partial_prefills:
            return 0  # would start one more partial prefill than allowed
        return n

    def _num_partial(self, plan: _Plan) -> int:
        """Running requests that will still be mid-prefill after this step."""
        planned = plan.num_tokens
        return sum(1 for r in self.running if r.num_computed_tokens + planned(r.request_id) < r.num_tokens)

    def _admit(self, req: Request, num_cached: int, n: int, plan: _Plan) -> None:
        self.waiting.remove(req)
        req.status = _RUNNING
        req.num_computed_tokens = num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self._now
            req.num_cached_tokens = num_cached
        self.running.append(req)
        self._num_live_tokens += num_cached
        self._tenant_running[req.tenant] += 1
        if n:
            plan.add(req, n, self.kv.block_table(req.request_id))

    def _preempt(self, victim: Request, plan: _Plan) -> None:
        """Recompute preemption: free the blocks, forget progress, back to the queue's head."""
        self._leave_running(victim, keep_hashes=True)
        plan.undo(victim)  # before its progress is reset: the undo reads where its chunk started
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        plan.preempted.append(victim.request_id)
        self._stats.num_preemptions += 1
        self.waiting.push_front(victim)

    def _leave_running(self, req: Request, *, keep_hashes: bool = False) -> None:
        # Found by identity: list.remove compares with ==, which for a Request (a dataclass)
        # compares every field of each request it passes.
        running = self.running
        del running[next(i for i, r in enumerate(running) if r is req)]
        self._num_live_tokens -= req.num_computed_tokens
        self._tenant_running[req.tenant] -= 1
        if not self._tenant_running[req.tenant]:
            del self._tenant_running[req.tenant]
        self.kv.free(req, keep_hashes=keep_hashes)

    def _build_output(self, plan: _Plan) -> SchedulerOutput:
        decodes, before = NO_DECODES, ()
        if self._batch_decodes:
            scheduled, decodes, before = self._split_rows(plan)
        else:
            scheduled = tuple(plan.rows.values())  # every row is a record
        num_prefill = plan.num_prefill
        self._preempted_ids.extend(plan.preempted)
        num_tokens = self.config.max_num_batched_tokens - plan.budget
        out = SchedulerOutput(
            step=self._step,
            scheduled=scheduled,  # type: ignore[arg-type]
            preempted_ids=tuple(self._preempted_ids),
            finished_ids=tuple(self._finished_ids),
            num_batched_tokens=num_tokens,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_tokens - num_prefill,
            decodes=decodes,
            decodes_before=before,
        )
        if plan.rows:  # an empty output is never executed: keep the ids for the next one
            self._preempted_ids.clear()
            self._finished_ids.clear()
        return out

    def _split_rows(self, plan: _Plan) -> tuple[tuple[ScheduledRequest, ...], DecodeBatch, tuple[int, ...]]:
        """Batch mode: the records, the plain decodes as one batch, and how many decodes precede each record."""
        records: list[ScheduledRequest] = []
        before: list[int] = []
        decodes: list[Request] = []
        for row in plan.rows.values():
            if type(row) is ScheduledRequest:
                records.append(row)
                before.append(len(decodes))
            else:
                decodes.append(row)  # type: ignore[arg-type]
        batch = decode_batch(decodes, self.kv.block_tables) if decodes else NO_DECODES
        return tuple(records), batch, tuple(before)

    # ------------------------------------------------------------------ decode stretches (simulator)
    def plan_decode_stretch(self, now: float, token: int, max_steps: int) -> DecodeStretch | None:
        """The steps from `now` on that would each schedule the running requests' plain decodes
        (those left, once some finish), every decode sampling `token`, and at most the prompt
        chunk of the last running request (up to `max_steps`; None if none). Changes nothing
        (see sched/stretch.py)."""
        running = self.running
        if not running or len(running) > self.config.max_num_batched_tokens or self._pending_deltas:
            return None  # with more running requests than the token budget, some wait their turn
        prefill, chunk = self._stretch_prefill()
        decodes = running[:-1] if prefill is not None else running
        not_after = self._deadlines[0][0] if self._deadlines else math.inf
        # Nothing waits, no deadline is pending, no fair-share counters: a stretch may go on past
        # finishing requests, and a prompt's last chunk may join it (see sched/stretch.py).
        quiet = not self.waiting and not self.waiting.tracks_service and not_after == math.inf
        if prefill is not None and not quiet and prefill.num_tokens - prefill.num_computed_tokens <= chunk:
            return None  # its last chunk comes next, and may leave budget to the waiting queue
        # Each request's last step (by length), capped at max_steps; None unless all are plain decodes.
        last = self._decode_last_steps(decodes, token, max_steps) if now < not_after else None
        if last is None:
            return None
        finish_step = min(last, default=max_steps)
        if finish_step < 0:
            return None
        # The stretch ends with the step in which the first requests finish, unless nothing waits:
        # then the others go on without them (a prompt chunk aside: its size is what they leave).
        num_steps = min((max(last) if prefill is None and quiet else finish_step) + 1, max_steps)
        kv = self.kv
        tables = kv.block_tables
        bs = kv.block_size
        starts = [r.num_computed_tokens for r in decodes]
        first = first_allocations(starts, [len(tables.get(r.request_id, ())) for r in decodes], bs)
        prefill_blocks = None
        join = -1
        if prefill is not None:
            start, end = prefill.num_computed_tokens, prefill.num_tokens
            held = len(tables.get(prefill.request_id, ()))
            prefill_blocks = (start, held, chunk, end)
            join = (end - start - 1) // chunk  # its chunks before the last
            join_chunk = end - start - join * chunk
            join_last = self._join_last(prefill, token, join, join_chunk, max_steps) \
                if quiet and finish_step >= join else None
            joined_steps = -1 if join_last is None else min(max(join_last, max(last, default=0)) + 1, max_steps)
            if joined_steps > join:
                num_steps = joined_steps
                # It joins as the last row: its first decode (at position `end`) in step join + 1.
                vstart = end - join - 1
                decodes = (*decodes, prefill)
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
        if self.waiting and not self._static and prefill is None:
            limits = self._waiting_limits(starts, first, num_steps)
            if limits is None:
                return None
            num_steps = steps_within(first, bs, limits[1], limits[0])
            if num_steps < 1:
                return None
        stretch = DecodeStretch(self._step, tuple(decodes), tuple(starts), first, token, num_steps, not_after,
                                tuple(last))
        if prefill is not None:
            stretch.prefill, stretch.prefill_start, stretch.chunk = prefill, prefill.num_computed_tokens, chunk
            if join >= 0:
                stretch.join, stretch.join_chunk = join, join_chunk
        return stretch

    def _stretch_prefill(self) -> tuple[Request | None, int]:
        """The running request whose prompt chunks a stretch may carry, and its chunk: the last
        one, if it is in its prompt, with the budget the others leave (one token each); (None, 0)
        if none or where its chunks but the last would not spend the whole budget (see
        sched/stretch.py; the planner decides whether its last chunk may join)."""
        cfg, running = self.config, self.running
        last = running[-1]
        chunk = cfg.max_num_batched_tokens - (len(running) - 1)
        if last.num_tokens - last.num_computed_tokens < 2:
            return None, 0  # a decode (or a last chunk of one token, which does not join: see _join_last)
        threshold = cfg.long_prefill_token_threshold
        if (not cfg.enable_chunked_prefill or (threshold and threshold < chunk) or chunk < 2
                or self.waiting.tracks_service):
            return None, 0
        return last, chunk

    def _decode_last_steps(self, decodes: list[Request], token: int, max_steps: int) -> list[int] | None:
        """The step in which each of `decodes` samples its last token (by length), capped at
        `max_steps`; None unless each is a plain decode that `token` does not stop."""
        max_len = self.max_model_len
        last = [0] * len(decodes)
        for i in range(len(decodes) - 1, -1, -1):  # newest first: the likeliest to be mid-prefill
            req = decodes[i]
            outputs = req.output_token_ids
            start = req.num_computed_tokens
            sp = req.sampling_params
            if (not outputs or start != len(req.prompt_token_ids) + len(outputs) - 1 or not sp.plain_decode
                    or req.last_token_time is None or token in req.eos_token_ids or token in sp.stop_token_ids):
                return None
            # Step j appends output len(outputs) + j + 1 at context start + j + 2 (see _update_decodes).
            last[i] = min(max_steps, sp.max_tokens - len(outputs) - 1, max_len - start - 2)
        return last

    def _join_last(self, req: Request, token: int, join: int, last_chunk: int, max_steps: int) -> int | None:
        """The step in which `req`, running its last chunk (`last_chunk` tokens) in step `join` of a
        stretch and decoding from the next, samples its last token (by length), capped at
        `max_steps`; None if it may not join (see sched/stretch.py)."""
        sp = req.sampling_params
        if (last_chunk < 2 or req.output_token_ids or not sp.plain_decode or token in req.eos_token_ids
                or token in sp.stop_token_ids):
            return None
        # Step join + k samples output k + 1, the context then num_tokens + k + 1 (see _append_token).
        return min(max_steps, join + max(0, min(sp.max_tokens - 1, self.max_model_len - req.num_tokens - 1)))

    def _waiting_limits(self, starts: list[int], first: list[int], num_steps: int) -> tuple[float, int] | None:
        """With requests waiting: (blocks, steps) a stretch of up to `num_steps` steps may take
        while the waiting loop gives up on the same request for the same reason every step (see
        sched/stretch.py); None if the first step would admit it or preempt for it. `first`: each
        running request's first allocation step."""
        cfg, running = self.config, self.running
        none = math.inf, num_steps  # no limit
        budget = cfg.max_num_batched_tokens - len(running)
        if budget <= 0:
            return none  # the loop never looks
        if not self.waiting.peek_is_stable():
            return None
        head = self.waiting.peek(self._eligible())
        if head is None:
            return none
        if self.preemption.victim_for(head, running) is not None:
            return None  # the policy would preempt for it, for a seat or for blocks
        if len(running) >= cfg.max_num_seqs:
            return none  # no seat, and none will be taken from a running request
        kv = self.kv
        bs = kv.block_size
        computed, num_cached = kv.get_computed_blocks(head)
        n = self._chunk(head, num_cached, budget)  # (no partial prefill runs beside a stretch)
        if n and kv.blocks_to_take(head, n, computed) <= kv.num_free_blocks - blocks_allocated(first, bs, 1):
            return None  # the first step admits it
        return self._hit_limits(head, computed.block_ids, starts, num_steps, blocks_allocated(first, bs, num_steps))

    def _hit_limits(self, head: Request, hit: tuple[int, ...], starts: list[int], num_steps: int,
                    num_blocks: int) -> tuple[float, int]:
        """(blocks, steps) before `head`'s prefix-cache hit (`hit`, its first blocks) could change: an
        allocation evicting a hit block from the free queue, or a running request publishing the
        block that the hit would continue with (it could be the same content). The stretch
        would have `num_steps` steps taking `num_blocks` blocks."""
        kv = self.kv
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

    def apply_decode_stretch(self, stretch: DecodeStretch, num_steps: int) -> list[RequestDelta]:
        """Apply the first `num_steps` steps of `stretch`, planned on this very state, as that many
        single steps would; `stretch.step_ends[j]` is the clock reading after step j (the `now`
        its update sees). Returns the final deltas of the requests that finish in them (and the
        first-token delta of a joined request that goes on past its join step), in step order,
        then scheduling order (what those steps would have returned, all together);
        `last_decoded` lists the requests that went on in the last one. The iteration stats of
        those steps come as one: their counters summed, without the per-token latencies (one
        entry per token is what a stretch exists to avoid)."""
        assert stretch.step == self._step, "the scheduler moved since the stretch was planned"
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
        self._stretch_blocks(stretch, num_steps, done)
        for req, start, k in zip(rows, starts, done, strict=False):  # (a joined row, last, is left to _stretch_prompt)
            req.num_computed_tokens = start + k
            req.last_token_time = ends[k - 1]
        if self.waiting.tracks_service:
            assert all(k == num_steps for k in done), "fair share: no request leaves mid-stretch"
            self.waiting.account_decodes(reqs, num_steps)
        num_computed = num_sampled = sum(outs)
        if stretch.prefill is not None:
            prompt_tokens = self._stretch_prompt(stretch, num_steps, done[-1] if join >= 0 else 0)
            num_computed += prompt_tokens - (join >= 0 and outs[-1] > 0)  # (a joined row's first token is sampled, not fed)
            self._stats.num_prompt_tokens += prompt_tokens
        self._num_live_tokens += num_computed
        self._step += num_steps
        self._now = ends[num_steps - 2] if num_steps > 1 else stretch.start_time
        # The first step's output would have carried these to the executor.
        self._finished_ids.clear()
        self._preempted_ids.clear()
        finishing = min(last, default=num_steps) < num_steps or 0 <= join < num_steps
        deltas = self._finish_stretch(stretch, num_steps) if finishing else []
        # (A joined row decoded in the last step only if that came after its join.)
        went_on = reqs if join < 0 or num_steps - 1 > join else rows
        self.last_decoded = [r.request_id for r in went_on if r.status is _RUNNING]
        stats = self._stats
        stats.step, stats.now = self._step, self._now
        stats.num_generation_tokens += num_sampled
        self._close_stats()
        return deltas

    def _stretch_prompt(self, stretch: DecodeStretch, num_steps: int, done: int) -> int:
        """A stretch's prompt row after its first `num_steps` steps (`done`: its steps, if it joins):
        its progress, and its first token's time if it joined. Returns the prompt tokens computed."""
        req, join, ends = stretch.prefill, stretch.join, stretch.step_ends
        assert req is not None
        if join < 0 or num_steps <= join:  # still in its prompt
            prompt_tokens = stretch.chunk * num_steps
            req.num_computed_tokens = stretch.prefill_start + prompt_tokens
            return prompt_tokens
        req.num_computed_tokens = stretch.starts[-1] + done
        req.first_token_time = ends[join]
        req.last_token_time = ends[done - 1]
        self._stats.first_token_latencies.append((req.tenant, ends[join] - req.arrival_time))
        return stretch.chunk * join + stretch.join_chunk

    def _finish_stretch(self, stretch: DecodeStretch, num_steps: int) -> list[RequestDelta]:
        """The requests that finish in the first `num_steps` steps (length limits): what
        `_update_decodes` does for them, in step order, then scheduling order. (Their blocks return
        to the pool after the stretch's allocations and publications rather than between them: a
        free never touches a block's hash, nor the blocks at the head of the free queue that the
        stretch's allocations take, since `steps_within` counts no freed block.) Only those of the
        last step stay listed as finished: the next step's output would have carried the others.
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
            self._finished_ids.clear()  # (those of an earlier step went out with the step after it)
            for i in rows:
                req = stretch.requests[i]
                status, stop_reason = self._stop_status(req, token)
                assert status is RequestStatus.FINISHED_LENGTH, f"{req.request_id}: planned to finish by length"
                self._finish(req, status, ends[step], stop_reason=stop_reason)
                deltas.append(final_delta(req, (token,)))
        if first_token >= 0:
            deltas.append(token_delta(stretch.requests[-1], token, ()))
        if done < num_steps - 1:
            self._finished_ids.clear()
        return deltas

    def _stretch_blocks(self, stretch: DecodeStretch, num_steps: int, done: list[int]) -> None:
        """The block operations of a stretch's first `num_steps` steps, in single-step order: each step
        allocates for the rows entering a new block, then publishes the blocks rows filled, both in
        scheduling order. Only those events are visited (one per decode row every `block_size`
        steps; the prompt chunk's row, after the decodes, has both every step: `allocate_slots`
        and `cache_computed_blocks` do nothing where it needs no block and fills none; a joined
        row has the chunk's events up to its join, then a decode's). `done`: each row's steps,
        the last of which it may finish in."""
        kv = self.kv
        bs = kv.block_size
        reqs, starts, join = stretch.requests, stretch.starts, stretch.join
        # (step, 0 allocate | 1 publish, row); one comprehension each (most rows of a short stretch have none).
        # (A joined row's first decode allocation comes after its join: see first_allocations in plan_decode_stretch.)
        events = [(j, 0, i) for i, (first, end) in enumerate(zip(stretch.first_allocations, done, strict=True))
                  for j in range(first, end, bs)]
        caching = kv.enable_prefix_caching  # (publishing is a no-op otherwise)
        if caching:  # start + j + 1 fills a block (a joined row's are added below)
            events += [(j, 1, i) for i, (start, end) in enumerate(zip(starts if join < 0 else starts[:-1], done,
                                                                        strict=False))
                       for j in range((-start - 1) % bs, end, bs)]
        prefill = stretch.prefill
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
        if kv.step_blocks(rows, row_starts, widths, events, cap):
            return
        # One by one (a block it publishes may duplicate a cached block that it evicts).
        allocate, publish = kv.allocate_slots, kv.cache_computed_blocks
        chunks_row = -1 if prefill is None else row
        chunks_end = num_steps if join < 0 else join + 1
        for j, kind, i in events:
            if i == chunks_row and j < chunks_end:
                self._stretch_chunk(stretch, j, kind)
                continue
            req = rows[i]
            if kind:
                req.num_computed_tokens = starts[i] + j + 1
                publish(req)
            else:
                req.num_computed_tokens = starts[i] + j
                if allocate(req, 1) is None:
                    raise AssertionError(f"{req.request_id}: the stretch ran out of blocks")

    def _stretch_chunk(self, stretch: DecodeStretch, step: int, publish: int) -> None:
        """Step `step` of a stretch's prompt chunks: its blocks allocated (0), or those it filled published (1)."""
        req, chunk = stretch.prefill, stretch.chunk
        assert req is not None
        end = stretch.prefill_end  # (its last chunk, with a join, may be shorter)
        if publish:
            req.num_computed_tokens = min(stretch.prefill_start + chunk * (step + 1), end)
            self.kv.cache_computed_blocks(req)
        else:
            req.num_computed_tokens = stretch.prefill_start + chunk * step
            if self.kv.allocate_slots(req, min(chunk, end - req.num_computed_tokens)) is None:
                raise AssertionError(f"{req.request_id}: the stretch ran out of blocks")

    # ------------------------------------------------------------------ results
    def update(self, out: SchedulerOutput, model_output: ModelOutput, now: float) -> list[RequestDelta]:
        """Apply a step's results: advance progress, append sampled tokens, stop what is done.

        Walks the step in scheduling order. In batch mode, the plain decodes that go on are listed
        in `last_decoded` rather than returned as deltas."""
        deltas, self._pending_deltas = self._pending_deltas, []
        self.last_decoded = []
        sampled = model_output.sampled_token_ids
        decodes = out.decodes
        if not decodes.request_ids:
            for sr in out.scheduled:
                self._update_record(sr, model_output, now, deltas)
        else:
            done = 0
            for sr, before in zip(out.scheduled, out.decodes_before, strict=True):
                if before > done:
                    self._update_decodes(decodes, done, before, sampled, now, deltas)
                    done = before
                self._update_record(sr, model_output, now, deltas)
            self._update_decodes(decodes, done, len(decodes.request_ids), sampled, now, deltas)
        self._close_stats()
        return deltas

    def _update_record(self, sr: ScheduledRequest, model_output: ModelOutput, now: float,
                       deltas: list[RequestDelta]) -> None:
        """One scheduled record's result: its progress, and its sampled token if it samples."""
        rid = sr.request_id
        req = self.requests.get(rid)
        if req is None or req.status is not _RUNNING:
            return  # ended between schedule and update
        start, n = sr.start_pos, len(sr.token_ids)
        assert req.num_computed_tokens == start, f"{rid}: progress out of step"
        req.num_computed_tokens = start + n
        # Added before a possible finish below, which takes the request's (updated) tokens off.
        self._num_live_tokens += n
        # Blocks fill only where a step crosses a block boundary (every `block_size` decodes):
        # the KV manager has published every block full before this step, so skip the call otherwise.
        if start % self.kv.block_size + n >= self.kv.block_size:
            self.kv.cache_computed_blocks(req)
        prompt_tokens = 0 if n == 1 and start >= len(req.prompt_token_ids) else n  # decode: 0
        self._stats.num_prompt_tokens += prompt_tokens
        account = self.waiting.account if self.waiting.tracks_service else None  # a no-op call otherwise
        if not sr.sample:
            if account is not None:
                account(req, prompt_tokens, 0)
            return
        token = model_output.sampled_token_ids.get(rid)
        if token is None:
            self._finish(req, RequestStatus.FINISHED_ERROR, now, error="the executor returned no token")
            deltas.append(final_delta(req))
            return
        if account is not None:
            account(req, prompt_tokens, 1)
        self._stats.num_generation_tokens += 1
        logprobs = model_output.logprobs
        deltas.append(self._append_token(req, token, logprobs.get(rid) if logprobs else None, now))

    def _update_decodes(self, batch: DecodeBatch, lo: int, hi: int, sampled: dict[str, int], now: float,
                        deltas: list[RequestDelta]) -> None:
        """Rows lo..hi of a decode batch: one token each. What `_update_record` and `_append_token`
        do for a plain decode, written flat (a simulation runs this for nearly every token), with
        the ids of the requests that go on collected in `last_decoded` instead of a delta each."""
        requests, cache, block_size = self.requests, self.kv.cache_computed_blocks, self.kv.block_size
        account = self.waiting.account if self.waiting.tracks_service else None
        latencies = self._stats.token_latencies
        max_len = self.max_model_len
        went_on = self.last_decoded
        ids, starts = batch.request_ids, batch.start_pos
        num_computed = num_sampled = 0
        for i in range(lo, hi):
            rid = ids[i]
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # ended between schedule and update
            start = starts[i]
            assert req.num_computed_tokens == start, f"{rid}: progress out of step"
            req.num_computed_tokens = start + 1
            num_computed += 1
            if (start + 1) % block_size == 0:
                cache(req)
            token = sampled.get(rid)
            if token is None:
                self._finish(req, RequestStatus.FINISHED_ERROR, now, error="the executor returned no token")
                deltas.append(final_delta(req))
                continue
            if account is not None:
                account(req, 0, 1)
            num_sampled += 1
            last = req.last_token_time
            if last is None:  # not for a decode (it feeds a sampled token); kept exact all the same
                deltas.append(self._append_token(req, token, None, now))
                continue
            outputs = req.output_token_ids
            outputs.append(token)
            latencies.append((req.tenant, now - last))
            req.last_token_time = now
            sp = req.sampling_params
            # Context after this token: start + 2 (the token fed, then the one just sampled).
            if (len(outputs) < sp.max_tokens and start + 2 < max_len and token not in req.eos_token_ids
                    and token not in sp.stop_token_ids):
                went_on.append(rid)
                continue
            status, stop_reason = self._stop_status(req, token)
            if status is None:
                went_on.append(rid)
                continue
            self._finish(req, status, now, stop_reason=stop_reason)
            deltas.append(final_delta(req, (token,)))
        # Summed once: a request finished above took its updated tokens off, so the total is exact.
        self._num_live_tokens += num_computed
        self._stats.num_generation_tokens += num_sampled

    def fail_step(self, out: SchedulerOutput, error: str, now: float) -> list[RequestDelta]:
        """The executor raised: every request of the step ends with FINISHED_ERROR."""
        deltas, self._pending_deltas = self._pending_deltas, []
        for sr in out.rows():
            req = self.requests.get(sr.request_id)
            if req is not None and req.status is _RUNNING:
                self._finish(req, RequestStatus.FINISHED_ERROR, now, error=error)
                deltas.append(final_delta(req))
        self._close_stats()
        return deltas

    def _append_token(self, req: Request, token: int, logprobs: TokenLogprobs | None, now: float) -> RequestDelta:
        """Append a sampled token (the caller counts it); runs once per generated token."""
        outputs = req.output_token_ids
        outputs.append(token)
        last = req.last_token_time
        if last is None:  # the first token
            req.first_token_time = now
            self._stats.first_token_latencies.append((req.tenant, now - req.arrival_time))
        else:
            self._stats.token_latencies.append((req.tenant, now - last))
        req.last_token_time = now
        lps = (logprobs,) if logprobs is not None else ()
        sp = req.sampling_params
        num_out = len(outputs)
        # Most tokens end nothing: decide that with a few cheap tests before the full check.
        if (
            num_out < sp.max_tokens
            and len(req.prompt_token_ids) + num_out < self.max_model_len
            and token not in req.eos_token_ids
            and token not in sp.stop_token_ids
        ):
            return token_delta(req, token, lps)
        status, stop_reason = self._stop_status(req, token)
        if status is None:
            return token_delta(req, token, lps)
        self._finish(req, status, now, stop_reason=stop_reason)
        return final_delta(req, (token,), lps)

    def _stop_status(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    # ------------------------------------------------------------------ ending requests
    def abort(self, request_ids: list[str] | tuple[str, ...], now: float) -> list[RequestDelta]:
        """Abort waiting or running requests; unknown or finished ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, now)

    def finish_requests(
        self,
        request_ids: list[str] | tuple[str, ...],
        status: RequestStatus,
        now: float,
        *,
        stop_reason: str | int | None = None,
    ) -> list[RequestDelta]:
        """End requests for a reason found outside (a stop string, an abort). One final delta each."""
        if not status.is_finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        deltas = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, status, now, stop_reason=stop_reason)
                deltas.append(final_delta(req))
        return deltas

    def force_preempt(self, request_id: str) -> bool:
        """Preempt a running request now, as if the cache had run short (tests; freeing memory)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not _RUNNING:
            return False
        plan = _Plan(budget=0)
        self._preempt(req, plan)
        self._preempted_ids.extend(plan.preempted)
        return True

    def _expire_deadlines(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            req = self.requests.get(rid)
            if req is None or req.deadline != deadline:
                continue
            where = "running" if req.status is _RUNNING else "waiting"
            msg = f"deadline {deadline:.3f} passed at {now:.3f} while {where} ({req.num_output_tokens} tokens out)"
            self._finish(req, RequestStatus.FINISHED_DEADLINE, now, error=msg)
            self._pending_deltas.append(final_delta(req))

    def _finish(
        self, req: Request, status: RequestStatus, now: float, *, stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        """End a waiting or running request: free its blocks, record why and when."""
        assert status.is_finished and not req.is_finished
        if req.status is _RUNNING:
            self._leave_running(req)
        else:
            self.waiting.remove(req)
            self.kv.free(req)  # holds no blocks, but may hold a hash memo
        req.status = status
        req.finished_time = now
        req.stop_reason = stop_reason
        req.error = error
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        if status is not RequestStatus.FINISHED_EVICTED:  # a drop is no service: not a drain
            self.admission.drain.record(now)
        self._stats.finished.append(finished_stats(req))

    def _close_stats(self) -> None:
        self.last_iteration_stats = self._stats
        self._stats = IterationStats()

    def close_pending_stats(self, now: float) -> IterationStats | None:
        """Close what was counted since the last step as a record of its own (`last_iteration_stats`),
        or None if nothing was. Requests ended between steps (aborts, stop strings found in the
        text) and refusals go into the next step's stats; an engine with nothing left to run takes
        no next step, so its loop closes them here to report them."""
        st = self._stats
        if not (st.finished or st.rejections or st.num_preemptions):
            return None
        st.step, st.now = self._step, now
        self._close_stats()
        return self.last_iteration_stats

    # ------------------------------------------------------------------ state
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_live_tokens=self._num_live_tokens,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
        )

    def check_integrity(self) -> None:
        """KV refcounts match the running requests' tables; bookkeeping agrees with itself."""
        self.kv.check_integrity(self.running, published=True)
        assert all(r.status is _RUNNING for r in self.running)
        assert len(self.running) + len(self.waiting) == len(self.requests)
        assert sum(self._tenant_running.values()) == len(self.running)
        assert self._num_live_tokens == sum(r.num_computed_tokens for r in self.running)

