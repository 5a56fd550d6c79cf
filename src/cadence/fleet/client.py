"""`FleetClient`: the HTTP layer's `EngineClient` over a Ray Serve handle to the replica deployment.

The ingress tokenizes and validates requests (the same `OpenAIServing` as a single server), hashes
the prompt's blocks with the KV manager's function and the request's cache salt, and sends a
`GenerateCall`; the fleet's router picks the replica. The replica's first answer is its admission
(`Admitted` or `Refused`), so refusals are real HTTP errors as on a single server; its name is
put in the response's `X-Cadence-Replica` header (`ReplicaHeaderMiddleware`).

A client's `X-Request-Id` names its request: it is the response's `X-Request-Id` (in place of
the response's own id), and the client remembers it beside the response's id so that
`GET /v1/requests/{id}` takes either. Behind Serve's HTTP proxy (the `serve run` application), the
proxy gives every request such an id (the client's, else one it makes) and adds it to the
response itself; the middleware then only removes the response's own, so that one header remains
(two would reach clients joined as "a, b").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from cadence.config import EngineConfig
from cadence.engine.output_processor import StreamDelta
from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.fleet.protocol import Admitted, Deltas, Failed, GenerateCall, Refused, Target, policy_at_replica
from cadence.fleet.replica import ReplicaInfo, refusal_error
from cadence.fleet.subscription import Subscriptions
from cadence.kv.hashing import block_hashers
from cadence.metrics.prometheus import PrometheusExporter, merge_expositions
from cadence.request import DEFAULT_POLICY, RequestPolicy, SamplingParams
from cadence.routing import fingerprints
from cadence.server.engine_client import TRACE_CARRIER
from cadence.server.request_status import MAX_REQUEST_ID_CHARS
from cadence.structured import StructuredOutputs

log = logging.getLogger("cadence.fleet")

REPLICA_HEADER = b"x-cadence-replica"
REQUEST_ID_HEADER = b"x-request-id"  # the client's (or Serve's proxy's) id of the request
BUSY_RETRY_AFTER_S = 1.0  # Retry-After when Serve's own queue for the replicas is full
# A request every replica refused for a full queue, held at the ingress, is sent again when one of
# the ingress's streams closes (a seat freed), or else after a pause: the first, doubled each
# time up to the last (for seats freed otherwise), and never past the request's deadline.
HOLD_PAUSE_S = (0.05, 2.0)
REPLICA_CALL_TIMEOUT_S = 10.0  # a call to one replica (its metrics, a request's status)
PLACED_KEEP = 4096  # requests whose replica the ingress remembers, for GET /v1/requests/{id}

# Per HTTP request: a slot the client fills with the replica's name for the middleware to send,
# and where the middleware puts the request's X-Request-Id ("serve_id").
_REPLICA_SLOT: ContextVar[dict[str, str] | None] = ContextVar("cadence_replica_slot", default=None)


# (Its opening lines match server/stopping.py's StopGuard: both are the plain ASGI wrapper
# pattern, kept apart because each wraps `send` for its own purpose.)
class ReplicaHeaderMiddleware:
    """Pure ASGI: adds `X-Cadence-Replica: NAME` to a response a replica served (or refused); where
    the request carries an `X-Request-Id`, that is the response's: put in place of the response's
    own (`echo_request_id`), or left for Serve's proxy to add (the response's own dropped)."""

    def __init__(self, app: Any, echo_request_id: bool = False) -> None:
        self.app = app
        self.echo_request_id = echo_request_id

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        slot: dict[str, str] = {}
        serve_id = next((v for k, v in scope.get("headers", ()) if k.lower() == REQUEST_ID_HEADER), None)
        if serve_id is not None:
            slot["serve_id"] = serve_id.decode("latin-1")
        token = _REPLICA_SLOT.set(slot)

        async def send_with_replica(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if serve_id is not None:
                    headers = [(k, v) for k, v in headers if k.lower() != REQUEST_ID_HEADER]
                    if self.echo_request_id:
                        headers.append((REQUEST_ID_HEADER, serve_id))
                if "replica" in slot:
                    headers.append((REPLICA_HEADER, slot["replica"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            _REPLICA_SLOT.reset(token)


def note_replica(name: str) -> None:
    slot = _REPLICA_SLOT.get()
    if slot is not None:
        slot["replica"] = name


def _serve_request_id() -> str | None:
    slot = _REPLICA_SLOT.get()
    return slot.get("serve_id") if slot is not None else None


def check_request_id() -> None:
    """A 400 for a client's X-Request-Id longer than `GET /v1/requests/{id}` takes: the ingress
    names the request by it and remembers it (the last PLACED_KEEP), so an unbounded one would
    hold memory and could never be looked up."""
    serve_id = _serve_request_id()
    if serve_id is not None and len(serve_id) > MAX_REQUEST_ID_CHARS:
        raise CadenceError(ErrorKind.INVALID_REQUEST, f"X-Request-Id: {len(serve_id)} characters, over the "
                           f"{MAX_REQUEST_ID_CHARS} a request id may have")


@dataclass(frozen=True)
class _EngineView:
    config: EngineConfig  # (the HTTP layer reads whether tenants' caches are isolated)


class _FixedRetryAfter:
    def retry_after(self) -> float | None:
        return BUSY_RETRY_AFTER_S


def ray_unavailable(exc: BaseException) -> CadenceError:
    return ReplicaLost(ErrorKind.UNAVAILABLE, f"the replica serving the request failed ({type(exc).__name__})")


class ReplicaLost(CadenceError):
    """A replica call failed in Ray (the replica died or could not be reached): a 503, unless the
    caller tries another replica."""


async def admission(gen: Any, what: str) -> Admitted:
    """The first item of a replica's stream `gen`, its engine's admission: a refusal raises its
    error, Serve's back pressure a 429 (`what`: "replica", "prefill replica"), a Ray error
    `ReplicaLost`; a stream that ends at once is an internal error. The client leaving cancels
    the call."""
    first = await first_answer(gen, what)
    if isinstance(first, Refused):
        note_replica(first.replica)
        raise refusal_error(first)
    return first


async def first_answer(gen: Any, what: str) -> Admitted | Refused:
    """`admission`, with an engine's refusal returned rather than raised."""
    from ray.exceptions import RayError
    from ray.serve.exceptions import BackPressureError

    try:
        first = await gen.__anext__()
    except asyncio.CancelledError:  # the client left while the request waited for a replica
        gen.cancel()
        raise
    except BackPressureError:
        raise AdmissionError(ErrorKind.QUEUE_FULL, f"every {what} is full; retry later",
                             retry_after=BUSY_RETRY_AFTER_S) from None
    except StopAsyncIteration:
        raise CadenceError(ErrorKind.INTERNAL, f"the {what} answered nothing") from None
    except RayError as e:
        raise ray_unavailable(e) from None
    assert isinstance(first, Admitted | Refused), type(first)
    return first


