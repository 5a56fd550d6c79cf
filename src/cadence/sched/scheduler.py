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

With `decode_ids` (for a caller that needs no delta per token: the simulator), the plain decodes
that go on come back from `update` as ids in `last_decoded` instead of a `RequestDelta` each.
Every decision is the same either way: `update` walks the step in scheduling order (the order
requests finish in is the order their blocks return to the pool).

Two parts the scheduler owns and calls: `StepResults` (results.py) applies a step's results to
its requests and decides when one stops; `Speculation` (speculation.py), with
`speculative_config`, decides which decodes verify drafts and how many. What is not a decision
lives in the base, `introspect.py` (why requests wait, snapshots, gauges).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Sequence

from cadence.boundary import IterationStats, ModelOutput, RequestDelta, SchedulerOutput, WaitReason
from cadence.config import CacheConfig, SchedulerConfig
from cadence.errors import AdmissionError
from cadence.kv.manager import KVCacheManager
from cadence.request import Request, RequestStatus
from cadence.sched.adaptive import StepCost, analytic_step_cost
from cadence.sched.admission import AdmissionControl, check_ids
from cadence.sched.introspect import SchedulerIntrospection
from cadence.sched.plan import StepPlan
from cadence.sched.preempt import make_preemption_policy
from cadence.sched.queue import make_queue
from cadence.sched.records import final_delta, finished_stats, scheduled_request, verification_request
from cadence.sched.results import StepResults
from cadence.sched.speculation import Speculation

_RUNNING = RequestStatus.RUNNING


