"""Admission control: what is refused before any work is done, and how long to wait before retrying.

A request is refused (AdmissionError) when it can never run (longer than `max_model_len`, than
the whole KV cache, or, without chunked prefill, than one step's token budget), when its
deadline has already passed, or when the waiting queue is full in requests or prompt tokens.
A full queue suggests a retry delay from the drain rate the scheduler observes.
"""

from __future__ import annotations

import math

from cadence.config import SchedulerConfig
from cadence.errors import AdmissionError, ErrorKind
from cadence.request import Request
from cadence.sched.queue import RequestQueue


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


class AdmissionControl:
    def __init__(self, config: SchedulerConfig, max_model_len: int, capacity_tokens: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.drain = DrainRate()

    def check(self, req: Request, waiting: RequestQueue, now: float) -> None:
        """Raise AdmissionError if `req` may not join `waiting` now."""
        self.check_lengths(req)
        if req.deadline is not None and req.deadline <= now:
            raise AdmissionError(ErrorKind.DEADLINE, "the request's deadline passed before it was queued")
        self._check_queue(req, waiting)

    def check_lengths(self, req: Request) -> None:
        """Raise AdmissionError if `req` could never run here, however empty the engine (its lengths
        against max_model_len, the KV cache and, without chunked prefill, the token budget)."""
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

    def _check_queue(self, req: Request, waiting: RequestQueue) -> None:
        cfg = self.config
        if len(waiting) >= cfg.max_queue_len:
            excess = len(waiting) - cfg.max_queue_len + 1
            self._refuse(f"the waiting queue is full ({cfg.max_queue_len} requests)", excess)
        if cfg.max_queued_tokens is not None and waiting.num_tokens + req.num_prompt_tokens > cfg.max_queued_tokens:
            over = waiting.num_tokens + req.num_prompt_tokens - cfg.max_queued_tokens
            per_request = waiting.num_tokens / max(1, len(waiting))
            # Requests that must drain to make room, from the average queued prompt.
            self._refuse(f"the waiting queue is full ({cfg.max_queued_tokens} prompt tokens)", over / max(1.0, per_request))

    def _refuse(self, message: str, excess_requests: float) -> None:
        retry = self.drain.retry_after(excess_requests)
        raise AdmissionError(ErrorKind.QUEUE_FULL, f"{message}; retry after {retry:.0f} s", retry_after=retry)
