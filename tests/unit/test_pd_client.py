"""The disaggregated fleet's ingress (fleet/pd_client.py) over stand-ins for the two pools' Serve
handles: waiting for decode room (and showing it), releasing reservations, retrying a lost prefill
replica, counting the request as the client's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")  # (the fleet's extra: `make serve` / `make test` install it)

from ray.exceptions import ActorDiedError  # noqa: E402

from cadence.config import EngineConfig  # noqa: E402
from cadence.engine.kv_transfer import KVExport  # noqa: E402
from cadence.engine.output_processor import StreamDelta  # noqa: E402
from cadence.errors import AdmissionError, CadenceError, ErrorKind  # noqa: E402
from cadence.fleet.pd import Reserved  # noqa: E402
from cadence.fleet.pd_client import PDFleetClient  # noqa: E402
from cadence.fleet.protocol import Admitted, Refused  # noqa: E402
from cadence.fleet.replica import ReplicaInfo  # noqa: E402
from cadence.request import SamplingParams  # noqa: E402

PROMPT = list(range(100, 140))  # 2 full blocks and 8 tokens


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Gen:
    """A Serve streaming response: items (an exception is raised in its place)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self) -> _Gen:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakePools:
    def __init__(self, refusals: int = 0, prefill_failures: int = 0, prefill_refuses: bool = False) -> None:
        self.refusals = refusals
        self.prefill_failures = prefill_failures
        self.prefill_refuses = prefill_refuses
        self.reserved: list[str] = []
        self.released: list[str] = []
        self.decode_calls: list[Any] = []
        self.prefill_calls = 0
        self.prefill_seen: list[Any] = []  # the prefill calls' GenerateCalls
        self.refused = asyncio.Event()  # set once a reservation was refused
        self.status_asked: list[str] = []

    # the decode pool
    async def _reserve(self, key: str, prompt: list[int], salt: str | None, ttl: float) -> Reserved:
        if self.refusals:
            self.refusals -= 1
            self.refused.set()
            return Reserved("d1", None, 0)
        self.reserved.append(key)
        return Reserved("d1", (0, 1), 50)

    async def _release(self, key: str, target: Any) -> bool:
        self.released.append(key)
        return True

    def _decode(self, call: Any, key: str, export: KVExport, target: Any) -> _Gen:
        self.decode_calls.append((call, key, export, target))
        n = call.params.max_tokens
        deltas = [StreamDelta(call.request_id, "x", [7]) for _ in range(n - 1)]
        deltas.append(StreamDelta(call.request_id, "x", [7], finish_reason="length",
                                  num_prompt_tokens=len(call.prompts[0]), num_cached_tokens=32,
                                  num_output_tokens=n))
        return _Gen([Admitted("d1"), *deltas])

    async def _status(self, request_id: str, tenant: str | None, target: Any) -> Any:
        from cadence.boundary import RequestSnapshot

        self.status_asked.append(request_id)  # (the decode replica counts the first token as a prompt token)
        return (RequestSnapshot(request_id, None, "finished", None, None, len(PROMPT) + 1, len(PROMPT) + 1, 3, 0, 0),)

    # the prefill pool
    def _prefill(self, call: Any, missing: Any) -> _Gen:
        self.prefill_calls += 1
        self.prefill_seen.append(call)
        if self.prefill_failures:
            self.prefill_failures -= 1
            return _Gen([ActorDiedError()])
        if self.prefill_refuses:
            return _Gen([Refused("queue_full", "full", None, 1.0, True, "p1")])
        first = StreamDelta(call.request_id, "a", [5], finish_reason="length", num_prompt_tokens=len(PROMPT),
                            num_cached_tokens=16, num_output_tokens=1)
        return _Gen([Admitted("p1"), first, KVExport((0, 1), None, 2, 0.0)])

    def handles(self) -> tuple[Any, Any]:
        pools = self

        class Prefill:
            def options(self, **_: Any) -> Any:
                return self

            prefill = _Call(pools._prefill)

        class Decode:
            def options(self, **_: Any) -> Any:
                return self

            reserve_kv = _Call(pools._reserve)
            release_kv = _Call(pools._release)
            decode = _Call(pools._decode)
            request_status = _Call(pools._status)

        return Prefill(), Decode()


