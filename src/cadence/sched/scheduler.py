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

What is not a decision lives in the base, `introspect.py` (why requests wait, snapshots, gauges).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence

from cadence.boundary import (
    IterationStats,
    ModelOutput,
    RequestDelta,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
    WaitReason,
)
from cadence.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from cadence.errors import AdmissionError
from cadence.kv.manager import KVCacheManager
from cadence.request import DECODE_LEG, Request, RequestStatus
from cadence.sched.adaptive import Acceptance, Candidate, StepCost, analytic_step_cost, choose_ks
from cadence.sched.admission import AdmissionControl, check_ids
from cadence.sched.draft_proposals import DraftProposals
from cadence.sched.features import StepFeatures, scan_rows
from cadence.sched.introspect import SchedulerIntrospection
from cadence.sched.ngram import PackedTokens
from cadence.sched.plan import StepPlan
from cadence.sched.preempt import make_preemption_policy
from cadence.sched.queue import make_queue
from cadence.sched.records import (
    final_delta,
    finished_stats,
    scheduled_request,
    token_delta,
    tokens_delta,
    verification_request,
)

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
        self.speculative: SpeculativeConfig | None = config.speculative_config
        self._packed: dict[str, PackedTokens] = {}  # speculating requests' contexts, for the n-gram lookup
        self._acceptance: dict[str, Acceptance] = {}  # speculating requests' measured acceptance
        # method draft_model: the drafts the executor's draft model proposes, kept per request.
        self.draft_proposals = DraftProposals(self.speculative.num_speculative_tokens) \
            if self.speculative is not None and self.speculative.method == "draft_model" else None
        # What a step of a given shape costs, for adaptive k (sched/adaptive.py); the engine sets it
        # from its calibrated profile where it has one.
        self.step_cost: StepCost = analytic_step_cost
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
        if candidates:
            self._adapt_drafts(plan, candidates)
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
        whole step is planned (`_adapt_drafts`)."""
        allocate, table = self.kv.allocate_slots, self.kv.block_tables.get
        block_size = self.kv.block_size
        rows = plan.rows
        spec = self.speculative
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
                drafts = () if adaptive else self._drafts(req, spec, plan.budget)
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

    def _drafts(self, req: Request, spec: SpeculativeConfig, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decoding request this step (fixed k), their KV slots allocated; ()
        when it does not speculate (its sampling does not allow it, no n-gram match, no room)."""
        k = self._max_drafts(req, spec, budget - 1)
        drafts = self._propose(req, k, spec) if k else ()
        return drafts if drafts and self._allocate_drafts(req, len(drafts)) else ()

    def _max_drafts(self, req: Request, spec: SpeculativeConfig, budget: int) -> int:
        """The most drafts `req` may verify this step with `budget` tokens for them: 0 when its
        sampling does not allow drafts, else no more than the budget, max_tokens or the context
        leave room to use."""
        sp = req.sampling_params
        num_out = len(req.output_token_ids)
        if not sp.speculable or num_out < sp.min_tokens:
            return 0
        return max(0, min(spec.num_speculative_tokens, budget, sp.max_tokens - num_out - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _allocate_drafts(self, req: Request, k: int) -> bool:
        """KV slots for the fed token and k drafts. Drafts take only spare blocks: a failed
        allocation, or one that would leave fewer free blocks than running requests, drops them
        rather than preempting anyone for them."""
        kv, n = self.kv, 1 + k
        if req.num_computed_tokens + n > len(kv.block_tables.get(req.request_id, ())) * kv.block_size:
            spare = kv.num_free_blocks - kv.blocks_to_take(req, n)
            if spare < len(self.running) or kv.allocate_slots(req, n) is None:
                return False
        return True

    def _adapt_drafts(self, plan: StepPlan, candidates: list[Request]) -> None:
        """Adaptive k: with the step planned, turn the candidates' decodes into verification rows
        where the step cost model says their expected accepted tokens pay for the time they add
        (sched/adaptive.py); the drafts take only the budget the step left."""
        spec = self.speculative
        assert spec is not None
        rows = plan.rows
        proposals: dict[str, tuple[int, ...]] = {}
        cands = []
        for req in candidates:
            rid = req.request_id
            row = rows.get(rid)
            # Preempted while the waiting requests were admitted (and perhaps admitted again, to
            # recompute): its row, if any, is no longer the decode it was planned as.
            if req.status is not _RUNNING or row is None or len(row.token_ids) != 1 \
                    or req.num_computed_tokens < len(req.prompt_token_ids):
                continue
            k = self._max_drafts(req, spec, plan.budget)
            drafts = self._propose(req, k, spec) if k else ()
            if drafts:
                proposals[rid] = drafts
                est = self._acceptance.get(rid)
                cands.append(Candidate(rid, req.num_computed_tokens, len(drafts),
                                       est.rate if est is not None else Acceptance().rate))
        if not cands:
            return
        pt, ps, ds, dc, dmax, pa, sm, _ = scan_rows(tuple(rows.values()), 0)
        base = StepFeatures(pt, ps, ds, sm, dc, ds * dmax, pa)
        ks = choose_ks(base, cands, self.step_cost, plan.budget)
        for rid, k in ks.items():
            req = self.requests[rid]
            if k > plan.budget or not self._allocate_drafts(req, k):
                continue
            rows[rid] = verification_request(req, proposals[rid][:k], self.kv.block_tables.get(rid, ()))
            plan.budget -= k
        for c in cands:
            if c.request_id not in ks:
                est = self._acceptance.get(c.request_id)
                if est is not None:
                    est.idle()

    def _propose(self, req: Request, k: int, spec: SpeculativeConfig) -> tuple[int, ...]:
        """Up to k n-gram drafts from the request's context, packed once and extended as it grows
        (or, with a draft model, those it proposed after the request's current context)."""
        if self.draft_proposals is not None:
            return self.draft_proposals.propose(req, k)
        rid, num = req.request_id, req.num_tokens
        packed = self._packed.get(rid)
        if packed is None:
            packed = self._packed[rid] = PackedTokens()
        if packed.num_tokens < num:
            packed.extend(req.token_ids_slice(packed.num_tokens, num))
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        follow = packed.continuation(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return () if follow is None else tuple(req.token_ids_slice(follow, min(follow + k, num)))

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
        if self.draft_proposals is not None:
            self.draft_proposals.drop(victim.request_id)
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
            draft_requests=self.draft_proposals.requests(plan.rows.values(), self.requests)
            if self.draft_proposals is not None and plan.rows else {},
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
        self._update_rows(out.scheduled, model_output, now, deltas)
        if self.draft_proposals is not None:
            for rid, drafts in model_output.draft_token_ids.items():
                req = self.requests.get(rid)
                if req is not None and req.status is _RUNNING:
                    self.draft_proposals.store(req, drafts)
        self._close_stats()
        return deltas

    def _update_record(self, sr: ScheduledRequest, model_output: ModelOutput, now: float,
                       deltas: list[RequestDelta]) -> None:
        """One scheduled record's result: its progress, and its sampled token if it samples."""
        rid = sr.request_id
        req = self.requests.get(rid)
        if req is None or req.status is not _RUNNING:
            return  # ended between schedule and update
        if sr.num_draft_tokens:
            self._update_verified(req, sr, model_output, now, deltas)
            return
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
        if req.handoff is None or req.handoff.leg != DECODE_LEG:  # (a decode leg's prompt was counted by its prefill)
            self._stats.num_prompt_tokens += prompt_tokens
        account = self.waiting.account if self.waiting.tracks_service else None  # a no-op call otherwise
        if not sr.sample:
            if account is not None:
                account(req, prompt_tokens, 0)
            return
        token = model_output.sampled_token_ids.get(rid)
        if token is None:
            self.finish(req, RequestStatus.FINISHED_ERROR, now, error="the executor returned no token")
            deltas.append(final_delta(req))
            return
        if account is not None:
            account(req, prompt_tokens, 1)
        self._stats.num_generation_tokens += 1
        logprobs = model_output.logprobs
        deltas.append(self._append_token(req, token, logprobs.get(rid) if logprobs else None, now))

    def _update_verified(self, req: Request, sr: ScheduledRequest, model_output: ModelOutput, now: float,
                         deltas: list[RequestDelta]) -> None:
        """A verification row's result: the accepted drafts and the token after them join the
        outputs, one at a time, until one ends the request (the rest are dropped); the KV of the
        fed token and of the accepted drafts is kept, the rejected drafts' slots are given back."""
        rid, start = req.request_id, sr.start_pos
        assert req.num_computed_tokens == start, f"{rid}: progress out of step"
        tokens = model_output.verified_token_ids.get(rid)
        if tokens is None and rid in model_output.sampled_token_ids:
            tokens = (model_output.sampled_token_ids[rid],)  # an executor that does not verify: none accepted
        # The K/V written is that of the drafts: the tokens kept before the last must be drafts.
        error = "the executor returned no verified tokens" if not tokens else \
            "the executor's verified tokens are not the drafts" \
            if len(tokens) > sr.num_draft_tokens + 1 or tokens[:-1] != sr.draft_token_ids[: len(tokens) - 1] else None
        if error is not None or not tokens:
            self.finish(req, RequestStatus.FINISHED_ERROR, now, error=error)
            deltas.append(final_delta(req))
            return
        est = self._acceptance.get(rid)
        if est is None:
            est = self._acceptance[rid] = Acceptance()
        est.record(sr.num_draft_tokens, len(tokens) - 1)
        stats = self._stats
        stats.num_drafts += 1
        stats.num_draft_tokens += sr.num_draft_tokens
        stats.num_accepted_tokens += len(tokens) - 1
        per_pos = stats.num_accepted_tokens_per_pos
        for i in range(len(tokens) - 1):
            if i == len(per_pos):
                per_pos.append(0)
            per_pos[i] += 1
        outputs, sp = req.output_token_ids, req.sampling_params
        status, stop_reason, taken = None, None, 0
        for token in tokens:
            outputs.append(token)
            taken += 1
            if not (len(outputs) < sp.max_tokens and req.num_tokens < self.max_model_len
                    and token not in req.eos_token_ids and token not in sp.stop_token_ids):
                status, stop_reason = self.stop_status(req, token)
                if status is not None:
                    break
        # Positions start .. start + taken - 1 hold the fed token and the drafts now confirmed.
        req.num_computed_tokens = start + taken
        self._num_live_tokens += taken
        self.kv.release_tail(req)
        self.kv.cache_computed_blocks(req)
        if self.waiting.tracks_service:
            self.waiting.account(req, 0, taken)
        stats.num_generation_tokens += taken
        if req.last_token_time is not None:  # one latency per step, as for a plain decode step
            stats.token_latencies.append((req.tenant, now - req.last_token_time))
        req.last_token_time = now
        new = tuple(outputs[len(outputs) - taken :])
        if status is None:
            deltas.append(tokens_delta(req, new))
            return
        self.finish(req, status, now, stop_reason=stop_reason)
        deltas.append(final_delta(req, new))

    def _update_rows(self, rows: tuple[ScheduledRequest, ...], model_output: ModelOutput, now: float,
                     deltas: list[RequestDelta]) -> None:
        """`_update_record` for each row, but for a plain decode (one token, sampled, past the
        prompt, of a request with plain sampling) what it and `_append_token` do written flat (it
        runs for nearly every token); with `decode_ids`, the ids of the plain decodes that go on
        are collected in `last_decoded` instead of a delta each."""
        requests, cache, block_size = self.requests, self.kv.cache_computed_blocks, self.kv.block_size
        account = self.waiting.account if self.waiting.tracks_service else None
        latencies = self._stats.token_latencies
        max_len = self.max_model_len
        went_on = self.last_decoded if self._decode_ids else None
        sampled = model_output.sampled_token_ids
        update_record = self._update_record
        num_computed = num_sampled = 0
        for sr in rows:
            rid = sr.request_id
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # ended between schedule and update
            start = sr.start_pos
            if len(sr.token_ids) != 1 or not sr.sample or start < len(req.prompt_token_ids) \
                    or not sr.sampling_params.plain_decode:
                update_record(sr, model_output, now, deltas)
                continue
            assert req.num_computed_tokens == start, f"{rid}: progress out of step"
            req.num_computed_tokens = start + 1
            num_computed += 1
            if (start + 1) % block_size == 0:
                cache(req)
            token = sampled.get(rid)
            if token is None:
                self.finish(req, RequestStatus.FINISHED_ERROR, now, error="the executor returned no token")
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
            status, stop_reason = None, None
            if not (len(outputs) < sp.max_tokens and start + 2 < max_len and token not in req.eos_token_ids
                    and token not in sp.stop_token_ids):  # (most tokens end nothing: decided cheaply)
                status, stop_reason = self.stop_status(req, token)
            if status is None:
                if went_on is not None:
                    went_on.append(rid)
                else:
                    deltas.append(token_delta(req, token, ()))
                continue
            self.finish(req, status, now, stop_reason=stop_reason)
            deltas.append(final_delta(req, (token,)))
        # Summed once: a request finished above took its updated tokens off, so the total is exact.
        self._num_live_tokens += num_computed
        self._stats.num_generation_tokens += num_sampled

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

    def _append_token(self, req: Request, token: int, logprobs: TokenLogprobs | None, now: float) -> RequestDelta:
        """Append a sampled token (the caller counts it); runs once per generated token."""
        outputs = req.output_token_ids
        outputs.append(token)
        last = req.last_token_time
        if last is None:  # the first token
            req.first_token_time = now
            self._stats.first_token_latencies.append((req.tenant, now - req.arrival_time))
        else:
            if req.first_token_time is None:  # a decode leg's first token here: the request's next one
                req.first_token_time = now
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
        status, stop_reason = self.stop_status(req, token)
        if status is None:
            return token_delta(req, token, lps)
        self.finish(req, status, now, stop_reason=stop_reason)
        return final_delta(req, (token,), lps)

    def stop_status(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
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
        self._packed.pop(req.request_id, None)
        self._acceptance.pop(req.request_id, None)
        if self.draft_proposals is not None:
            self.draft_proposals.drop(req.request_id)
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
