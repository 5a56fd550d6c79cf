"""A waiting request's predicted time to first token, from the scheduler's state and a step-cost model.

Asked for, never per step: `TTFTPredictor.predict` runs on the engine thread between two steps (the
one that answers `GET /v1/requests/{id}`) and plays the coming steps forward on a copy of what
matters, in the scheduler's own order of work:

1. each step, the running decodes take one token each from `max_num_batched_tokens`;
2. then the running requests still in prefill take their next chunk (`long_prefill_token_threshold`,
   the budget left);
3. then the waiting requests ranked ahead of this one, and this one, are admitted in the queue
   policy's order while a sequence slot, the budget, `max_num_partial_prefills` and the free KV
   blocks allow; each one's prefill is its prompt (and, after a preemption, its outputs) less the
   prefix-cache hits its blocks' hashes find now.

Each step is charged what the calibrated cost model says a step of that shape costs. A decode is
assumed to run to its `max_tokens` (or the context limit): the longest it can hold its slot and its
blocks; the slots and blocks it frees then let the queue move. Stretches of decode-only steps (the
queue waits for a slot or blocks) are costed in one vectorised pass.

What it does not model (said in docs/observability.md): requests that arrive later and are ranked
ahead (a higher priority, an earlier deadline), an EOS that ends a decode early (the prediction is
then pessimistic), preemptions to come, tenant caps, and fair share's order between tenants (taken
as round robin over the tenants' lines).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cadence.executor.cost_model import (
    BASES,
    KNEES,
    StepCostModel,
    StepFeatures,
    default_profile_path,
    machine_info,
)
from cadence.request import Request, RequestStatus
from cadence.sched.scheduler import Scheduler

MAX_ITERATIONS = 20_000  # turns of the forward play (a jump over decode-only steps is one turn)
MAX_STEPS = 5_000_000  # steps played forward at most; beyond, no prediction
_IDX = {b: i for i, b in enumerate(BASES)}


@dataclass(frozen=True)
class Prediction:
    """Seconds from now to the first token (`in_s`), and from arrival (`ttft_s`); or why there is none."""

    in_s: float | None = None
    ttft_s: float | None = None
    steps: int = 0
    unavailable: str | None = None


@dataclass
class _Prefill:
    request_id: str
    remaining: int  # tokens still to compute before the first (or next) token is sampled
    computed: int  # tokens already in the cache (its chunks' attention starts there)
    decode_steps: int  # decode steps it runs after its prefill, at most
    blocks: int = 0  # KV blocks it holds (running) or will hold once admitted


@dataclass
class _Decodes:
    """The running decodes, as aggregates: every step each adds one token of context."""

    count: int = 0
    context_sum: int = 0  # keys attended in the current step, summed over the rows
    ends: list[tuple[int, int, int, int]] = field(default_factory=list)  # (last step, seq, context offset, blocks)
    seq: int = 0

    def add(self, step: int, context: int, num_steps: int, blocks: int) -> None:
        """A decode whose first step is `step`, attending `context` keys then, for `num_steps` steps."""
        self.seq += 1
        self.count += 1
        self.context_sum += context
        heapq.heappush(self.ends, (step + num_steps - 1, self.seq, context - step, blocks))

    def max_context(self, step: int) -> int:
        return max((off for _, _, off, _ in self.ends), default=-step) + step

    def finish_through(self, step: int, block_size: int) -> int:
        """Retire the decodes whose last step is `step` or earlier; returns the blocks they free."""
        blocks = 0
        while self.ends and self.ends[0][0] <= step:
            _, _, off, held = heapq.heappop(self.ends)
            self.count -= 1
            context = off + step + 1  # its context had grown to that by the step after
            self.context_sum -= context
            blocks += max(held, -(-context // block_size))
        return blocks


class TTFTPredictor:
    def __init__(self, cost_model: StepCostModel, source: str) -> None:
        self.cost_model = cost_model
        self.source = source  # where the profile came from (a path)
        self._w = np.array(cost_model._w)

    # -- what the profile is -------------------------------------------------------------------------

    def describe(self, served_model: str) -> dict[str, Any]:
        """The profile for a client: its file, model and machine, and whether it was measured elsewhere."""
        meta = self.cost_model.metadata
        machine = meta.get("machine") or {}
        here = machine_info()
        elsewhere = any(machine.get(k) != here.get(k) for k in ("cpu", "cpu_count", "machine"))
        out: dict[str, Any] = {"path": self.source, "model": meta.get("model"), "device": meta.get("device"),
                               "machine": machine.get("cpu"), "calibrated_here": not elsewhere}
        notes = []
        if elsewhere:
            notes.append(f"calibrated on another machine ({machine.get('cpu')}, {machine.get('cpu_count')} CPUs; "
                         f"this one: {here.get('cpu')}, {here.get('cpu_count')} CPUs): predictions may be off")
        if meta.get("model") and meta.get("model") != served_model:
            notes.append(f"calibrated for {meta.get('model')}, serving {served_model}")
        if notes:
            out["note"] = "; ".join(notes)
        return out

    # -- the prediction ------------------------------------------------------------------------------

    def predict(self, sched: Scheduler, request: Request, now: float) -> Prediction:
        if request.first_token_time is not None:
            return Prediction(unavailable="its first token is out")
        if request.is_finished:
            return Prediction(unavailable="it has finished")
        if sched.is_static:
            return Prediction(unavailable="not predicted with --scheduler static")
        play = _Play(sched, self)
        try:
            in_s, steps = play.run(request)
        except _NoPrediction as e:
            return Prediction(unavailable=str(e))
        return Prediction(in_s, now - request.arrival_time + in_s, steps)

    def step_cost(self, f: StepFeatures) -> float:
        return self.cost_model.predict(f)

    def decode_run_cost(self, rows: int, context_sum: int, max_context: int, num_steps: int) -> float:
        """`num_steps` decode-only steps of `rows` rows, every row one key longer each step."""
        j = np.arange(num_steps, dtype=np.float64)
        base = np.zeros((num_steps, len(BASES)))
        base[:, _IDX["const"]] = 1.0
        base[:, _IDX["decode_seqs"]] = rows
        base[:, _IDX["sampled"]] = rows
        base[:, _IDX["decode_context"]] = context_sum + j * rows
        padded = rows * (max_context + j)
        base[:, _IDX["decode_padded"]] = padded
        for name, knee in KNEES.items():
            base[:, _IDX[name]] = np.maximum(0.0, padded - knee)
        return float(np.maximum(base @ self._w, self.cost_model.min_cost).sum())


class _NoPrediction(Exception):
    pass


class _Play:
    """The coming steps, played forward on aggregates (the scheduler itself is only read)."""

    def __init__(self, sched: Scheduler, predictor: TTFTPredictor) -> None:
        self.sched = sched
        self.cfg = sched.config
        self.kv = sched.kv
        self.bs = sched.kv.block_size
        self.predictor = predictor
        self.max_len = sched.max_model_len
        self.decodes = _Decodes()
        self.prefills: list[_Prefill] = []  # admitted, still in prefill (running order)
        self.free_blocks = float(sched.kv.num_free_blocks)
        self.step = 0

    def run(self, target: Request) -> tuple[float, int]:
        self._load_running(target)
        queue = self._queue(target)
        elapsed = 0.0
        for _ in range(MAX_ITERATIONS):
            if self.step > MAX_STEPS:
                break
            feats, admitted = self._plan(queue)
            if feats.prefill_tokens == 0 and not admitted:
                elapsed += self._jump(queue)
                continue
            elapsed += self.predictor.step_cost(feats)
            if self._advance(target.request_id):
                return elapsed, self.step + 1
            self.step += 1
        raise _NoPrediction(f"its first token is more than {MAX_STEPS:,} steps away, or the queue ahead too long to play forward")

    # -- the state now

    def _load_running(self, target: Request) -> None:
        for r in self.sched.running:
            held = len(self.kv.block_table(r.request_id))
            left = r.num_tokens - r.num_computed_tokens
            if left > 1 or r.request_id == target.request_id and r.first_token_time is None:
                self.prefills.append(_Prefill(r.request_id, left, r.num_computed_tokens, self._decode_steps(r), held))
            else:
                self.decodes.add(0, r.num_computed_tokens + 1, self._decode_steps(r), held)

    def _decode_steps(self, r: Request) -> int:
        """Decode steps left after its next token at most: to max_tokens, or the context's end."""
        out_left = r.sampling_params.max_tokens - r.num_output_tokens - 1
        ctx_left = self.max_len - r.num_tokens - 1
        return max(0, min(out_left, ctx_left))

    def _queue(self, target: Request) -> list[_Prefill]:
        """The waiting requests in the policy's order: those before `target`, `target`, and the few
        after it that may share its steps (at most max_num_seqs: no more can run beside it)."""
        behind = self.cfg.max_num_seqs
        seen = target.status is RequestStatus.RUNNING
        out: list[_Prefill] = []
        for r in _policy_order(self.sched):
            if seen:
                if behind == 0:
                    break
                behind -= 1
            _, cached = self.kv.get_computed_blocks(r)
            out.append(_Prefill(r.request_id, r.num_tokens - cached, cached, self._decode_steps(r),
                                cached // self.bs))
            seen = seen or r is target
        if not seen:
            raise _NoPrediction("it is not in the queue")
        return out

    # -- one step

    def _chunk(self, remaining: int, budget: int) -> int:
        cfg = self.cfg
        n = min(remaining, budget)
        if cfg.enable_chunked_prefill:
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
        elif n < remaining and remaining <= cfg.max_num_batched_tokens:
            return 0
        return n

    def _plan(self, queue: list[_Prefill]) -> tuple[StepFeatures, bool]:
        """This step's shape; sets each prefill's `n` (its chunk this step). Admits from `queue`."""
        budget = self.cfg.max_num_batched_tokens
        rows = min(self.decodes.count, budget)
        budget -= rows
        pt = ps = pa = sampled = 0
        self._chunks: list[tuple[_Prefill, int]] = []
        for p in self.prefills:
            n = self._chunk(p.remaining, budget) if budget > 0 else 0
            if n:
                budget -= n
                self._chunks.append((p, n))
        admitted = False
        seats = self.cfg.max_num_seqs - self.decodes.count - len(self.prefills)
        while queue and budget > 0 and seats > 0:
            head = queue[0]
            n = self._chunk(head.remaining, budget)
            planned = {id(p): k for p, k in self._chunks}
            partial = sum(1 for p in self.prefills if planned.get(id(p), 0) < p.remaining)
            if n == 0 or n < head.remaining and partial >= self.cfg.max_num_partial_prefills:
                break
            need = -(-(head.computed + n) // self.bs) - head.blocks
            if need > self.free_blocks:
                break
            self.free_blocks -= need
            head.blocks += need
            queue.pop(0)
            self.prefills.append(head)
            self._chunks.append((head, n))
            seats -= 1
            budget -= n
            admitted = True
        for p, n in self._chunks:
            pt += n
            ps += 1
            pa += n * p.computed + n * (n + 1) // 2
            sampled += n == p.remaining
        dmax = self.decodes.max_context(self.step) if rows else 0
        # No shared decode keys (decode_context_shared 0): the estimate tracks the decodes' context
        # lengths, not their block tables, so a shared prompt prefix is priced as keys read once.
        f = StepFeatures(pt, ps, rows, sampled + rows, self.decodes.context_sum if rows else 0, rows * dmax, pa)
        return f, admitted

    def _advance(self, target_id: str) -> bool:
        """Apply the planned step; True once the target's prefill completes (its first token)."""
        done: list[_Prefill] = []
        for p, n in self._chunks:
            grow = -(-(p.computed + n) // self.bs) - p.blocks
            if grow > 0:
                self.free_blocks -= grow
                p.blocks += grow
            p.computed += n
            p.remaining -= n
            if p.remaining == 0:
                if p.request_id == target_id:
                    return True
                done.append(p)
        self._retire_decodes(self.step)
        for p in done:
            self.prefills.remove(p)
            if p.decode_steps > 0:
                self.decodes.add(self.step + 1, p.computed + 1, p.decode_steps, p.blocks)
            else:
                self.free_blocks += p.blocks
        return False

    def _retire_decodes(self, step: int) -> None:
        d = self.decodes
        d.context_sum += d.count  # every row attends one key more next step
        self.free_blocks -= d.count / self.bs  # a decode takes a new block every block_size tokens
        self.free_blocks += d.finish_through(step, self.bs)

    def _jump(self, queue: list[_Prefill]) -> float:
        """Nothing but decodes can run: play them to the next one's end in one pass."""
        d = self.decodes
        if d.count == 0:
            if not self.prefills and queue:
                raise _NoPrediction("the requests ahead cannot be admitted (not enough KV blocks even when idle)")
            raise _NoPrediction("nothing runs and nothing can be admitted")
        last = d.ends[0][0]
        k = max(1, last - self.step + 1)
        rows = min(d.count, self.cfg.max_num_batched_tokens)
        cost = self.predictor.decode_run_cost(rows, d.context_sum, d.max_context(self.step), k)
        d.context_sum += d.count * (k - 1)
        self.free_blocks -= d.count * (k - 1) / self.bs
        self.step += k - 1
        self._retire_decodes(self.step)
        self.step += 1
        return cost


def _policy_order(sched: Scheduler) -> Iterable[Request]:
    """The waiting requests in the order the policy admits them. Fair share lists its queue tenant
    by tenant; its order between tenants follows service step by step: taken here as round robin."""
    waiting = sched.waiting
    if sched.config.policy != "fair":
        return iter(waiting)
    lines: dict[str, list[Request]] = {}
    for r in waiting:
        lines.setdefault(r.tenant, []).append(r)
    merged: list[Request] = []
    longest = max((len(v) for v in lines.values()), default=0)
    for i in range(longest):
        merged.extend(line[i] for line in lines.values() if i < len(line))
    return merged


NO_PROFILE = "none"  # --cost-profile none: no prediction


def load_cost_profile(path: str | None, num_threads: int | None = None) -> TTFTPredictor | None:
    """The predictor over the profile at `path` (None: the shipped one for `num_threads`, see
    `default_profile_path`; "none": no prediction). A missing or malformed file is a ValueError
    naming --cost-profile."""

    if path is not None and path.strip().lower() == NO_PROFILE:
        return None
    source = path or str(default_profile_path(num_threads))
    try:
        model = StepCostModel.load(source)
    except OSError as e:
        raise ValueError(f"--cost-profile {source}: cannot read it ({e.strerror or e})") from None
    except (ValueError, AttributeError) as e:
        raise ValueError(f"--cost-profile {source}: not a cadence cost profile ({e})") from None
    if not all(math.isfinite(w) for w in model._w):
        raise ValueError(f"--cost-profile {source}: the cost model's weights are not finite")
    return TTFTPredictor(model, source)


def attach_predictor(engine: Any, predictor: TTFTPredictor) -> None:
    """Give `predictor` to an `AsyncEngine` that runs in this process: it predicts a waiting
    request's TTFT, and adaptive speculative decoding prices its drafts with the same profile."""
    engine.predictor = predictor
    core = engine.core
    core.scheduler.step_cost = predictor.step_cost
    core.scheduler.step_cost_prices_shared = predictor.cost_model.prices_shared_context