def _client(pools: FakePools, timeout: float = 5.0) -> PDFleetClient:
    prefill, decode = pools.handles()
    info = ReplicaInfo("tiny", 1024, 1024, 1000, 16, "sha256")
    return PDFleetClient(prefill, decode, info, tokenizer=None, engine_config=EngineConfig.from_options(),
                         transfer_timeout=timeout)


async def _collect(stream: Any) -> list[StreamDelta]:
    return [d async for d in stream]


def test_a_request_waits_for_decode_room_visibly_then_counts_as_one_request() -> None:
    async def scenario():
        pools = FakePools(refusals=3)
        client = _client(pools)
        task = asyncio.ensure_future(client.submit([PROMPT], SamplingParams(max_tokens=4), request_id="r1"))
        await pools.refused.wait()  # (the client now waits before asking again)
        status = await client.request_status("r1")
        other_tenant = await client.request_status("r1", tenant="someone-else")
        deltas = await _collect(await task)
        return pools, status, other_tenant, deltas

    pools, status, other_tenant, deltas = asyncio.run(scenario())
    [snap] = status
    assert snap.state == "waiting" and snap.wait.reason.value == "decode_kv_blocks"
    assert other_tenant is None
    assert [t for d in deltas for t in d.token_ids] == [5, 7, 7, 7]
    assert deltas[0].finish_reason is None  # the prefill replica's max_tokens=1 is not the request's end
    final = deltas[-1]
    assert final.finish_reason == "length" and final.num_output_tokens == 4
    assert final.num_prompt_tokens == len(PROMPT) and final.num_cached_tokens == 16
    [(call, key, export, target)] = pools.decode_calls
    assert call.prompts[0] == PROMPT + [5] and call.params.max_tokens == 3 and target.replica_id == "d1"
    assert export.positions == (0, 1) and pools.reserved == [key] and pools.released == []



def test_a_request_is_found_by_the_id_serves_proxy_gave_it_while_it_waits_and_after(monkeypatch) -> None:
    """Serve's proxy names each request (the client's X-Request-Id, else its own id): the id a client
    that is still waiting for its response's first byte has."""
    from cadence.boundary import RequestSnapshot
    from cadence.fleet import client as fleet_client
    from cadence.fleet import state

    monkeypatch.setattr(state, "replica_ids", lambda: ["d1"])

    async def scenario():
        pools = FakePools(refusals=3)
        client = _client(pools)

        async def submit() -> Any:
            fleet_client._REPLICA_SLOT.set({"serve_id": "my-id"})  # (what the middleware does per request)
            return await client.submit([PROMPT], SamplingParams(max_tokens=4), request_id="r1")

        task = asyncio.ensure_future(submit())
        await pools.refused.wait()
        waiting = await client.request_status("my-id")
        await _collect(await task)
        after = await client.request_status("my-id")
        return waiting, after, pools.status_asked

    waiting, after, asked = asyncio.run(scenario())
    assert waiting is not None and waiting[0].request_id == "r1" and waiting[0].state == "waiting"
    assert after is not None and asked == ["r1"]
    assert isinstance(after[0], RequestSnapshot) and after[0].num_output_tokens == 4


