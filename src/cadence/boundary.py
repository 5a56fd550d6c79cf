"""The records that cross the boundaries around the scheduler, imported by both sides.

The scheduler and the engine core fill them; the executor, the model, the stream, the server and
the exporters read them. None of them is the mutable `Request`:

- one step's plan and its results: `SchedulerOutput` (its rows as `ScheduledRequest` records)
  and `ModelOutput` (with `TokenLogprobs`);
- a request's progress, for its stream: `RequestDelta`, with `RequestMetrics` on the last one;
- plain data for exporters (Prometheus, the benchmark, the simulator's report): `SchedulerStats`
  (gauges after a step), `IterationStats` (what a step did) and `FinishedRequestStats`;
- why a request waits (`WaitReason`, `WaitStop`, `WaitInfo`) and one request's state as a client
  may see it (`RequestSnapshot`).

Standard library only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cadence.request import FinishReason, SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """What the executor needs to advance one request by one step.

    `token_ids` are fed at positions `start_pos .. start_pos + len(token_ids) - 1` (a prefill
    chunk, or the one last-sampled token when decoding); their K/V are written to the slots that
    `block_table` maps those positions to. `sample` is true when this chunk reaches the end of the
    request's known tokens, so the logits of its last position pick the next token.

    A verification row (speculative decoding) feeds the last sampled token followed by
    `num_draft_tokens` proposed tokens (the last ones of `token_ids`); it samples at every one of
    its positions, and the executor answers it in `ModelOutput.verified_token_ids`.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int = 0  # outputs so far: the step index of seeded sampling, and min_tokens
    history: tuple[int, ...] | None = None  # prompt + outputs, only when penalties need them
    eos_token_ids: frozenset[int] = frozenset()
    num_draft_tokens: int = 0  # proposed tokens at the end of `token_ids`, to verify

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        k = self.num_draft_tokens
        return self.token_ids[len(self.token_ids) - k :] if k else ()

    @property
    def end_pos(self) -> int:
        """Context length after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class GrammarMask:
    """The tokens a step's constrained rows may sample: `bitmask` row i (an int32 tensor [R,
    ceil(V / 32)], bit j of word w allowing token 32 * w + j) is for `request_ids[i]`. Only rows
    that sample under a grammar are in it; the others are not masked at all."""

    request_ids: tuple[str, ...]
    bitmask: Any


@dataclass(frozen=True)
class DraftRequest:
    """A request whose next drafts an executor-side proposer (a draft model) should make in
    this step: up to `k` tokens, predicted after the request's context followed by what this
    step samples for it. The context reaches the proposer in pieces: `new_tokens` are its tokens
    from index `offset` on (all of them when `offset` is 0), those before were sent earlier."""

    k: int
    offset: int
    new_tokens: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: `scheduled` holds every scheduled request, in scheduling order."""

    step: int
    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()  # ended since the previous step; executors may drop their state
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    grammar: GrammarMask | None = None  # set by the engine core when constrained rows sample
    # Speculative decoding with a draft model: who wants drafts for the next step (by request id).
    draft_requests: dict[str, DraftRequest] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled(self) -> int:
        return len(self.scheduled)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-N alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ModelOutput:
    """The executor's answer: one sampled token per request that had `sample=True`; for a
    verification row, in `verified_token_ids`, the drafts it accepted followed by the token the
    model picks after them (so 1 to k + 1 tokens). For each of the step's `draft_requests`, in
    `draft_token_ids`, the drafts proposed for its next step (possibly fewer than asked)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    verified_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    draft_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestMetrics:
    """Timings of one request on the engine clock (seconds): a monotonic clock for a real engine,
    virtual time in the simulator. Differences (`ttft`, `queue_time`, ...) are what they mean on
    either; `unix_offset`, where the caller knows it (the offline `LLM` sets it), turns a reading
    into Unix time, which is what vLLM's `arrival_time` holds (`arrival_unix_time`)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    unix_offset: float | None = None  # Unix time minus the engine clock

    def unix_time(self, t: float | None) -> float | None:
        """An engine-clock reading of these metrics as Unix time (None where the offset is unknown)."""
        return None if t is None or self.unix_offset is None else t + self.unix_offset

    @property
    def arrival_unix_time(self) -> float | None:
        return self.unix_time(self.arrival_time)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(frozen=True)
