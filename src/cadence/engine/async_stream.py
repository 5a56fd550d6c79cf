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


@dataclass(frozen=True)
class AbortRecord:
    """The last record of a group's choices that an abort ended (finish reason `abort`, metrics and
    engine events), for the request's trace. Queued before the abort's terminal error, only while
    the engine records request events; a reader keeps it (`RequestStream.aborted`), never yields it."""

    finals: tuple[StreamDelta, ...]


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
        self.aborted: list[StreamDelta] = []  # the choices an abort ended, as the engine last saw them
        self._errored = False  # the engine's terminal error was read: nothing more will come

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
        while isinstance(item, AbortRecord):  # the abort's error comes next
            self.aborted.extend(item.finals)
            item = await self._group.queue.get()
        if isinstance(item, BaseException):
            self._errored = True
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

    async def last_records(self, timeout: float) -> list[StreamDelta]:
        """After `aclose`: the last delta of each choice, finished before the abort (delivered and
        not read) or ended by it (`aborted`), as far as they arrive within `timeout` seconds. Reads
        what is left in the queue, up to the abort's terminal error."""
        finals = {d.request_id: d for d in self.aborted}
        if self._errored:
            return list(finals.values())
        queue = self._group.queue
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while len(finals) < self._open:  # the choices not read to their end
            left = give_up - loop.time()
            if left <= 0:
                break
            try:
                item = await asyncio.wait_for(queue.get(), left)
            except TimeoutError:
                break
            if isinstance(item, AbortRecord):
                finals.update((d.request_id, d) for d in item.finals)
            elif isinstance(item, BaseException):
                break  # the abort's error: everything it ended came before it
            elif item.finished:
                finals[item.request_id] = item
        return list(finals.values())


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
