"""The records between the asyncio side and the engine thread, and the stream a client request reads.

`AsyncEngine` (async_engine.py) owns the thread; these are the values it passes around: a `Group`
per client request (its engine sub-requests, its loop and queue), the inbox items, the
`RequestStream` that merges a group's deltas, and the drain rate behind Retry-After.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cadence.boundary import RequestSnapshot, SchedulerStats
from cadence.clock import Clock
from cadence.engine.output_processor import StreamDelta
from cadence.errors import CadenceError, ErrorKind
from cadence.request import FinishReason, Request


@dataclass
class Group:
    """One client request: its engine sub-requests and where their deltas go."""

    request_id: str
    sub_ids: list[str]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    open_ids: set[str] = field(default_factory=set)  # sub-requests not finished yet


@dataclass
class AddItem:
    group: Group
    requests: list[Request]
    future: asyncio.Future
    status: bool = False  # answer the admission with the request's snapshots (queue place, prediction)
    emitted: int = 0  # the prompts' last tokens are output streamed already (OutputProcessor.add_request)


@dataclass
class AbortItem:
    request_id: str
    error: CadenceError | None = None  # the stream's terminal event (a default one when None)


class RequestStream:
    """Async iterator over the `StreamDelta`s of one client request (every choice, merged in arrival order).

    An error delta from the core, or an error the engine puts in the queue, is raised as `CadenceError`.
    `aclose()` (or leaving an `async for` early) aborts whatever has not finished.
    """

    def __init__(self, group: Group, abort: Callable[[str], None]) -> None:
        self._abort = abort
        self._group = group
        self._index = {rid: i for i, rid in enumerate(group.sub_ids)}
        self._open = len(group.sub_ids)
        self._closed = False
        # With submit(queue_status=True): each choice's state as the engine admitted it.
        self.admission: tuple[RequestSnapshot, ...] | None = None

    @property
    def request_id(self) -> str:
        return self._group.request_id

    def index_of(self, sub_id: str) -> int:
        """Choice index of a sub-request: prompt_index * n + i."""
        return self._index[sub_id]

    def ready(self) -> int:
        """Deltas (or an error) delivered and not read yet: that many reads return without waiting."""
        return self._group.queue.qsize()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._open == 0 or self._closed:
            raise StopAsyncIteration
        item = await self._group.queue.get()
        if isinstance(item, BaseException):
            self._finish_early()
            raise item
        if (
            item.finish_reason == "error"
        ):  # a deadline delta also carries `error`: it is a finish, not a failure
            self._finish_early()
            if item.error_by_request:
                raise CadenceError(ErrorKind.INVALID_REQUEST, f"the grammar library stopped following the constraint "
                                                              f"during generation ({item.error})")
            raise CadenceError(ErrorKind.INTERNAL, f"generation failed: {item.error}")
        if item.finish_reason == FinishReason.EVICTED.value:  # dropped from the queue: a refusal
            self._finish_early()
            raise CadenceError(ErrorKind.FAIR_SHARE, item.error or "dropped from the waiting queue",
                               retry_after=item.retry_after)
        if item.finished:
            self._open -= 1
        return item

    def _finish_early(self) -> None:
        self._closed = True
        if self._open:
            self._abort(self.request_id)

    async def aclose(self) -> None:
        if not self._closed and self._open:
            self._abort(self.request_id)
        self._closed = True


class DrainRate:
    """Requests finished per second over a sliding window; Retry-After = time to drain the waiting queue."""

    def __init__(self, clock: Clock, window: float = 10.0) -> None:
        self.clock, self.window = clock, window
        self._finishes: deque[float] = deque()
        self._waiting = 0

    def record(self, finished: int, stats: SchedulerStats | None) -> None:
        now = self.clock.now()
        self._finishes.extend([now] * finished)
        self._waiting = stats.num_waiting if stats is not None else self._waiting
        while self._finishes and self._finishes[0] < now - self.window:
            self._finishes.popleft()

    def retry_after(self) -> float:
        """Seconds until the waiting queue has drained at the current rate, in [1, 60]."""
        rate = len(self._finishes) / self.window
        if rate <= 0:
            return 1.0 if self._waiting == 0 else 5.0
        return min(60.0, max(1.0, (self._waiting + 1) / rate))
