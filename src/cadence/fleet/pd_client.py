"""`PDFleetClient`: the ingress of a fleet with separate prefill and decode pools.

A request (one prompt, one choice, more than one token) goes through four moves:

1. reserve: the decode pool's router (by load) picks a replica, which holds blocks for the
   prompt's full blocks (`PDReplica.reserve_kv`) and answers which it lacks. Too few free blocks:
   the request waits (visible in `GET /v1/requests/{id}` as waiting, `decode_kv_blocks`) and
   asks again, up to the transfer timeout, then is refused (429);
2. prefill: the prefill pool's router (prefix affinity) picks a replica, which runs the request
   for its first token (streamed to the client at once) and sends the lacking blocks' KV;
3. decode: the decode replica writes them, publishes them as cached prefix blocks and admits the
   request with its prompt and first token, which finds its prompt blocks as prefix hits;
4. its deltas stream back, counted as the client's request (prompt tokens, output tokens).

Faults: a prefill replica lost before its first token is retried once on the pool; KV that does
not come (the prefill replica lost after its first token, or the transfer timing out) is
recomputed by the decode side from the tokens; a decode replica lost before it admitted the
request is replaced once by another (which recomputes the prompt). A decode replica lost after
that ends the stream with an error. Reservations are released on every path, and a decode
engine drops one left unbound after its time to live.

Requests with several prompts or choices, structured outputs, or presence or frequency penalties
are served whole by the decode pool (`_hands_off`), as are those longer than its engines can hold
(which they refuse), and one-token requests by the prefill pool.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from cadence.boundary import RequestSnapshot, WaitInfo
from cadence.config import EngineConfig
from cadence.engine.kv_transfer import KVExport
from cadence.engine.output_processor import StreamDelta
from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.fleet.client import (
    BUSY_RETRY_AFTER_S,
    PLACED_KEEP,
    FleetClient,
    FleetStream,
    ReplicaLost,
    admission,
    admission_anywhere,
    check_request_id,
    handle_replicas,
    note_replica,
    ray_unavailable,
)
from cadence.fleet.pd import Reserved
from cadence.fleet.protocol import Admitted, Failed, GenerateCall, Target
from cadence.fleet.replica import ReplicaInfo
from cadence.request import DECODE_LEG, DEFAULT_POLICY, PREFILL_LEG, HandOff, RequestPolicy, SamplingParams
from cadence.server.engine_client import TRACE_CARRIER

log = logging.getLogger("cadence.fleet")

RESERVE_RETRY_S = (0.02, 0.05, 0.1, 0.2, 0.5)  # waits between asking for decode room again


class HandOffWait(str, Enum):
    """Why a request waits at the ingress of a disaggregated fleet."""

    DECODE_KV_BLOCKS = "decode_kv_blocks"  # no decode replica has room for its prompt's blocks yet


@dataclass
class _HandOff:
    """One request's progress through the hand-off (for its status while it has no decode engine)."""

    request_id: str
    policy: RequestPolicy
    num_prompt_tokens: int
    arrival: float
    trace_context: dict[str, str] | None = None  # the ingress span's, for both replicas' spans
    state: str = "waiting"
    waits: int = 0
    decode_replica: str | None = None
    prefill_replica: str | None = None
    first: list[int] = field(default_factory=list)


