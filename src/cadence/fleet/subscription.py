"""Streams by subscription: one long-lived Ray stream per (ingress, replica) carries the deltas
of every request that ingress has on that replica.

A replica keeps an `Outbox` per subscriber: each admitted request's pump puts its stream items
there, and the subscriber's `subscribe` call takes whatever is ready as one `{request_id: [items]}`
batch (one Ray message per engine step for all of that ingress's streams, rather than one per
stream). A subscription ends by itself once its outbox has had no streams for `IDLE_LINGER_S`
(so that a draining replica has nothing ongoing); the ingress opens it again on its next request
there. Until its subscriber connects an outbox holds at most `UNCONNECTED_LIMIT` items: a pump
finding it full waits up to `CONNECT_WAIT_S` for the subscriber, then aborts its request.

At the ingress, `Subscriptions` reads each replica's subscription and puts every request's items
in that request's `Inbox` (the stream its `FleetStream` reads). A subscription that fails in Ray
fails every request on that replica; closing an inbox early aborts its request on the replica,
once: the items the replica sent before the abort reached it are dropped without another.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cadence.fleet import state

log = logging.getLogger("cadence.fleet")

UNCONNECTED_LIMIT = 1024  # items an outbox holds for a subscriber that has not connected
CONNECT_WAIT_S = 30.0  # how long a pump waits for room in an unconnected, full outbox
IDLE_LINGER_S = 2.0  # a subscription with no streams ends after this long
CONNECT_TIMEOUT_S = 10.0  # how long the ingress waits for a replica to answer its subscription


@dataclass(frozen=True)
class Ended:
    """A request's last item on a subscription: its replica stream ended."""


ENDED = Ended()
Batch = dict[str, list[Any]]


class Outbox:
    """A replica's items for one subscriber, by request id (see the module docstring)."""

    def __init__(self, limit: int = UNCONNECTED_LIMIT) -> None:
        self._limit = limit
        self._items: Batch = {}
        self._count = 0
        self.streams: set[str] = set()  # requests admitted for this subscriber and not ended
        self.connected = False
        self.departed = False  # its subscriber left with streams open (they are being aborted)
        self._ready = asyncio.Event()  # items to take, or the streams changed
        self._room = asyncio.Event()  # connected, or fewer than `limit` items held
        self._room.set()

    def open(self, request_id: str) -> None:
        self.streams.add(request_id)

    def put(self, request_id: str, item: Any) -> None:
        self._items.setdefault(request_id, []).append(item)
        self._count += 1
        if isinstance(item, Ended):
            self.streams.discard(request_id)
        self._ready.set()
        self._update_room()

    async def wait_room(self, timeout: float) -> bool:
        """False when the subscriber did not connect (nor drain the outbox) within `timeout`."""
        try:
            await asyncio.wait_for(self._room.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def connect(self) -> None:
        self.connected = True
        self.departed = False
        self._update_room()

    def disconnect(self) -> None:
        self.connected = False
        self._update_room()

    @property
    def idle(self) -> bool:
        return not self.streams and not self._items

    async def take(self, linger: float) -> Batch | None:
        """What is ready, as one batch; None once the outbox has been idle for `linger` seconds."""
        while not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), linger if not self.streams else None)
            except TimeoutError:
                if self.idle:
                    return None
        batch, self._items, self._count = self._items, {}, 0
        self._update_room()
        return batch

    def _update_room(self) -> None:
        if self.connected or self._count < self._limit:
            self._room.set()
        else:
            self._room.clear()


class Inbox:
    """One request's items from its replica's subscription: read like the replica's own stream
    (`__anext__`, `cancel`), which is what `FleetStream` reads."""

    def __init__(self, request_id: str, on_cancel: Callable[[Inbox], None]) -> None:
        self.request_id = request_id
        self.replica: str | None = None  # set once a replica admitted the request
        self._items: collections.deque[Any] = collections.deque()
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        self._cancelled = False
        self.ended = False
        self._on_cancel = on_cancel

    def put(self, items: list[Any]) -> None:
        self._items.extend(items)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def __aiter__(self) -> Inbox:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self._cancelled:
                raise asyncio.CancelledError
            if self._error is not None:
                self.ended = True
                raise self._error
            if self.ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, Ended):
            self.ended = True
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """The reader leaves: the request is aborted on its replica unless it ended."""
        if not self._cancelled:
            self._cancelled = True
            self._ready.set()
            self._on_cancel(self)


