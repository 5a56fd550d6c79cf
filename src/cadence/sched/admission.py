"""Admission control: what is refused before any work is done, and how long to wait before retrying.

Requests arrive in groups (one client request: its choices and prompts), admitted all or nothing.
A group is refused as invalid (it could never run, however long the client waited) when a request
is longer than `max_model_len`, than the whole KV cache, or, without chunked prefill, than one
step's token budget, or when the group alone is more than the waiting queue may ever hold. It is
refused for now (retry later) when its deadline has already passed or when the queue is full in
requests or prompt tokens; the queue's policy may instead make room by dropping queued requests of
a tenant over its share (queue.py, `overflow`), which end with their own refusal. A full queue
suggests a retry delay from the drain rate the scheduler observes.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass

from cadence.config import SchedulerConfig
from cadence.errors import AdmissionError, ErrorKind
from cadence.request import Request
from cadence.sched.queue import QueueBound, RequestQueue, ShareUse


class DrainRate:
    """Finished requests per second, as an EWMA of the interval between finishes."""

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha: must be in (0, 1]")
        self._alpha = alpha
        self._last: float | None = None
        self._interval: float | None = None

    def record(self, now: float) -> None:
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self._interval = gap if self._interval is None else self._interval + self._alpha * (gap - self._interval)
        self._last = now

    @property
    def per_second(self) -> float | None:
        if self._interval is None:
            return None
        return math.inf if self._interval == 0 else 1.0 / self._interval

    def retry_after(self, excess_requests: float) -> float:
        """Seconds until `excess_requests` more requests have finished: whole seconds, at least 1."""
        if not self._interval:
            return 1.0  # no estimate yet (or finishes faster than we can measure)
        return float(max(1, math.ceil(excess_requests * self._interval)))


@dataclass(frozen=True)
class Eviction:
    """A queued request dropped to make room for a fairer arrival, and the refusal it ends with."""

    request: Request
    error: AdmissionError


def _one(r: Request) -> int:
    return 1


def _prompt_tokens(r: Request) -> int:
    return r.num_prompt_tokens


def check_ids(group: Sequence[Request], in_use: Container[str]) -> None:
    """Raise AdmissionError unless the group's ids are unique and none is `in_use`, and the group
    has one tenant (fair share weighs a group as its tenant's)."""
    ids = [r.request_id for r in group]
    taken = next((rid for rid in ids if rid in in_use), None)
    if taken is None and len(group) > 1 and len(set(ids)) < len(ids):
        taken = next(rid for rid in ids if ids.count(rid) > 1)
    if taken is not None:
        raise AdmissionError(ErrorKind.INVALID_REQUEST, f"request id {taken!r} is already in use")
    if len(group) > 1 and len({r.tenant for r in group}) > 1:
        raise AdmissionError(ErrorKind.INVALID_REQUEST, "the requests of one group must share a tenant")


class AdmissionControl:
    def __init__(self, config: SchedulerConfig, max_model_len: int, capacity_tokens: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.drain = DrainRate()
        self.bounds = [QueueBound(config.max_queue_len, "requests", _one)]
        if config.max_queued_tokens is not None:
            self.bounds.append(QueueBound(config.max_queued_tokens, "prompt tokens", _prompt_tokens))

    def check(self, group: Sequence[Request], waiting: RequestQueue, now: float, *,
              evict: bool = True) -> list[Eviction]:
        """Raise AdmissionError if `group` may not join `waiting` now; else the queued requests to
        drop first to make room for it (none unless `evict` and the queue's policy says so)."""
        for req in group:
            self.check_lengths(req)
        if any(req.deadline is not None and req.deadline <= now for req in group):
            raise AdmissionError(ErrorKind.DEADLINE, "the request's deadline passed before it was queued")
        self.check_group(group)
        return self._check_queue(group, waiting, evict)

    def check_lengths(self, req: Request) -> None:
        """Raise AdmissionError if `req` could never run here, however empty the engine (its lengths
        against max_model_len, the KV cache, max_queued_tokens and, without chunked prefill, the
        token budget)."""
        cfg = self.config
        total = req.max_total_tokens
        lengths = f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.sampling_params.max_tokens}) = {total}"
        if total > self.max_model_len:
            raise AdmissionError(
                ErrorKind.INVALID_REQUEST, f"{lengths} exceeds max_model_len ({self.max_model_len})", param="max_tokens"
            )
        if total > self.capacity_tokens:
            # Guarantees that a request running alone always finds room, so preemption terminates.
            raise AdmissionError(
                ErrorKind.INVALID_REQUEST,
                f"{lengths} exceeds the KV cache capacity ({self.capacity_tokens} tokens)",
                param="max_tokens",
            )
        if not cfg.enable_chunked_prefill and req.num_prompt_tokens > cfg.max_num_batched_tokens:
            raise AdmissionError(
                ErrorKind.INVALID_REQUEST,
                f"prompt ({req.num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) and chunked prefill is off",
                param="prompt",
            )
        if cfg.max_queued_tokens is not None and req.num_prompt_tokens > cfg.max_queued_tokens:
            raise AdmissionError(
                ErrorKind.INVALID_REQUEST,
                f"prompt ({req.num_prompt_tokens} tokens) exceeds max_queued_tokens ({cfg.max_queued_tokens}): "
                "it could never be queued",
                param="prompt",
            )

    def check_group(self, group: Sequence[Request]) -> None:
        """Raise AdmissionError if `group` alone is over a queue bound: it could never be queued."""
        if len(group) < 2:
            return  # one request: check_lengths covers it
        for bound in self.bounds:
            size = bound.total(group)
            if size > bound.limit:
                raise AdmissionError(
                    ErrorKind.INVALID_REQUEST,
                    f"the request's {len(group)} choices (n x prompts) come to {size} {bound.unit}, more than "
                    f"the waiting queue holds ({bound.limit}, {_FLAG[bound.unit]}): it could never be queued",
                    param="n",
                )

    def _check_queue(self, group: Sequence[Request], waiting: RequestQueue, evict: bool) -> list[Eviction]:
        over = [b for b in self.bounds if _queued(b, waiting) + b.total(group) > b.limit]
        if not over:
            return []
        verdict = waiting.overflow(group, over)
        if verdict.over_share is not None:
            use = verdict.over_share
            raise self._refusal(
                ErrorKind.FAIR_SHARE,
                f"tenant {use.tenant!r} is over its fair share of the queue: with this request it would hold "
                f"{use.describe()}",
                self._excess(use),
            )
        if verdict.evict and evict:
            return [
                Eviction(victim, self._refusal(
                    ErrorKind.FAIR_SHARE,
                    f"tenant {use.tenant!r} is over its fair share of the queue ({use.describe()}): this queued "
                    "request was dropped to admit another tenant's",
                    self._excess(use),
                ))
                for victim, use in verdict.evict
            ]
        bound = over[0]
        excess: float
        if bound.unit == "requests":
            excess = len(waiting) + len(group) - bound.limit
        else:  # requests that must drain to make room, from the average queued prompt
            over_tokens = waiting.num_tokens + bound.total(group) - bound.limit
            excess = over_tokens / max(1.0, waiting.num_tokens / max(1, len(waiting)))
        raise self._refusal(ErrorKind.QUEUE_FULL, f"the waiting queue is full ({bound.limit} {bound.unit})", excess)

    @staticmethod
    def _excess(use: ShareUse) -> float:
        """Requests that must finish before a tenant is back within its share, roughly: its own
        requests over the share (one, for a bound in tokens), each one in `limit / share` of the
        finishes while it gets its share of the service."""
        own = max(1, math.ceil(use.held - use.share)) if use.bound.unit == "requests" else 1
        return own * use.bound.limit / max(use.share, 1e-9)

    def _refusal(self, kind: ErrorKind, message: str, excess_requests: float) -> AdmissionError:
        retry = self.drain.retry_after(excess_requests)
        return AdmissionError(kind, f"{message}; retry after {retry:.0f} s", retry_after=retry)


_FLAG = {"requests": "max_queue_len", "prompt tokens": "max_queued_tokens"}


def _queued(bound: QueueBound, waiting: RequestQueue) -> int:
    """What the queue holds of a bound, kept as a count (this runs for every arrival)."""
    return len(waiting) if bound.unit == "requests" else waiting.num_tokens