class PDFleetClient(FleetClient):
    """The HTTP layer's engine over two replica pools (see the module docstring). `decode` is the
    plain fleet client's handle (requests served whole go there)."""

    subscribe_streams = False  # (each request's streams are calls of their own: see docs/fleet.md)

    def __init__(self, prefill: Any, decode: Any, info: ReplicaInfo, tokenizer: Any, engine_config: EngineConfig,
                 transfer_timeout: float, max_held: int | None = None) -> None:
        super().__init__(decode, info, tokenizer, engine_config, max_held)
        self._prefill = prefill
        self._decode = decode
        self.transfer_timeout = transfer_timeout
        self._handoffs: dict[str, _HandOff] = {}
        # Requests handed over (the last PLACED_KEEP): their first tokens, which the decode replica
        # counts as prompt tokens.
        self._handed: collections.OrderedDict[str, int] = collections.OrderedDict()

    async def submit(self, prompts: Sequence[list[int]], params: SamplingParams, *, request_id: str,
                     policy: RequestPolicy = DEFAULT_POLICY, queue_status: bool = False) -> FleetStream:
        """As `FleetClient.submit`. A request handed from prefill to decode opens a stream that asked
        for its queue status with `state=unknown`: its place is in two queues, one after the other."""
        # A request no decode replica can ever hold goes there whole too: its engine refuses it at
        # once, naming the limit, where waiting for room would end in a 429 no retry gets past.
        if not _hands_off(prompts, params) or len(prompts[0]) + params.max_tokens > self.max_request_tokens:
            return await super().submit(prompts, params, request_id=request_id, policy=policy,
                                        queue_status=queue_status)
        if params.max_tokens <= 1:
            return await self._submit_to(self._prefill, prompts, params, request_id, policy, queue_status)
        if self._draining:
            raise CadenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        if request_id in self._live or request_id in self._handoffs:
            raise CadenceError(ErrorKind.INVALID_REQUEST, f"request id {request_id!r} is in use")
        check_request_id()
        self.check_room()
        h = _HandOff(request_id, policy, len(prompts[0]), time.monotonic(), TRACE_CARRIER.get())
        self._handoffs[request_id] = h
        self._remember_serve_id(request_id)  # (found by it while it waits, before any response byte)
        try:
            stream = await self._start(h, list(prompts[0]), params)
        except BaseException:
            self._handoffs.pop(request_id, None)
            raise
        self._live[request_id] = stream
        return stream

    def num_held(self) -> int:
        """Requests streaming, and those handed from prefill to decode (from their arrival)."""
        return len(self._live.keys() | self._handoffs.keys())

    async def _start(self, h: _HandOff, prompt: list[int], params: SamplingParams) -> PDStream:
        key = f"{h.request_id}/{uuid.uuid4().hex[:12]}"
        reserved = await self._reserve(h, key, prompt)
        h.decode_replica = reserved.replica
        call = GenerateCall((prompt,), replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
                            h.request_id, replace(h.policy, handoff=HandOff(PREFILL_LEG)),
                            self.chain(prompt, h.policy.cache_salt), h.trace_context)
        try:
            gen, first = await self._prefill_once(call, reserved.missing)
        except CadenceError:
            await self._release(reserved.replica, key)
            raise
        except BaseException:  # the client left: drop the reservation without waiting
            asyncio.ensure_future(self._release(reserved.replica, key))
            raise
        h.prefill_replica, h.state = first.replica, "prefilling"
        note_replica(f"prefill={first.replica}, decode={reserved.replica}")
        self._place(h.request_id, reserved.replica)
        return PDStream(self, h, prompt, params, key, reserved, gen)

    async def _reserve(self, h: _HandOff, key: str, prompt: list[int]) -> Reserved:
        """A decode replica's reservation for the prompt's blocks, waiting while none has room."""
        end = time.monotonic() + self.transfer_timeout
        if h.policy.deadline is not None:
            end = min(end, h.arrival + h.policy.deadline)
        while True:
            try:
                reserved: Reserved = await self._decode.reserve_kv.remote(key, prompt, h.policy.cache_salt,
                                                                          self.transfer_timeout)
            except Exception as e:
                raise self._unavailable(e) from None
            if reserved.missing is not None:
                return reserved
            h.waits += 1
            wait = RESERVE_RETRY_S[min(h.waits, len(RESERVE_RETRY_S)) - 1]
            if time.monotonic() + wait > end:
                if h.policy.deadline is not None and end < time.monotonic() + self.transfer_timeout:
                    raise CadenceError(ErrorKind.DEADLINE, "the request's deadline passed while it waited "
                                       "for room on a decode replica")
                raise AdmissionError(ErrorKind.QUEUE_FULL, "no decode replica had room for the prompt's KV "
                                     f"blocks within {self.transfer_timeout:g} s; retry later",
                                     retry_after=BUSY_RETRY_AFTER_S)
            await asyncio.sleep(wait)

    async def _prefill_once(self, call: GenerateCall, missing: tuple[int, ...] | None) -> tuple[Any, Admitted]:
        """The prefill stream and its admission; a replica lost before answering is retried once, and
        one that refuses it for a full queue on another prefill replica (`admission_anywhere`)."""
        def send(c: GenerateCall) -> Any:
            return self._prefill.options(stream=True).prefill.remote(c, missing)

        for attempt in (0, 1):
            try:
                return await admission_anywhere(send, call, "prefill replica", handle_replicas(self._prefill))
            except ReplicaLost as e:
                if attempt == 1:
                    raise
                log.warning("request %s: prefill replica lost (%s); trying another", call.request_id, e.message)
        raise AssertionError("unreachable")

    async def _release(self, replica: str, key: str) -> None:
        try:
            await asyncio.wait_for(self._decode.release_kv.remote(key, Target(replica)), 10.0)
        except Exception as e:  # the replica is gone (its blocks with it), or its engine expires the key
            log.info("releasing KV reservation %s on %s: %s", key, replica, type(e).__name__)

    @staticmethod
    def _unavailable(e: BaseException) -> CadenceError:
        if isinstance(e, CadenceError):
            return e
        return ray_unavailable(e) if _is_ray_error(e) else CadenceError(ErrorKind.INTERNAL, str(e))

    def _closed(self, stream: Any) -> None:
        super()._closed(stream)
        self._handoffs.pop(stream.request_id, None)

    # -- status and metrics ---------------------------------------------------------------------------

    async def request_status(self, request_id: str, tenant: str | None = None) -> Any:
        if request_id not in self._placed and request_id not in self._handoffs:
            request_id = self._serve_ids.get(request_id, request_id)  # (its X-Request-Id)
        h = self._handoffs.get(request_id)
        if h is not None and h.state != "decoding":
            if tenant is not None and h.policy.tenant != tenant:
                return None
            wait = WaitInfo(0, HandOffWait.DECODE_KV_BLOCKS) if h.state == "waiting" and h.waits else None  # type: ignore[arg-type]
            return (RequestSnapshot(request_id, h.policy.tenant, h.state, 0 if h.state == "waiting" else None, wait,
                                    h.num_prompt_tokens, 0, len(h.first), 0, h.policy.priority),)
        snaps = await super().request_status(request_id, tenant)
        n = self._handed.get(request_id, 0)
        if not snaps or not n:
            return snaps
        return tuple(replace(s, num_prompt_tokens=max(0, s.num_prompt_tokens - n),
                             num_computed_prompt_tokens=min(s.num_computed_prompt_tokens, s.num_prompt_tokens - n),
                             num_output_tokens=s.num_output_tokens + n) for s in snaps)

    def _handed_over(self, request_id: str, num_first: int) -> None:
        self._handed[request_id] = num_first
        while len(self._handed) > PLACED_KEEP:
            self._handed.popitem(last=False)

    def _metrics_targets(self) -> list[tuple[Any, str]]:
        from cadence.fleet.deploy import DECODE_NAME, PREFILL_NAME
        from cadence.fleet.state import deployment_replica_ids

        return ([(self._prefill, rid) for rid in deployment_replica_ids(PREFILL_NAME)]
                + [(self._decode, rid) for rid in deployment_replica_ids(DECODE_NAME)])

    def _status_handle(self, replica: str) -> Any:
        from cadence.fleet.deploy import PREFILL_NAME
        from cadence.fleet.state import deployment_replica_ids

        return self._prefill if replica in deployment_replica_ids(PREFILL_NAME) else self._decode


