"""What the HTTP layer needs from an engine: `EngineClient`.

`AsyncEngine` is the local one (an engine in this process). A fleet's client (cadence.fleet)
implements the same interface over many remote engines, so the routes, validation, errors and
streaming of `cadence serve` are the same code in both. The HTTP layer tokenizes and validates
requests itself (with `tokenizer`, `max_model_len`, `max_request_tokens`, `vocab_size`) and then
only submits, streams and aborts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

from cadence.engine.output_processor import StreamDelta
from cadence.errors import CadenceError
from cadence.request import DEFAULT_POLICY, RequestPolicy, SamplingParams

# While the server submits a traced request: the W3C context of its span (traceparent, tracestate),
# for an engine client that runs the request in another process (a fleet's replica) to pass on.
TRACE_CARRIER: ContextVar[dict[str, str] | None] = ContextVar("cadence_trace_carrier", default=None)


class EngineStream(Protocol):
    """One client request's deltas (every choice, merged); `aclose()` aborts what has not finished."""

    @property
    def request_id(self) -> str: ...

    def index_of(self, sub_id: str) -> int: ...

    def __aiter__(self) -> AsyncIterator[StreamDelta]: ...

    async def __anext__(self) -> StreamDelta: ...

    async def aclose(self) -> None: ...


class RetryAfter(Protocol):
    def retry_after(self) -> float | None: ...


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    max_request_tokens: int
    vocab_size: int
    tokenizer: Any
    stats_hooks: list[Callable[..., None]]  # called after each local engine step (none for a fleet)
    engine: Any  # `.config` (an EngineConfig) where known: whether tenants' caches are isolated

    @property
    def drain_rate(self) -> RetryAfter:
        """Retry-After for a refusal made before the engine (a tenant's cap)."""
        ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def is_draining(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def num_in_flight(self) -> int: ...

    def engine_thread_times(self) -> dict[str, Any] | None:
        """The local engine thread's time totals (`EngineThreadTimes`), None where the engines are
        elsewhere (a fleet's replicas export their own)."""
        ...

    # (The signature repeats `AsyncEngine.submit`'s and `FleetClient.submit`'s on purpose: a
    # Protocol states the shape its implementations share.)
    async def submit(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        request_id: str,
        policy: RequestPolicy = DEFAULT_POLICY,
        queue_status: bool = False,
    ) -> EngineStream:
        """Admit the request or raise its refusal (`CadenceError`, `AdmissionError` with Retry-After).
        `queue_status`: the stream's `admission` then holds each choice's `RequestSnapshot` as admitted."""
        ...

    def abort(self, request_id: str, error: CadenceError | None = None) -> None: ...

    def begin_drain(self) -> None: ...

    def abort_all(self, error: CadenceError) -> None: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...