async def admission_anywhere(send: Callable[[GenerateCall], Any], call: GenerateCall, what: str,
                             replicas: Collection[str], *,
                             hold: Callable[[float], Awaitable[None]] | None = None) -> tuple[Any, Admitted]:
    """`send(call)`'s stream and its admission. A replica whose engine refuses the request for a
    full queue (before admitting it: nothing was streamed) is named in the call's `avoid` and the
    call sent again, so that the router places it on another of `replicas`; each refuses it at
    most once a round. When every replica refused it for a full queue, `hold(seconds)` keeps it
    (at most that long: the next pause of `HOLD_PAUSE_S`, or what is left of its deadline, after
    which an engine refuses it) and another round starts; without `hold` the last refusal is the
    answer. Any other refusal is the answer at once."""
    refused: list[str] = []
    pause = HOLD_PAUSE_S[0]
    while True:
        gen = send(replace(call, avoid=tuple(refused)) if refused else call)
        first = await first_answer(gen, what)
        if isinstance(first, Admitted):
            return gen, first
        again = first.replica in refused
        refused.append(first.replica)
        full = first.admission and first.kind == ErrorKind.QUEUE_FULL.value
        everywhere = again or set(replicas) <= set(refused)
        if full and everywhere and hold is not None:
            left = policy_at_replica(call, time.time()).deadline
            await hold(pause if left is None else max(0.0, min(pause, left)))
            pause, refused = min(2 * pause, HOLD_PAUSE_S[1]), []
            continue
        if everywhere or not full:
            note_replica(first.replica)
            raise refusal_error(first)
        log.info("request %s: refused by %s (queue full); trying another replica", call.request_id, first.replica)


async def _call_ended(gen: Any) -> None:
    """Read a subscribed call's end (it ends with its admission), so that Serve counts it done."""
    try:
        await gen.__anext__()
    except StopAsyncIteration:
        return
    except Exception as e:  # (the request is admitted: its deltas travel on the subscription)
        log.info("an admitted call ended with %s", type(e).__name__)
        return
    gen.cancel()


def handle_replicas(handle: Any) -> list[str]:
    """The replicas this process's router sends `handle`'s calls to."""
    from cadence.fleet.state import deployment_replica_ids, replica_ids

    return deployment_replica_ids(getattr(handle, "deployment_name", "")) or replica_ids()


