"""Speculative decoding's decisions (`Speculation`): which decoding requests verify drafts (n-gram
drafts, or a draft model's) this step, how many, and what a verification row's result is worth.

The `Scheduler` owns one when `speculative_config` is set, called at three points: while the
scheduler plans a decode (`drafts`, fixed k), once the whole step is planned (`adapt`, adaptive k:
the drafts then take only the budget the step left), and when a verification row's result comes
back (`accept`, from `StepResults`, results.py). Per speculating request it keeps the packed context the n-gram lookup searches
(ngram.py) and the measured acceptance (adaptive.py); the scheduler's state it needs (the step's
plan, how many requests run, the step cost, the step's stats) is passed in.

Drafts never preempt anyone: they take only spare KV blocks (`_allocate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cadence.boundary import DraftRequest, IterationStats, ModelOutput, ScheduledRequest
from cadence.config import SpeculativeConfig
from cadence.kv.manager import KVCacheManager
from cadence.request import Request, RequestStatus
from cadence.sched.adaptive import Acceptance, Candidate, DraftModelCost, StepCost, choose_ks
from cadence.sched.draft_proposals import DraftProposals
from cadence.sched.features import StepFeatures, scan_rows, shared_keys_by_row
from cadence.sched.ngram import PackedTokens
from cadence.sched.plan import StepPlan
from cadence.sched.records import verification_request

_RUNNING = RequestStatus.RUNNING


class Speculation:
    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, max_model_len: int) -> None:
        assert config.method == "draft_model" or None not in (config.prompt_lookup_min, config.prompt_lookup_max)
        self.config = config
        self.adaptive = config.adaptive
        self.kv = kv
        self.max_model_len = max_model_len
        self._lookup = (config.prompt_lookup_min or 0, config.prompt_lookup_max or 0)  # ngram only
        self._packed: dict[str, PackedTokens] = {}  # speculating requests' contexts, for the n-gram lookup
        self._acceptance: dict[str, Acceptance] = {}  # speculating requests' measured acceptance
        # method draft_model: the drafts the executor's draft model proposes, kept per request.
        self.draft_proposals = DraftProposals(config.num_speculative_tokens) \
            if config.method == "draft_model" else None
        # The draft model's layers over the served model's (set by the engine that loads it): adaptive
        # k prices drafting at that share of a decode step; 0 leaves drafting unpriced.
        self.draft_cost_ratio = 0.0
        # Adaptive k with a draft model: the requests this step's plan would verify drafts for, now
        # or (without drafts now) next step; only they are drafted for after it. A request the plan
        # did not weigh (its row ends its prompt) is weighed in its next step and drafted for after that.
        self._wanted: set[str] = set()

    def forget(self, request_id: str) -> None:
        """The request ended: drop what was kept for it."""
        self._packed.pop(request_id, None)
        self._acceptance.pop(request_id, None)
        self.drop_drafts(request_id)

    def drop_drafts(self, request_id: str) -> None:
        """The request left the running set (preempted or ended): drafts a draft model made for it
        are dropped, and its context is sent to the drafter again from the start should it need drafts."""
        if self.draft_proposals is not None:
            self.draft_proposals.drop(request_id)

    def draft_requests(self, rows: Iterable[ScheduledRequest], requests: Mapping[str, Request]) -> dict[str, DraftRequest]:
        """With a draft model: the requests of this step that want drafts after it (sched/draft_proposals.py);
        with adaptive k, only those this step's plan would verify drafts for."""
        wanted, self._wanted = self._wanted, set()
        if self.draft_proposals is None:
            return {}
        return self.draft_proposals.requests(rows, requests, wanted if self.adaptive else None)

    def store_drafts(self, model_output: ModelOutput, requests: Mapping[str, Request]) -> None:
        """Keep the drafts the executor's draft model proposed after this step, for running requests."""
        if self.draft_proposals is None:
            return
        for rid, drafts in model_output.draft_token_ids.items():
            req = requests.get(rid)
            if req is not None and req.status is _RUNNING:
                self.draft_proposals.store(req, drafts)

    # ------------------------------------------------------------------ planning
    def drafts(self, req: Request, budget: int, num_running: int) -> tuple[int, ...]:
        """Draft tokens for a decoding request this step (fixed k), their KV slots allocated; ()
        when it does not speculate (its sampling does not allow it, no n-gram match, no room)."""
        k = self._max_drafts(req, budget - 1)
        drafts = self._propose(req, k) if k else ()
        return drafts if drafts and self._allocate(req, len(drafts), num_running) else ()

    def adapt(self, plan: StepPlan, candidates: list[Request], step_cost: StepCost, num_running: int, *,
              prices_shared: bool = False) -> int:
        """Adaptive k: with the step planned, turn the candidates' decodes into verification rows
        where `step_cost` says their expected accepted tokens pay for the time they add
        (sched/adaptive.py); the drafts take only the budget the step left. `prices_shared`: the
        step cost prices decode keys re-read from shared blocks, so the planned tables are scanned
        for them (one pass). Returns how many candidates had drafts and verify none this step."""
        rows = plan.rows
        shared: dict[str, int] = {}
        if prices_shared:
            decodes = [r for r in rows.values() if len(r.token_ids) == 1]
            shared = dict(zip((r.request_id for r in decodes), shared_keys_by_row(
                ((r.start_pos + 1, r.block_table) for r in decodes), self.kv.block_size), strict=True))
        proposals: dict[str, tuple[Request, tuple[int, ...]]] = {}
        cands: list[Candidate] = []
        undrafted: list[Candidate] = []  # draft model: turned down last step, so without drafts now
        for req in candidates:
            rid = req.request_id
            row = rows.get(rid)
            # Preempted while the waiting requests were admitted (and perhaps admitted again, to
            # recompute): its row, if any, is no longer the decode it was planned as.
            if req.status is not _RUNNING or row is None or len(row.token_ids) != 1 \
                    or req.num_computed_tokens < len(req.prompt_token_ids):
                continue
            k = self._max_drafts(req, plan.budget)
            drafts = self._propose(req, k) if k else ()
            est = self._acceptance.get(rid)
            rate = est.rate if est is not None else Acceptance().rate
            if drafts:
                proposals[rid] = (req, drafts)
                cands.append(Candidate(rid, req.num_computed_tokens, len(drafts), rate, shared.get(rid, 0)))
            elif k and self.draft_proposals is not None:
                undrafted.append(Candidate(rid, req.num_computed_tokens, k, rate, shared.get(rid, 0)))
        block_size = self.kv.block_size if prices_shared else 0
        drafting = DraftModelCost(self.draft_cost_ratio, self.config.num_speculative_tokens) \
            if self.draft_proposals is not None and self.draft_cost_ratio > 0 else None
        declined = len(cands)
        if cands:
            ks = choose_ks(self._features(rows, shared), cands, step_cost, plan.budget, block_size, drafting)
            self._wanted.update(ks)
            for rid, k in ks.items():
                req, drafts = proposals[rid]
                if k > plan.budget or not self._allocate(req, k, num_running):
                    continue
                rows[rid] = verification_request(req, drafts[:k], self.kv.block_tables.get(rid, ()))
                plan.budget -= k
                declined -= 1
            self._turn_down(cands, ks)
        if undrafted:
            # Would they verify drafts in a step like this one? Then they are drafted for after it.
            wanted = choose_ks(self._features(rows, shared), undrafted, step_cost, plan.budget, block_size, drafting)
            self._wanted.update(wanted)
            self._turn_down(undrafted, wanted)
        return declined

    @staticmethod
    def _features(rows: Mapping[str, ScheduledRequest], shared: Mapping[str, int]) -> StepFeatures:
        pt, ps, ds, dc, dmax, pa, sm, _ = scan_rows(tuple(rows.values()), 0)
        return StepFeatures(pt, ps, ds, sm, dc, ds * dmax, pa, sum(shared.values()))

    def _turn_down(self, cands: list[Candidate], chosen: Mapping[str, int]) -> None:
        """The candidates adaptive k did not choose: their estimates idle towards the prior."""
        for c in cands:
            if c.request_id not in chosen:
                est = self._acceptance.get(c.request_id)
                if est is not None:
                    est.idle()

    def _max_drafts(self, req: Request, budget: int) -> int:
        """The most drafts `req` may verify this step with `budget` tokens for them: 0 when its
        sampling does not allow drafts, else no more than the budget, max_tokens or the context
        leave room to use."""
        sp = req.sampling_params
        num_out = len(req.output_token_ids)
        if not sp.speculable or num_out < sp.min_tokens:
            return 0
        return max(0, min(self.config.num_speculative_tokens, budget, sp.max_tokens - num_out - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _propose(self, req: Request, k: int) -> tuple[int, ...]:
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
        follow = packed.continuation(*self._lookup)
        return () if follow is None else tuple(req.token_ids_slice(follow, min(follow + k, num)))

    def _allocate(self, req: Request, k: int, num_running: int) -> bool:
        """KV slots for the fed token and k drafts. Drafts take only spare blocks: a failed
        allocation, or one that would leave fewer free blocks than running requests, drops them
        rather than preempting anyone for them."""
        kv, n = self.kv, 1 + k
        if req.num_computed_tokens + n > len(kv.block_tables.get(req.request_id, ())) * kv.block_size:
            spare = kv.num_free_blocks - kv.blocks_to_take(req, n)
            if spare < num_running or kv.allocate_slots(req, n) is None:
                return False
        return True

    # ------------------------------------------------------------------ results
    def accept(self, sr: ScheduledRequest, model_output: ModelOutput,
               stats: IterationStats) -> tuple[tuple[int, ...], str | None]:
        """A verification row's result: the tokens the executor kept (the accepted drafts, then the
        token after them), counted into the request's acceptance and the step's `stats`; or (), and
        why the result is unusable."""
        rid = sr.request_id
        tokens = model_output.verified_token_ids.get(rid)
        if tokens is None and rid in model_output.sampled_token_ids:
            tokens = (model_output.sampled_token_ids[rid],)  # an executor that does not verify: none accepted
        if not tokens:
            return (), "the executor returned no verified tokens"
        # The K/V written is that of the drafts: the tokens kept before the last must be drafts.
        if len(tokens) > sr.num_draft_tokens + 1 or tokens[:-1] != sr.draft_token_ids[: len(tokens) - 1]:
            return (), "the executor's verified tokens are not the drafts"
        num_accepted = len(tokens) - 1
        est = self._acceptance.get(rid)
        if est is None:
            est = self._acceptance[rid] = Acceptance()
        est.record(sr.num_draft_tokens, num_accepted)
        stats.num_drafts += 1
        stats.num_draft_tokens += sr.num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            if i == len(per_pos):
                per_pos.append(0)
            per_pos[i] += 1
        return tokens, None