class Subscriptions:
    """The ingress's side: a subscription per replica that has its requests, and their inboxes.

    `open_stream(subscriber, replica)` opens a replica's subscription (an async iterator of
    batches); `abort(replica, request_id)` aborts a request there; `lost(exc)` is the error that
    a failed subscription ends its requests with."""

    def __init__(self, open_stream: Callable[[str, str], Any], abort: Callable[[str, str], Any],
                 lost: Callable[[BaseException], BaseException], connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.subscriber = uuid.uuid4().hex
        self._connect_timeout = connect_timeout
        self._open_stream = open_stream
        self._abort = abort
        self._lost = lost
        self._inboxes: dict[str, Inbox] = {}
        self._readers: dict[str, asyncio.Task] = {}  # replica -> the task reading its subscription
        self._aborts: set[asyncio.Task] = set()
        # Requests aborted on a replica whose end has not come yet, as (replica, request id): the
        # items still on their way for one are dropped, not answered with another abort each.
        self._aborted: set[tuple[str, str]] = set()

    def inbox(self, request_id: str) -> Inbox:
        """The request's inbox, registered before the request is sent (its first items may come
        before its admission does)."""
        inbox = Inbox(request_id, self._cancelled)
        self._inboxes[request_id] = inbox
        return inbox

    def drop(self, inbox: Inbox) -> None:
        """The request was not admitted: nothing will come for it."""
        if self._inboxes.get(inbox.request_id) is inbox:
            del self._inboxes[inbox.request_id]

    def admitted(self, inbox: Inbox, replica: str) -> None:
        inbox.replica = replica
        state.stream_opened(replica)
        if replica not in self._readers:
            self._readers[replica] = asyncio.get_running_loop().create_task(self._read(replica))

    def _cancelled(self, inbox: Inbox) -> None:
        self._forget(inbox)
        if not inbox.ended and inbox.replica is not None:
            self._send_abort(inbox.replica, inbox.request_id)

    def _forget(self, inbox: Inbox) -> None:
        if self._inboxes.get(inbox.request_id) is inbox:
            del self._inboxes[inbox.request_id]
            if inbox.replica is not None:
                state.stream_closed(inbox.replica)

    async def _read(self, replica: str) -> None:
        state.subscription_opened(replica)
        error: BaseException | None = None
        unanswered = False
        stream: Any = None
        try:
            # Inside the try: a call Ray refuses at once (the application gone, the handle shut
            # down) must fail the replica's requests too, not leave them waiting on a dead task.
            stream = self._open_stream(self.subscriber, replica)
            # A replica answers a subscription at once (an empty batch): one that does not (it
            # died after admitting a request, before this reached it) fails its requests.
            self._deliver(replica, await asyncio.wait_for(stream.__anext__(), self._connect_timeout))
            async for batch in stream:
                self._deliver(replica, batch)
        except asyncio.CancelledError:
            raise
        except StopAsyncIteration:
            pass
        except Exception as e:  # (a RayError: the replica died or could not be reached; or no answer)
            if stream is not None and hasattr(stream, "cancel"):
                stream.cancel()
            log.warning("replica %s: subscription failed (%s)", replica, type(e).__name__)
            error = self._lost(e)
            unanswered = isinstance(e, TimeoutError)
        finally:
            state.subscription_closed(replica)
            del self._readers[replica]
            # Ended idle, the replica holds none of them; failed, it is gone with them.
            self._aborted = {key for key in self._aborted if key[0] != replica}
        mine = [i for i in self._inboxes.values() if i.replica == replica]
        if error is not None:
            for inbox in mine:
                self._forget(inbox)
                inbox.fail(error)
                if unanswered:  # (a replica alive but too busy to answer would run them for nobody)
                    self._start_abort(replica, inbox.request_id)  # (its subscription is over: not kept)
        elif mine:  # it ended (idle) as another request was admitted there: open it again
            self._readers[replica] = asyncio.get_running_loop().create_task(self._read(replica))

    def _deliver(self, replica: str, batch: Batch) -> None:
        for request_id, items in batch.items():
            inbox = self._inboxes.get(request_id)
            if inbox is None:  # its reader left (before its admission, or since)
                if isinstance(items[-1], Ended):
                    self._aborted.discard((replica, request_id))
                else:
                    self._send_abort(replica, request_id)
                continue
            if isinstance(items[-1], Ended):
                self._forget(inbox)
            inbox.put(items)

    def _send_abort(self, replica: str, request_id: str) -> None:
        """Abort the request on `replica`, unless it was already (until its end comes back)."""
        if (replica, request_id) in self._aborted:
            return
        self._aborted.add((replica, request_id))
        self._start_abort(replica, request_id)

    def _start_abort(self, replica: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._aborting(replica, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _aborting(self, replica: str, request_id: str) -> None:
        try:
            await self._abort(replica, request_id)
        except Exception as e:  # the replica is gone: so is the request
            log.info("replica %s: abort of %s not delivered (%s)", replica, request_id, type(e).__name__)


async def pump(items: AsyncIterator[Any], request_id: str, outbox: Outbox,
               wait_s: float = CONNECT_WAIT_S) -> None:
    """A replica request's stream `items` into `outbox`, then `ENDED`. Waiting longer than
    `wait_s` for room (its subscriber never came) closes `items`, which aborts the request."""
    try:
        async for item in items:
            if not await outbox.wait_room(wait_s):
                log.warning("request %s: its subscriber did not connect; aborting it", request_id)
                break
            outbox.put(request_id, item)
    finally:
        await items.aclose()  # type: ignore[attr-defined]
        outbox.put(request_id, ENDED)