def test_both_replicas_get_the_ingress_spans_trace_context() -> None:
    """Each replica's span of the request is a child of the ingress's: the context the HTTP layer
    sets for the submit goes with the prefill call and, later, the decode call."""
    from cadence.server.engine_client import TRACE_CARRIER

    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    pools = FakePools()
    client = _client(pools)

    async def scenario() -> list[StreamDelta]:
        token = TRACE_CARRIER.set(carrier)
        try:
            stream = await client.submit([PROMPT], SamplingParams(max_tokens=4), request_id="r1")
        finally:
            TRACE_CARRIER.reset(token)  # (as the HTTP layer does: the rest streams without it)
        return await _collect(stream)

    asyncio.run(scenario())
    [prefill_call] = pools.prefill_seen
    [(decode_call, _, _, _)] = pools.decode_calls
    assert prefill_call.trace_context == carrier and decode_call.trace_context == carrier

def test_a_prefill_replica_lost_before_answering_is_retried_once() -> None:
    pools = FakePools(prefill_failures=1)
    deltas = asyncio.run(_collect_submit(pools))
    assert pools.prefill_calls == 2 and [t for d in deltas for t in d.token_ids] == [5, 7, 7, 7]

    pools = FakePools(prefill_failures=2)
    with pytest.raises(CadenceError) as e:
        asyncio.run(_collect_submit(pools))
    assert e.value.kind == ErrorKind.UNAVAILABLE and pools.prefill_calls == 2
    assert pools.released == pools.reserved and len(pools.released) == 1  # the reservation went back


def test_a_prefill_refusal_releases_the_reservation_and_no_room_is_a_429() -> None:
    pools = FakePools(prefill_refuses=True)
    with pytest.raises(AdmissionError) as e:
        asyncio.run(_collect_submit(pools))
    assert e.value.kind == ErrorKind.QUEUE_FULL and pools.released == pools.reserved != []

    pools = FakePools(refusals=10**6)
    with pytest.raises(AdmissionError) as e:
        asyncio.run(_collect_submit(pools, timeout=0.3))
    assert e.value.kind == ErrorKind.QUEUE_FULL and "decode replica" in str(e.value) and e.value.retry_after
    assert pools.prefill_calls == 0  # nothing was prefilled for a request with nowhere to decode


async def _collect_submit(pools: FakePools, timeout: float = 5.0) -> list[StreamDelta]:
    client = _client(pools, timeout)
    return await _collect(await client.submit([PROMPT], SamplingParams(max_tokens=4), request_id="r"))


class _Hangs:
    """A prefill stream whose KV never comes after the first token (until it is cancelled)."""

    def __init__(self, first: list[Any]) -> None:
        self.items = list(first)
        self.cancelled = False
        self.waiting = asyncio.Event()  # set once a reader waits for the KV
        self._cancel = asyncio.Event()

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        self.waiting.set()
        await self._cancel.wait()
        raise RuntimeError("the call was cancelled")  # (as a cancelled Serve call ends its reader)

    def cancel(self) -> None:
        self.cancelled = True
        self._cancel.set()


def test_a_decode_replica_lost_or_silent_before_admitting_is_replaced_once_then_a_503() -> None:
    pools = FakePools()
    exports: list[KVExport] = []
    answer = pools._decode

    def decode(call: Any, key: str, export: KVExport, target: Any) -> Any:
        exports.append(export)
        return _Gen([ActorDiedError()]) if len(exports) == 1 else answer(call, key, export, target)

    pools._decode = decode  # type: ignore[method-assign]
    deltas = asyncio.run(_collect_submit(pools))
    assert [t for d in deltas for t in d.token_ids] == [5, 7, 7, 7]
    assert len(pools.reserved) == 2 and pools.released == pools.reserved[:1]  # a new reservation for the new one
    assert exports[0].positions == (0, 1) and exports[1].positions == ()  # (it recomputes the prompt)

    pools = FakePools()
    pools._decode = lambda call, key, export, target: _Hangs([])  # type: ignore[method-assign]
    with pytest.raises(CadenceError) as e:
        asyncio.run(_collect_submit(pools, timeout=0.3))
    assert e.value.kind == ErrorKind.UNAVAILABLE and "did not take the request within 0.3 s" in e.value.message
    assert len(pools.reserved) == 2 and pools.released == pools.reserved