class PDStream(FleetStream):
    """The client's stream over the prefill replica's first token and the decode replica's rest."""

    def __init__(self, client: PDFleetClient, h: _HandOff, prompt: list[int], params: SamplingParams, key: str,
                 reserved: Reserved, prefill_gen: Any) -> None:
        super().__init__(prefill_gen, h.request_id, [h.request_id], client._closed)
        self._client = client
        self._h = h
        self._prompt = prompt
        self._params = params
        self._key = key
        self._reserved: Reserved | None = reserved
        self._phase = "prefill"
        self._num_cached = 0
        self._first_at: float | None = None  # when the first token came (the ingress's clock)
        self._prefill_time = 0.0  # from its first scheduling to its first token, on the prefill replica

    async def __anext__(self) -> StreamDelta:
        if self._phase in ("prefill", "handoff"):
            try:
                if self._phase == "prefill":
                    return await self._next_prefill()
                await self._hand_off()
            except Exception:
                if self._error is None:
                    raise
                await self._drop_reservation()  # (ended from outside: a drain, an abort)
                self._close()
                raise self._error from None
        return self._adjust(await super().__anext__())

    async def _next_prefill(self) -> StreamDelta:
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._phase = "done"
            self._close()
            raise CadenceError(ErrorKind.UNAVAILABLE, "the prefill replica ended the request early") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._drop_reservation()
            self._close()
            raise self._client._unavailable(e) from None
        if isinstance(item, Failed):
            await self._drop_reservation()
            self._close()
            raise CadenceError(ErrorKind(item.kind), item.message, retry_after=item.retry_after)
        assert isinstance(item, StreamDelta), type(item)
        if item.token_ids and self._first_at is None:
            self._first_at = time.monotonic()
        self._h.first.extend(item.token_ids)
        if item.finished and (item.finish_reason != "length" or item.error is not None):
            self._phase = "done"  # it stopped at its first token (EOS, a stop): nothing to decode
            await self._drop_reservation()
            self._close()
            return item
        if item.finished:
            self._num_cached = item.num_cached_tokens
            m = item.metrics
            if m is not None and m.first_token_time is not None and m.first_scheduled_time is not None:
                self._prefill_time = max(0.0, m.first_token_time - m.first_scheduled_time)
            self._phase = "handoff"
            return replace(item, finish_reason=None, stop_reason=None, metrics=None)
        return item

    async def _hand_off(self) -> None:
        """The prompt's KV to the decode replica, and the request's admission there."""
        h, client = self._h, self._client
        export = await self._receive_export()
        if self._error is not None:
            raise self._error
        h.state = "transferring"
        prompt = self._prompt + h.first
        params = replace(self._params, max_tokens=self._params.max_tokens - len(h.first),
                         min_tokens=max(0, self._params.min_tokens - len(h.first)))
        chain = client.chain(prompt, h.policy.cache_salt)
        for attempt in (0, 1):
            call = GenerateCall((prompt,), params, h.request_id, self._decode_policy(), chain, h.trace_context,
                                num_emitted=len(h.first))
            assert self._reserved is not None
            replica = self._reserved.replica
            gen = client._decode.options(stream=True).decode.remote(call, self._key, export, Target(replica))
            try:
                await asyncio.wait_for(admission(gen, "decode replica"), client.transfer_timeout)
            except asyncio.CancelledError:
                gen.cancel()
                await self._drop_reservation()
                raise
            except Exception as e:
                gen.cancel()
                await self._drop_reservation()
                lost = isinstance(e, ReplicaLost | TimeoutError)
                if isinstance(e, TimeoutError):
                    e = CadenceError(ErrorKind.UNAVAILABLE, f"decode replica {replica} did not take the request "
                                     f"within {client.transfer_timeout:g} s")
                if attempt == 0 and lost:
                    log.warning("request %s: decode replica %s failed before admitting it (%s); trying another",
                                h.request_id, replica, e)
                    self._key = f"{h.request_id}/{uuid.uuid4().hex[:12]}"
                    reserved = await client._reserve(h, self._key, self._prompt)
                    self._reserved = reserved
                    h.decode_replica = reserved.replica
                    client._place(h.request_id, reserved.replica)
                    export = KVExport((), None, 0, time.time())  # (the new replica recomputes what it lacks)
                    continue
                self._close()
                raise self._client._unavailable(e) from None
            break
        self._reserved = None  # (the decode engine holds it now, and releases it)
        self._gen = gen
        client._handed_over(h.request_id, len(h.first))
        h.state = "decoding"
        self._phase = "decode"

    def _decode_policy(self) -> RequestPolicy:
        """The request's policy for the decode replica, as of now: the deadline's time left, and the
        hand-off's times (the request's arrival, first scheduling and first token), by which the
        decode engine's metrics count the request as one engine's would."""
        h, now = self._h, time.monotonic()
        policy = h.policy
        if policy.deadline is not None:
            policy = replace(policy, deadline=max(0.0, policy.deadline - (now - h.arrival)))
        since_first = now - (self._first_at if self._first_at is not None else now)
        return replace(policy, handoff=HandOff(DECODE_LEG, len(h.first), now - h.arrival,
                                               since_first + self._prefill_time, since_first))

    async def _receive_export(self) -> KVExport:
        """The prefill replica's blocks; none if it is lost or slow (the decode side then recomputes)."""
        try:
            item = await asyncio.wait_for(self._gen.__anext__(), self._client.transfer_timeout)
        except asyncio.CancelledError:
            await self._drop_reservation()
            raise
        except Exception as e:
            log.warning("request %s: no KV from prefill replica %s (%s); the decode replica recomputes it",
                        self._h.request_id, self._h.prefill_replica, type(e).__name__)
            self._gen.cancel()
            return KVExport((), None, 0, time.time())
        if not isinstance(item, KVExport):
            return KVExport((), None, 0, time.time())
        return item

    def _adjust(self, delta: StreamDelta) -> StreamDelta:
        """The decode replica's counts as the client's request's: its first token came from the
        prefill replica, and its cached prompt tokens are those the prefill replica found."""
        n = len(self._h.first)
        if not (delta.finished or delta.num_prompt_tokens or delta.num_output_tokens):
            return delta
        return replace(delta, num_prompt_tokens=max(0, delta.num_prompt_tokens - n),
                       num_output_tokens=delta.num_output_tokens + n,
                       num_cached_tokens=min(self._num_cached, delta.num_cached_tokens or self._num_cached))

    async def _drop_reservation(self) -> None:
        """Release the decode reservation unless a decode engine holds the request (it releases then)."""
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            await self._client._release(reserved.replica, self._key)

    def fail(self, error: CadenceError) -> None:
        self._error = error
        self._gen.cancel()

    async def aclose(self) -> None:
        if self._phase in ("prefill", "handoff"):
            self._gen.cancel()
            await self._drop_reservation()
            self._close()
            return
        await super().aclose()


def _hands_off(prompts: Sequence[list[int]], params: SamplingParams) -> bool:
    """Whether the request goes through the hand-off, or is served whole by a decode replica: one
    that state from its first token would not follow across (several prompts or choices; a
    structured-output grammar's progress; presence and frequency penalties, which count output
    tokens only, and the first one would arrive as a prompt token)."""
    return (len(prompts) == 1 and params.n == 1 and params.structured_outputs is None
            and not params.presence_penalty and not params.frequency_penalty)


def _is_ray_error(e: BaseException) -> bool:
    from ray.exceptions import RayError

    return isinstance(e, RayError)