class Scheduler(SchedulerIntrospection):
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, kv: KVCacheManager, max_model_len: int, *,
                 decode_ids: bool = False) -> None:
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
        self.is_static = config.scheduler == "static"
        spec = config.speculative_config
        self.speculation = Speculation(spec, kv, max_model_len) if spec is not None else None
        # What a step of a given shape costs, for adaptive k (sched/adaptive.py); the engine sets it
        # from its calibrated profile where it has one.
        self.step_cost: StepCost = analytic_step_cost
        # Whether `step_cost` prices decode keys re-read from shared blocks: only then are the
        # planned step's tables scanned for them (sched/features.py).
        self.step_cost_prices_shared = False
        self._decode_ids = decode_ids
        # With `decode_ids`: requests whose plain decode gave one token in the last `update` and
        # went on. They get no RequestDelta; each one's new token is its last output token.
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
        self._wait_stop = None  # why the latest step admitted no further (introspect.py)
        # Counts what changes the state between steps (requests added or ended from outside).
        self.revision = 0
        # Told of each preemption before it happens (request, tokens it loses, reason); None: nobody.
        self.on_preempt: Callable[[Request, int, str], None] | None = None
        # Told of a request that ends while it waits (aborted, expired, evicted), with the latest step.
        self.on_end_waiting: Callable[[Request, int], None] | None = None
        self.results = StepResults(self.requests, kv, self.waiting, max_model_len, self.speculation, self.finish)

    # ------------------------------------------------------------------ admission
    def add_request(self, request: Request, now: float, *, evict: bool = True) -> None:
        """Queue a request, or raise AdmissionError (too long, queue full, deadline passed)."""
        self.add_requests((request,), now, evict=evict)

    def add_requests(self, group: Sequence[Request], now: float, *, evict: bool = True) -> None:
        """Queue one client request's engine requests (its choices; one tenant) all or nothing, or
        raise AdmissionError. Admission may first drop queued requests to make room (the queue's
        policy decides; never with `evict` False): each ends FINISHED_EVICTED with its refusal in
        `error` and `retry_after`, its final delta out with the next `update`."""
        self.revision += 1
        try:
            check_ids(group, self.requests)
            evictions = self.admission.check(group, self.waiting, now, evict=evict)
        except AdmissionError as e:
            self._stats.rejections[e.kind.value] = self._stats.rejections.get(e.kind.value, 0) + 1
            raise
        for ev in evictions:
            victim = ev.request
            victim.retry_after = ev.error.retry_after
            self.finish(victim, RequestStatus.FINISHED_EVICTED, now, error=ev.error.message)
            self._pending_deltas.append(final_delta(victim))
        for request in group:
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if self._salt_with_tenant and request.cache_salt is None:
            request.cache_salt = request.tenant
        request.status = RequestStatus.WAITING
        request.queued_step = self._step + 1
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
        may_admit = not self.is_static or not self.running
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        candidates: list[Request] = []
        self._schedule_running(plan, candidates)
        stop: tuple[WaitReason, str | None] | None = (
            self._schedule_waiting(plan) if may_admit else (WaitReason.STATIC_BATCH, None)
        )
        if self.speculation is not None:
            declined = 0
            if candidates:
                declined = self.speculation.adapt(plan, candidates, self.step_cost, len(self.running),
                                                  prices_shared=self.step_cost_prices_shared)
            self._count_chosen_drafts(plan, declined)
        self._record_stop(stop)
        prefix = self.kv.pop_prefix_stats()
        self._stats.prefix_cache_queries += prefix.queries
        self._stats.prefix_cache_hits += prefix.hits
        return self._build_output(plan)

    def chunk(self, req: Request, num_computed: int, budget: int) -> int:
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

    def _schedule_running(self, plan: StepPlan, candidates: list[Request]) -> None:
        """Running requests' rows. With adaptive speculation, the decodes that could verify drafts
        are planned as plain decodes and listed in `candidates`: their drafts are chosen once the
        whole step is planned (`Speculation.adapt`)."""
        allocate, table = self.kv.allocate_slots, self.kv.block_tables.get
        block_size = self.kv.block_size
        rows = plan.rows
        spec = self.speculation
        adaptive = spec is not None and spec.adaptive
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
            n = 1 if remaining == 1 else self.chunk(req, start, plan.budget)
            if n == 0:
                continue
            if spec is not None and remaining == 1 and start >= num_prompt:
                if adaptive:
                    candidates.append(req)
                drafts = () if adaptive else spec.drafts(req, plan.budget, len(self.running))
                if drafts:
                    rows[rid] = verification_request(req, drafts, table(rid, ()))
                    plan.budget -= 1 + len(drafts)  # a verification row counts as decode tokens
                    continue
            ids = table(rid, ())
            # Most steps the tokens fit in the blocks the request holds (a decode needs a new block
            # every `block_size` steps): then allocate_slots would return at once, so skip the call.
            if start + n > len(ids) * block_size:
                while allocate(req, n) is None:
                    victim = self.preemption.choose_victim(self.running)
                    self._preempt(victim, plan, "kv_blocks")
                    if victim is req:
                        break
                else:
                    ids = table(rid, ())
                if req.status is not _RUNNING:
                    continue  # it was its own victim
            # StepPlan.add, inlined: this is the per-decode, per-step path.
            rows[rid] = scheduled_request(req, n, ids)
            if n != 1 or start < num_prompt:
                plan.num_prefill += n
            plan.budget -= n

    def eligible(self) -> Callable[[Request], bool] | None:
        """Which waiting requests may be admitted now (None: all): the per-tenant running cap."""
        cap = self.config.tenant_max_running
        return (lambda r: self._tenant_running[r.tenant] < cap) if cap is not None else None

    def _schedule_waiting(self, plan: StepPlan) -> tuple[WaitReason, str | None] | None:
        """Admit waiting requests in the policy's order while they fit; returns why it stopped
        (and the request it stopped at, if one), or None once nothing waits."""
        eligible = self.eligible()
        while self.waiting:
            if plan.budget <= 0 and not self.is_static:
                return WaitReason.TOKEN_BUDGET, None
            req = self.waiting.peek(eligible)
            if req is None:
                return WaitReason.TENANT_QUOTA, None  # every request left is of a capped tenant
            seat_victim = None
            if len(self.running) >= self.config.max_num_seqs:
                seat_victim = self.preemption.victim_for(req, self.running)
                if seat_victim is None:
                    return WaitReason.MAX_NUM_SEQS, req.request_id
            computed, num_cached = self.kv.get_computed_blocks(req)
            n = self._admission_chunk(req, num_cached, plan)
            if n == 0 and not self.is_static:
                partial = plan.budget > 0 and self.chunk(req, num_cached, plan.budget) > 0
                return WaitReason.PARTIAL_PREFILL_CAP if partial else WaitReason.TOKEN_BUDGET, req.request_id
            if seat_victim is not None:
                self._preempt(seat_victim, plan, "max_num_seqs")
            # Static batches reserve the whole prompt now, so members never wait for blocks mid-prefill.
            reserve = req.num_tokens - num_cached if self.is_static else n
            while self.kv.allocate_slots(req, reserve, computed) is None:
                victim = self.preemption.victim_for(req, self.running)
                if victim is None:
                    return WaitReason.KV_BLOCKS, req.request_id
                self._preempt(victim, plan, "kv_blocks")
            self._admit(req, num_cached, n, plan)
        return None

    def _admission_chunk(self, req: Request, num_cached: int, plan: StepPlan) -> int:
        n = self.chunk(req, num_cached, plan.budget) if plan.budget > 0 else 0
        if 0 < n < req.num_tokens - num_cached and self._num_partial(plan) >= self.config.max_num_partial_prefills:
            return 0  # would start one more partial prefill than allowed
        return n

    def _num_partial(self, plan: StepPlan) -> int:
        """Running requests that will still be mid-prefill after this step."""
        planned = plan.num_tokens
        return sum(1 for r in self.running if r.num_computed_tokens + planned(r.request_id) < r.num_tokens)

    def _admit(self, req: Request, num_cached: int, n: int, plan: StepPlan) -> None:
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

    def _preempt(self, victim: Request, plan: StepPlan, reason: str) -> None:
        """Recompute preemption: free the blocks, forget progress, back to the queue's head.
        `reason`: kv_blocks (its blocks were needed), max_num_seqs (its seat was), or forced."""
        if self.on_preempt is not None:
            self.on_preempt(victim, victim.num_computed_tokens, reason)
        self._leave_running(victim, keep_hashes=True)
        if self.speculation is not None:
            self.speculation.drop_drafts(victim.request_id)
        plan.undo(victim)  # before its progress is reset: the undo reads where its chunk started
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.queued_step = self._step  # the admission of this very step may take it back
        plan.preempted.append(victim.request_id)
        self._stats.num_preemptions += 1
        self.waiting.push_front(victim)

    def _leave_running(self, req: Request, *, keep_hashes: bool = False) -> None:
        self.running.remove(req)  # (by identity: a Request equals only itself)
        self._num_live_tokens -= req.num_computed_tokens
        self._tenant_running[req.tenant] -= 1
        if not self._tenant_running[req.tenant]:
            del self._tenant_running[req.tenant]
        self.kv.free(req, keep_hashes=keep_hashes)

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        num_prefill = plan.num_prefill
        self._preempted_ids.extend(plan.preempted)
        num_tokens = self.config.max_num_batched_tokens - plan.budget
        out = SchedulerOutput(
            step=self._step,
            scheduled=tuple(plan.rows.values()),
            preempted_ids=tuple(self._preempted_ids),
            finished_ids=tuple(self._finished_ids),
            num_batched_tokens=num_tokens,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_tokens - num_prefill,
            draft_requests=self.speculation.draft_requests(plan.rows.values(), self.requests)
            if self.speculation is not None and plan.rows else {},
        )
        if plan.rows:  # an empty output is never executed: keep the ids for the next one
            self._preempted_ids.clear()
            self._finished_ids.clear()
        return out

    # ------------------------------------------------------------------ results
    def update(self, out: SchedulerOutput, model_output: ModelOutput, now: float) -> list[RequestDelta]:
        """Apply a step's results: advance progress, append sampled tokens, stop what is done.

        Walks the step in scheduling order. With `decode_ids`, the plain decodes that go on are
        listed in `last_decoded` rather than returned as deltas."""
        deltas, self._pending_deltas = self._pending_deltas, []
        self.last_decoded = []
        went_on = self.last_decoded if self._decode_ids else None
        # Added after the call: a request ended in it already took its updated tokens off the total.
        computed = self.results.apply(out.scheduled, model_output, now, self._stats, deltas, went_on)
        self._num_live_tokens += computed
        if self.speculation is not None:
            self.speculation.store_drafts(model_output, self.requests)
        self._close_stats()
        return deltas

    def fail_step(self, out: SchedulerOutput, error: str, now: float) -> list[RequestDelta]:
        """The executor raised: every request of the step ends with FINISHED_ERROR."""
        deltas, self._pending_deltas = self._pending_deltas, []
        for sr in out.scheduled:
            req = self.requests.get(sr.request_id)
            if req is not None and req.status is _RUNNING:
                self.finish(req, RequestStatus.FINISHED_ERROR, now, error=error)
                deltas.append(final_delta(req))
        self._close_stats()
        return deltas

    def stop_status(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """Whether `req` stops with `token`, just appended (`StepResults.stop_status`)."""
        return self.results.stop_status(req, token)

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
        self.revision += 1
        deltas = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, status, now, stop_reason=stop_reason)
                deltas.append(final_delta(req))
        return deltas

    def force_preempt(self, request_id: str) -> bool:
        """Preempt a running request now, as if the cache had run short (tests; freeing memory)."""
        req = self.requests.get(request_id)
        if req is None or req.status is not _RUNNING:
            return False
        self.revision += 1
        plan = StepPlan(budget=0)
        self._preempt(req, plan, "forced")
        req.queued_step = self._step + 1  # between steps: the next one is the first to see it
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
            self.finish(req, RequestStatus.FINISHED_DEADLINE, now, error=msg)
            self._pending_deltas.append(final_delta(req))

    def finish(
        self, req: Request, status: RequestStatus, now: float, *, stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        """End a waiting or running request: free its blocks, record why and when (its final delta
        is the caller's to build)."""
        assert status.is_finished and not req.is_finished
        if req.status is _RUNNING:
            self._leave_running(req)
        else:
            self.waiting.remove(req)
            self.kv.free(req)  # holds no blocks, but may hold a hash memo
            if self.on_end_waiting is not None:
                self.on_end_waiting(req, self._step)
        if self.speculation is not None:
            self.speculation.forget(req.request_id)
        req.status = status
        req.finished_time = now
        req.stop_reason = stop_reason
        req.error = error
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        if status is not RequestStatus.FINISHED_EVICTED:  # a drop is no service: not a drain
            self.admission.drain.record(now)
        self._stats.finished.append(finished_stats(req))

    def _count_chosen_drafts(self, plan: StepPlan, declined: int) -> None:
        """Into the step's stats, one entry per decode row that had drafts: the drafts each of the
        plan's verification rows carries, and a 0 for each of the `declined` adaptive k turned down."""
        chosen = self._stats.chosen_draft_tokens
        chosen.extend(itertools.repeat(0, declined))
        chosen.extend(sr.num_draft_tokens for sr in plan.rows.values() if sr.num_draft_tokens)

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
        self.revision += 1
        st.step, st.now = self._step, now
        self._close_stats()
        return self.last_iteration_stats

    def steps_ran_outside(self, num_steps: int, last_start: float, *, num_computed: int, num_prompt_tokens: int,
                          num_sampled: int, first_token_latencies: Sequence[tuple[str, float]] = (),
                          went_on: list[str], finished_ids: Sequence[str] = ()) -> None:
        """`num_steps` steps ran without `schedule` and `update`, the last starting at `last_start`:
        a driver that knew them ahead changed the requests, the KV manager and the queue as they
        would have, and called `finish` for the requests they ended. This moves the scheduler's
        own counters on as those steps would have (`num_computed` tokens computed, of them
        `num_prompt_tokens` prompt tokens, `num_sampled` tokens generated), closes their stats as
        one record, lists `went_on` as `last_decoded` and `finished_ids` (those ended in the last
        step) as not yet reported; the ids pending before them went out with the first one.

        Its one caller is the simulator's fast-forward (sim/fast_forward.py); it stays here
        because the counters it moves are private to the scheduler, which keeps them in step
        with its requests (`check_integrity`)."""
        self._num_live_tokens += num_computed
        self._step += num_steps
        self._now = last_start
        self._finished_ids[:] = finished_ids
        self._preempted_ids.clear()
        self.last_decoded = went_on
        stats = self._stats
        stats.step, stats.now = self._step, self._now
        stats.num_prompt_tokens += num_prompt_tokens
        stats.num_generation_tokens += num_sampled
        stats.first_token_latencies += first_token_latencies
        self._close_stats()