def test_kv_that_does_not_come_in_time_is_recomputed_by_the_decode_replica() -> None:
    pools = FakePools()
    hanging: list[_Hangs] = []

    def prefill(call: Any, missing: Any) -> _Hangs:
        first = StreamDelta(call.request_id, "a", [5], finish_reason="length", num_prompt_tokens=len(PROMPT),
                            num_output_tokens=1)
        hanging.append(_Hangs([Admitted("p1"), first]))
        return hanging[-1]

    pools._prefill = prefill  # type: ignore[method-assign]
    deltas = asyncio.run(_collect_submit(pools, timeout=0.3))
    assert [t for d in deltas for t in d.token_ids] == [5, 7, 7, 7]
    [(_, _, export, _)] = pools.decode_calls
    assert export.positions == () and export.data is None  # nothing arrived: the decode side computes it
    assert hanging[0].cancelled


def test_a_request_ended_from_outside_during_the_hand_off_gets_that_error_and_releases_its_blocks() -> None:
    """A drain (or abort) while the KV is on its way: the client's error, not a decode."""
    pools = FakePools()
    streams: list[_Hangs] = []

    def prefill(call: Any, missing: Any) -> _Hangs:
        first = StreamDelta(call.request_id, "a", [5], finish_reason="length", num_prompt_tokens=len(PROMPT),
                            num_output_tokens=1)
        streams.append(_Hangs([Admitted("p1"), first]))
        return streams[-1]

    pools._prefill = prefill  # type: ignore[method-assign]

    async def scenario() -> None:
        client = _client(pools, timeout=30.0)
        stream = await client.submit([PROMPT], SamplingParams(max_tokens=4), request_id="r")
        first = await stream.__anext__()
        assert first.token_ids == [5]
        waiting = asyncio.ensure_future(stream.__anext__())
        await streams[0].waiting.wait()
        client.abort_all(CadenceError(ErrorKind.UNAVAILABLE, "the server shut down"))
        with pytest.raises(CadenceError, match="shut down"):
            await waiting
        assert client.num_in_flight == 0

    asyncio.run(scenario())
    assert pools.decode_calls == [] and pools.released == pools.reserved != []


@pytest.mark.parametrize("params,prompts,pool", [
    (SamplingParams(max_tokens=4, n=2), [PROMPT], "decode"),
    (SamplingParams(max_tokens=4), [PROMPT, PROMPT], "decode"),
    (SamplingParams(max_tokens=4, frequency_penalty=0.5), [PROMPT], "decode"),
    (SamplingParams(max_tokens=1), [PROMPT], "prefill"),
    # more than a decode replica can ever hold (max_request_tokens 1024): its engine refuses it at
    # once (400), where waiting for room would end in a 429 no retry gets past
    (SamplingParams(max_tokens=1024 - len(PROMPT) + 1), [PROMPT], "decode"),
])
def test_requests_whose_state_would_not_follow_are_served_whole(params, prompts, pool) -> None:
    pools = FakePools()
    whole: list[str] = []

    def generate(name: str):
        def call(c: Any) -> _Gen:
            whole.append(name)
            return _Gen([Admitted(name), StreamDelta(c.request_id, "a", [5], finish_reason="length")])
        return call

    prefill, decode = pools.handles()
    prefill.generate = _Call(generate("prefill"))
    decode.generate = _Call(generate("decode"))
    client = PDFleetClient(prefill, decode, ReplicaInfo("tiny", 1024, 1024, 1000, 16, "sha256"), None,
                           EngineConfig.from_options(), 5.0)

    async def scenario() -> None:
        await client.submit(prompts, params, request_id="r")

    asyncio.run(scenario())
    assert whole == [pool] and pools.reserved == [] and pools.prefill_calls == 0