class FleetStream:
    """A request's deltas from its replica (the `EngineStream` of the HTTP layer)."""

    def __init__(self, gen: Any, request_id: str, sub_ids: list[str], on_close: Any) -> None:
        self._gen = gen
        self._request_id = request_id
        self._index = {rid: i for i, rid in enumerate(sub_ids)}
        self._open = len(sub_ids)
        self._closed = False
        self._error: CadenceError | None = None
        self._on_close = on_close
        self._pending: collections.deque[StreamDelta] = collections.deque()  # the rest of a `Deltas` item
        self.admission: tuple[Any, ...] | None = None  # the replica's snapshots at admission, when asked

    @property
    def request_id(self) -> str:
        return self._request_id

    def index_of(self, sub_id: str) -> int:
        return self._index[sub_id]

    def __aiter__(self) -> FleetStream:
        return self

    async def __anext__(self) -> StreamDelta:
        from ray.exceptions import RayError

        if self._pending and self._error is None:
            return self._take(self._pending.popleft())
        if self._closed and self._error is None:
            raise StopAsyncIteration
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._close()
            if self._error is not None:
                raise self._error from None
            if self._open:  # the replica's stream ended before every choice finished
                raise CadenceError(ErrorKind.UNAVAILABLE, "the replica ended the request early") from None
            raise
        except asyncio.CancelledError:
            if self._error is not None:
                self._close()
                raise self._error from None
            raise
        except RayError as e:
            self._close()
            raise (self._error or ray_unavailable(e)) from None
        except CadenceError:  # (its replica's subscription failed)
            self._close()
            raise
        if self._error is not None:
            self._close()
            raise self._error
        if isinstance(item, Failed):
            self._close()
            raise CadenceError(ErrorKind(item.kind), item.message, retry_after=item.retry_after)
        if isinstance(item, Deltas):
            self._pending.extend(item.items[1:])
            item = item.items[0]
        return self._take(item)

    def _take(self, delta: StreamDelta) -> StreamDelta:
        if delta.finished:
            self._open -= 1
        return delta

    def fail(self, error: CadenceError) -> None:
        """End the request with `error` for its reader (a drain that timed out)."""
        self._error = error
        self._gen.cancel()

    async def aclose(self) -> None:
        if not self._closed and self._open:
            self._gen.cancel()  # Serve cancels the replica's generator: its `finally` aborts the request
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self)