class RequestDelta:
    """What one step did to one request, for its stream: new tokens and, at the end, why it ended."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # set on the last delta
    error: str | None = None
    error_by_request: bool = False  # the error is the request's own (its constraint past the grammar library's limits)
    retry_after: float | None = None  # seconds, on the last delta of a request ended refused (evicted)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ---------------------------------------------------------------- stats, for exporters
@dataclass(frozen=True)
class SchedulerStats:
    """Gauges: the state after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use by running requests
    num_live_tokens: int = 0  # tokens whose KV is held by running requests
    num_free_blocks: int = 0
    num_total_blocks: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    request_id: str
    tenant: str
    priority: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    # The prefill leg of a request handed to another engine at its first token: the request goes
    # on there, which counts it as finished (request-level series skip this record).
    handed_off: bool = False
    max_tokens: int | None = None  # its max_tokens parameter (the whole request's, for a decode leg)


@dataclass
class IterationStats:
    """Counters: what one step did."""

    step: int = 0
    now: float = 0.0
    step_time: float = 0.0  # seconds spent in execute()
    num_prompt_tokens: int = 0  # prefill tokens computed this step
    first_token_prompt_tokens: int = 0  # prompt tokens of the requests that sampled their first token this step
    num_generation_tokens: int = 0  # tokens sampled this step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    token_latencies: list[tuple[str, float]] = field(default_factory=list)  # (tenant, seconds since the previous token) per decode token
    first_token_latencies: list[tuple[str, float]] = field(default_factory=list)  # (tenant, ttft)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count
    # Speculative decoding: verification rows, the drafts they carried, and the drafts accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    # Per decode row with drafts to verify this step: how many it verifies (adaptive k's choice; 0: turned down).
    chosen_draft_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class QueueCensus:
    """Who waits and runs, and what the KV cache keeps: counted by walking the queues, so taken
    now and then (the dashboard's, while one is watched), never every step."""

    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting_by_priority: dict[int, int] = field(default_factory=dict)
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    num_cached_free_blocks: int = 0  # free blocks still holding a prefix a later hit can reuse

    @classmethod
    def of(cls, waiting: Iterable[Any], running: Iterable[Any], num_cached_free_blocks: int) -> QueueCensus:
        """From the requests (anything with `tenant` and `priority`) waiting and running."""
        by_tenant: Counter[str] = Counter()
        by_priority: Counter[int] = Counter()
        for r in waiting:
            by_tenant[r.tenant] += 1
            by_priority[r.priority] += 1
        running_by_tenant = Counter(r.tenant for r in running)
        return cls(dict(by_tenant), dict(by_priority), dict(running_by_tenant), num_cached_free_blocks)


# ---------------------------------------------------------------- why a request waits
class WaitReason(str, Enum):
    """Why a waiting (or preempted) request was not admitted in a step."""

    TOKEN_BUDGET = "token_budget"  # the step's max_num_batched_tokens was spent
    MAX_NUM_SEQS = "max_num_seqs"  # the sequence cap is reached and no running request yields its seat
    KV_BLOCKS = "kv_blocks"  # too few free KV blocks, and no running request yields its blocks
    TENANT_QUOTA = "tenant_max_running"  # its tenant already runs tenant_max_running requests
    BEHIND = "behind"  # the policy ranks another waiting request first, and that one was not admitted
    PARTIAL_PREFILL_CAP = "max_num_partial_prefills"  # it would start one partial prefill too many
    STATIC_BATCH = "static_batch"  # static batching: the running batch has not finished
    NOT_REACHED = "not_reached"  # queued since the last step: not considered yet
    GRAMMAR_COMPILING = "grammar_compiling"  # its structured-output grammar is compiling; not queued yet


@dataclass(frozen=True)
class WaitStop:
    """Why a step's admission stopped: `reason`, and `request_id` the first request it could not
    admit (None when the reason holds for every waiting request: budget spent, static batch).
    `capped_tenants`: tenants at their tenant_max_running cap after the step."""

    step: int
    reason: WaitReason
    request_id: str | None = None
    capped_tenants: frozenset[str] = frozenset()


@dataclass(frozen=True)
class WaitInfo:
    """Why one request was not admitted in step `step`; with `BEHIND`, `behind` is the request
    ahead of it that was not admitted either."""

    step: int
    reason: WaitReason
    behind: str | None = None


@dataclass(frozen=True)
class RequestSnapshot:
    """One request's state, plain data for a client: `state` is waiting, prefilling, decoding,
    preempted or finished; `queue_position` counts from 0 at the head of its queue (None unless
    waiting)."""

    request_id: str
    tenant: str
    state: str
    queue_position: int | None
    wait: WaitInfo | None
    num_prompt_tokens: int
    num_computed_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    priority: int = 0
    finish_reason: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # Predicted seconds from arrival to the first token (engine/ttft.py), or why there is none.
    predicted_ttft: float | None = None
    predicted_ttft_unavailable: str | None = None