class FleetClient:
    """The HTTP layer's engine: a Ray Serve handle to the replicas (see the module docstring)."""

    subscribe_streams = True  # requests' deltas travel on the replicas' subscriptions (fleet/subscription.py)

    def __init__(self, handle: Any, info: ReplicaInfo, tokenizer: Any, engine_config: EngineConfig,
                 max_held: int | None = None) -> None:
        """`max_held`: the most requests this ingress holds at once, waiting for a replica's
        admission or streaming (the replicas' seats and `--max-queued-requests`); None: no bound
        of its own."""
        self._handle = handle
        self._max_held = max_held
        self._admitting = 0  # requests sent to the replicas, not yet admitted or refused
        # Requests on their way to a replica (until their stream is returned), with the error of an
        # abort that came for one meanwhile (its client left): its stream starts failed, which
        # aborts it on the replica that admitted it.
        self._in_admission: dict[str, CadenceError | None] = {}
        self._last_metrics: dict[str, str] = {}  # each replica's last exposition, by replica id
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_request_tokens = info.max_request_tokens
        self.vocab_size = info.vocab_size
        self.tokenizer = tokenizer
        self.engine = _EngineView(engine_config)
        self.drain_rate = _FixedRetryAfter()
        self.stats_hooks: list[Any] = []  # (the replicas' own exporters count their steps)
        self._block_size = info.block_size
        self._hash_chain = block_hashers(info.hash_algo)[1]
        self._live: dict[str, FleetStream] = {}
        self._placed: collections.OrderedDict[str, str] = collections.OrderedDict()  # request id -> replica
        # Serve's id of the HTTP request -> the response's id (as many as `_placed`)
        self._serve_ids: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._draining = False
        self._seat_waiters: collections.deque[asyncio.Future[None]] = collections.deque()  # held requests
        # The ingress compiles constraints too (the grammar library loads on first use), so that a
        # refused one is a 400 naming the request's field before any replica sees it.
        self._grammars = StructuredOutputs(tokenizer, info.vocab_size)
        self._subs = Subscriptions(self._subscribe, self._abort_on, ray_unavailable)

    # -- state --------------------------------------------------------------------------------------
    # The ingress itself is healthy while it runs; a replica's health is Serve's to check.

    @property
    def is_healthy(self) -> bool:
        return True

    @property
    def is_ready(self) -> bool:
        return not self._draining

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def dead_reason(self) -> str | None:
        return None

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def engine_thread_times(self) -> None:
        return None  # each replica exports its own engine thread's times

    # -- requests -----------------------------------------------------------------------------------

    def chain(self, prompt: Sequence[int], cache_salt: str | None) -> tuple[int, ...]:
        return fingerprints(self._hash_chain(prompt, self._block_size, cache_salt, ()))

    async def validate_structured(self, params: SamplingParams) -> None:
        """Compile `params.structured_outputs` here (or find it cached): ValueError naming the field
        when the grammar library refuses it. The replica compiles it again when it admits it."""
        if params.structured_outputs is not None:
            await self._grammars.validate_async(params.structured_outputs)

    async def submit(self, prompts: Sequence[list[int]], params: SamplingParams, *, request_id: str,
                     policy: RequestPolicy = DEFAULT_POLICY, queue_status: bool = False) -> FleetStream:
        return await self._submit_to(self._handle, prompts, params, request_id, policy, queue_status)

    async def _submit_to(self, handle: Any, prompts: Sequence[list[int]], params: SamplingParams, request_id: str,
                         policy: RequestPolicy, queue_status: bool = False) -> FleetStream:
        """`submit` to the replicas behind `handle`."""
        if self._draining:
            raise CadenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        if request_id in self._live or request_id in self._in_admission:
            raise CadenceError(ErrorKind.INVALID_REQUEST, f"request id {request_id!r} is in use")
        check_request_id()
        self.check_room()
        subscribed = self.subscribe_streams and handle is self._handle
        call = GenerateCall(tuple(prompts), params, request_id, policy, self.chain(prompts[0], policy.cache_salt),
                            TRACE_CARRIER.get(), queue_status, subscriber=self._subs.subscriber if subscribed else None,
                            sent_at=time.time())
        inbox = self._subs.inbox(request_id) if subscribed else None
        self._admitting += 1
        self._in_admission[request_id] = None
        try:
            gen, first = await admission_anywhere(handle.options(stream=True).generate.remote, call, "replica",
                                                  handle_replicas(handle),
                                                  hold=self._wait_for_seat if self._max_held is not None else None)
        except BaseException:
            self._in_admission.pop(request_id, None)
            if inbox is not None:
                self._subs.drop(inbox)
            raise
        finally:
            self._admitting -= 1
        if inbox is not None:
            self._subs.admitted(inbox, first.replica)
            try:
                await _call_ended(gen)
            except asyncio.CancelledError:  # the client left: the request is aborted
                self._in_admission.pop(request_id, None)
                inbox.cancel()
                raise
            gen = inbox
        note_replica(first.replica)
        self._remember(request_id, first.replica)
        total = len(prompts) * params.n
        sub_ids = [request_id] if total == 1 else [f"{request_id}-{k}" for k in range(total)]
        stream = FleetStream(gen, request_id, sub_ids, self._closed)
        stream.admission = first.status
        self._live[request_id] = stream
        aborted = self._in_admission.pop(request_id, None)
        if aborted is not None:
            stream.fail(aborted)
        return stream

    def _subscribe(self, subscriber: str, replica: str) -> Any:
        return self._handle.options(stream=True).subscribe.remote(subscriber, Target(replica))

    async def _abort_on(self, replica: str, request_id: str) -> None:
        await asyncio.wait_for(self._handle.abort.remote(request_id, Target(replica)), REPLICA_CALL_TIMEOUT_S)

    def check_room(self) -> None:
        """429 when this ingress already holds `max_held` requests. The bound is kept here rather
        than left to Serve's `max_queued_requests`, which counts a request as queued while it is
        being routed: a burst would be refused far below the replicas' free seats."""
        if self._max_held is not None and self._admitting + self.num_held() >= self._max_held:
            raise AdmissionError(ErrorKind.QUEUE_FULL, "every replica is full; retry later",
                                 retry_after=BUSY_RETRY_AFTER_S)

    def num_held(self) -> int:
        """Requests admitted by a replica whose streams are open."""
        return len(self._live)

    def _remember(self, request_id: str, replica: str) -> None:
        self._place(request_id, replica)
        self._remember_serve_id(request_id)

    def _place(self, request_id: str, replica: str) -> None:
        """`replica` serves the request (its status is asked there)."""
        self._placed[request_id] = replica
        self._placed.move_to_end(request_id)
        while len(self._placed) > PLACED_KEEP:
            self._placed.popitem(last=False)

    def _remember_serve_id(self, request_id: str) -> None:
        """The HTTP request's X-Request-Id (the client's, or Serve's proxy's) names `request_id` too."""
        serve_id = _serve_request_id()
        if serve_id is not None and serve_id != request_id:
            self._serve_ids[serve_id] = request_id  # (a client's id sent twice: the later request)
            self._serve_ids.move_to_end(serve_id)
            while len(self._serve_ids) > PLACED_KEEP:
                self._serve_ids.popitem(last=False)

    def _closed(self, stream: FleetStream) -> None:
        if self._live.get(stream.request_id) is stream:
            del self._live[stream.request_id]
            self._seat_freed()

    async def _wait_for_seat(self, seconds: float) -> None:
        """Hold a request every replica refused for a full queue: until a stream here closes (its
        seat frees; one held request wakes per stream, the longest held first) or `seconds` pass."""
        waiter = asyncio.get_running_loop().create_future()
        self._seat_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, seconds)
        except TimeoutError:
            pass
        finally:
            if waiter in self._seat_waiters:
                self._seat_waiters.remove(waiter)

    def _seat_freed(self) -> None:
        while self._seat_waiters:
            waiter = self._seat_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def abort(self, request_id: str, error: CadenceError | None = None) -> None:
        error = error or CadenceError(ErrorKind.UNAVAILABLE, "request aborted")
        stream = self._live.get(request_id)
        if stream is not None:
            stream.fail(error)
        elif request_id in self._in_admission:  # the replica has not answered yet: it aborts once admitted
            self._in_admission[request_id] = error

    def begin_drain(self) -> None:
        self._draining = True

    def abort_all(self, error: CadenceError) -> None:
        for stream in list(self._live.values()):
            stream.fail(error)
        for request_id in self._in_admission:
            self._in_admission[request_id] = error

    def shutdown(self, timeout: float = 5.0) -> None:
        self._draining = True  # (the replicas are Serve's to stop)

    async def request_status(self, request_id: str, tenant: str | None = None) -> Any:
        """A request's snapshots, from the replica that served it (the last PLACED_KEEP placed are
        remembered); None when this ingress did not place it or its replica is gone."""
        from cadence.fleet.state import replica_ids

        if request_id not in self._placed:  # (a client's X-Request-Id never shadows a response's id)
            request_id = self._serve_ids.get(request_id, request_id)
        replica = self._placed.get(request_id)
        if replica is None or replica not in replica_ids():
            return None
        note_replica(replica)
        try:
            return await asyncio.wait_for(
                self._status_handle(replica).request_status.remote(request_id, tenant, Target(replica)),
                REPLICA_CALL_TIMEOUT_S)
        except CadenceError:
            raise
        except Exception as e:  # the replica is restarting: what it knew went with it
            log.warning("replica %s: no request status (%s)", replica, type(e).__name__)
            return None

    def _status_handle(self, replica: str) -> Any:
        """The handle that reaches `replica` (by a `Target`)."""
        return self._handle

    def _metrics_targets(self) -> list[tuple[Any, str]]:
        """Every replica, as (a handle that reaches it, its id)."""
        from cadence.fleet.state import replica_ids

        return [(self._handle, rid) for rid in replica_ids()]

    # -- the replicas' metrics ----------------------------------------------------------------------

    async def render_metrics(self, exporter: PrometheusExporter) -> bytes:
        """The fleet's /metrics: this ingress's refusals and every replica's metrics, merged."""
        replicas = {}
        # One replica at a time: Serve's router may leave one of several calls pinned to
        # different replicas waiting (for seconds) while it routes the others.
        for handle, rid in self._metrics_targets():
            try:
                replicas[rid] = await asyncio.wait_for(handle.metrics.remote(Target(rid)), REPLICA_CALL_TIMEOUT_S)
            except Exception as e:  # a replica restarting: its last counters stand in for it (below)
                log.warning("replica %s: no metrics (%s)", rid, type(e).__name__)
        # A replica that died (or did not answer) keeps its last counters in the sums: a counter
        # that went down would read as a reset to Prometheus, and rate() would be wrong.
        self._last_metrics.update(replicas)
        retired = {rid: text for rid, text in self._last_metrics.items() if rid not in replicas}
        return merge_expositions(exporter.render()[0].decode(), replicas, retired).encode()

    async def replica_loads(self) -> dict[str, tuple[int, int]]:
        """Each replica's (requests in flight, requests running), by name."""
        loads = [await handle.load.remote(Target(rid)) for handle, rid in self._metrics_targets()]
        return {name: (in_flight, running) for name, in_flight, running in loads}
