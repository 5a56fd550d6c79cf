"""Requests' deltas on one subscription per replica: the replica's outboxes and pumps, and the
ingress's demultiplexing into each request's stream (fleet/subscription.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray")  # (the fleet's extra: `make serve` / `make test` install it)

from cadence.config import EngineConfig  # noqa: E402
from cadence.engine.output_processor import StreamDelta  # noqa: E402
from cadence.errors import CadenceError, ErrorKind  # noqa: E402
from cadence.fleet import state  # noqa: E402
from cadence.fleet.client import FleetStream, ray_unavailable  # noqa: E402
from cadence.fleet.protocol import Admitted, GenerateCall, deltas_of  # noqa: E402
from cadence.fleet.replica import CadenceReplica  # noqa: E402
from cadence.fleet.subscription import ENDED, Ended, Outbox, Subscriptions, pump  # noqa: E402
from cadence.request import SamplingParams  # noqa: E402

TINY = {"num_kv_blocks": 128, "max_model_len": 256, "device": "cpu", "dtype": "float32", "num_threads": 1,
        "max_num_seqs": 8}


def _delta(rid: str, token: int, finished: bool = False) -> StreamDelta:
    return StreamDelta(rid, f"<{token}>", [token], finish_reason="length" if finished else None)


class _Replicas:
    """Each replica's subscription as the batches it yields (then an error, if given), and the
    aborts the ingress sends."""

    def __init__(self, batches: dict[str, list[dict[str, list[Any]]]], errors: dict[str, Exception] | None = None):
        self.batches = batches
        self.errors = errors or {}
        self.aborted: list[tuple[str, str]] = []
        self.release = asyncio.Event()  # the subscriptions yield once it is set

    async def open_stream(self, subscriber: str, replica: str) -> AsyncIterator[dict[str, list[Any]]]:
        await self.release.wait()
        for batch in self.batches.get(replica, []):
            yield batch
        if replica in self.errors:
            raise self.errors[replica]
        await asyncio.Event().wait()  # (open until cancelled, as a replica with streams)

    async def abort(self, replica: str, request_id: str) -> None:
        self.aborted.append((replica, request_id))

    def subscriptions(self) -> Subscriptions:
        return Subscriptions(self.open_stream, self.abort, ray_unavailable)


def _stream(subs: Subscriptions, request_id: str, replica: str, choices: int = 1) -> FleetStream:
    inbox = subs.inbox(request_id)
    subs.admitted(inbox, replica)
    ids = [request_id] if choices == 1 else [f"{request_id}-{k}" for k in range(choices)]
    return FleetStream(inbox, request_id, ids, lambda s: None)


async def _read(stream: FleetStream) -> list[StreamDelta]:
    return [d async for d in stream]


def test_each_stream_gets_its_own_deltas_in_order_from_shared_batches() -> None:
    a = [_delta("ra", 1), _delta("ra", 2), _delta("ra", 3, finished=True)]
    b = [_delta("rb", 7), _delta("rb", 8, finished=True)]
    replicas = _Replicas({"x": [{"ra": [a[0]]}, {"rb": [b[0]], "ra": [a[1]]}, {"rb": [b[1], ENDED]},
                                {"ra": [a[2], ENDED]}]})

    async def run() -> tuple[list[StreamDelta], list[StreamDelta]]:
        subs = replicas.subscriptions()
        sa, sb = _stream(subs, "ra", "x"), _stream(subs, "rb", "x")
        replicas.release.set()
        return await asyncio.gather(_read(sa), _read(sb))

    got_a, got_b = asyncio.run(run())
    assert got_a == a and got_b == b
    assert replicas.aborted == [] and not state.OPEN_STREAMS


def test_a_failed_subscription_fails_every_stream_of_its_replica_and_no_other() -> None:
    replicas = _Replicas({"x": [{"r1": [_delta("r1", 1)]}], "y": [{"r3": [_delta("r3", 5, finished=True), ENDED]}]},
                         errors={"x": RuntimeError("actor died")})

    async def run() -> list[Any]:
        subs = replicas.subscriptions()
        streams = [_stream(subs, "r1", "x"), _stream(subs, "r2", "x"), _stream(subs, "r3", "y")]
        replicas.release.set()
        return await asyncio.gather(*(_read(s) for s in streams), return_exceptions=True)

    r1, r2, r3 = asyncio.run(run())
    for failed in (r1, r2):
        assert isinstance(failed, CadenceError) and failed.kind == ErrorKind.UNAVAILABLE, failed
    assert r3 == [_delta("r3", 5, finished=True)]
    assert not state.OPEN_STREAMS


def test_a_subscription_that_is_never_answered_fails_its_streams() -> None:
    replicas = _Replicas({})  # (never released: the replica died before the subscription reached it)

    async def run() -> Any:
        subs = Subscriptions(replicas.open_stream, replicas.abort, ray_unavailable, connect_timeout=0.05)
        # (bounded: without the subscription's own timeout the stream would wait forever)
        return await asyncio.wait_for(asyncio.gather(_read(_stream(subs, "r1", "x")), return_exceptions=True), 5.0)

    [failed] = asyncio.run(run())
    assert isinstance(failed, CadenceError) and failed.kind == ErrorKind.UNAVAILABLE, failed
    assert not state.OPEN_STREAMS and not state.SUBSCRIPTIONS


def test_the_streams_of_a_subscription_never_answered_are_aborted_on_their_replica() -> None:
    # A replica alive but too slow to answer within the timeout would otherwise go on generating
    # the failed streams' tokens into an outbox nobody reads.
    replicas = _Replicas({})

    async def run() -> None:
        subs = Subscriptions(replicas.open_stream, replicas.abort, ray_unavailable, connect_timeout=0.05)
        streams = [_stream(subs, "r1", "x"), _stream(subs, "r2", "x", choices=2)]
        await asyncio.wait_for(asyncio.gather(*(_read(s) for s in streams), return_exceptions=True), 5.0)
        await asyncio.gather(*subs._aborts)

    asyncio.run(run())
    assert sorted(replicas.aborted) == [("x", "r1"), ("x", "r2")]


def test_a_subscription_refused_when_opened_fails_its_streams() -> None:
    def refused(subscriber: str, replica: str) -> Any:
        raise RuntimeError("the application is gone")  # (as Ray raises at .remote())

    async def run() -> Any:
        subs = Subscriptions(refused, _Replicas({}).abort, ray_unavailable)
        # (bounded: a reader that died before its try would leave the stream waiting forever)
        return await asyncio.wait_for(asyncio.gather(_read(_stream(subs, "r1", "x")), return_exceptions=True), 5.0)

    [failed] = asyncio.run(run())
    assert isinstance(failed, CadenceError) and failed.kind == ErrorKind.UNAVAILABLE, failed
    assert not state.OPEN_STREAMS and not state.SUBSCRIPTIONS


def test_closing_a_stream_early_aborts_it_on_its_replica_and_late_items_are_aborted_too() -> None:
    replicas = _Replicas({"x": [{"r1": [_delta("r1", 1)]}, {"gone": [_delta("gone", 2)]}]})

    async def run() -> None:
        subs = replicas.subscriptions()
        stream = _stream(subs, "r1", "x")
        left = subs.inbox("gone")  # its reader left before its admission came back
        subs.drop(left)
        replicas.release.set()
        assert (await stream.__anext__()).token_ids == [1]
        await stream.aclose()
        while len(replicas.aborted) < 2:
            await asyncio.sleep(0)  # (the aborts are sent by tasks of their own)

    asyncio.run(run())
    assert sorted(replicas.aborted) == [("x", "gone"), ("x", "r1")]
    assert not state.OPEN_STREAMS


def test_a_request_is_aborted_once_however_many_of_its_items_arrive_after_its_reader_left() -> None:
    # Until the abort reaches its replica, the engine goes on stepping the request: each of those
    # steps' batches must not send an abort of its own.
    batches: asyncio.Queue[dict[str, list[Any]]] = asyncio.Queue()
    aborted: list[tuple[str, str]] = []

    async def open_stream(subscriber: str, replica: str) -> AsyncIterator[dict[str, list[Any]]]:
        while True:
            yield await batches.get()

    async def abort(replica: str, request_id: str) -> None:
        aborted.append((replica, request_id))

    async def delivered() -> None:
        while not batches.empty():
            await asyncio.sleep(0)
        for _ in range(10):  # (the reader hands the last batch out, the abort tasks run)
            await asyncio.sleep(0)

    async def run() -> None:
        subs = Subscriptions(open_stream, abort, ray_unavailable)
        stream = _stream(subs, "r1", "x")
        left = subs.inbox("early")  # its reader left before its admission came back
        subs.drop(left)
        batches.put_nowait({"r1": [_delta("r1", 1)]})
        assert (await stream.__anext__()).token_ids == [1]
        await stream.aclose()
        for token in range(2, 6):
            batches.put_nowait({"r1": [_delta("r1", token)], "early": [_delta("early", token)]})
            await delivered()
        assert sorted(aborted) == [("x", "early"), ("x", "r1")]
        assert subs._aborted == {("x", "early"), ("x", "r1")}
        batches.put_nowait({"r1": [_delta("r1", 6), ENDED], "early": [ENDED]})
        await delivered()
        assert subs._aborted == set()  # (their ends came: nothing is kept for them)
        # The same id again later (a client's X-Request-Id reused) is aborted again when its reader leaves.
        again = _stream(subs, "r1", "x")
        await again.aclose()
        batches.put_nowait({"r1": [_delta("r1", 1)]})
        await delivered()

    asyncio.run(run())
    assert sorted(aborted) == [("x", "early"), ("x", "r1"), ("x", "r1")]


def test_an_outbox_holds_a_bounded_number_of_items_until_its_subscriber_connects() -> None:
    closed = asyncio.Event()

    async def items() -> AsyncIterator[int]:
        try:
            for i in range(10):
                yield i
        finally:
            closed.set()

    async def run(connected: bool) -> list[Any]:
        outbox = Outbox(limit=3)
        outbox.open("r")
        if connected:
            outbox.connect()
        await pump(items(), "r", outbox, wait_s=0.05)
        assert closed.is_set() and outbox.streams == set()
        batch = await outbox.take(linger=1.0)
        assert batch is not None
        return batch["r"]

    assert asyncio.run(run(connected=False)) == [0, 1, 2, ENDED]  # then it gave up and aborted
    assert asyncio.run(run(connected=True)) == [*range(10), ENDED]


def test_an_idle_outbox_ends_its_subscription() -> None:
    async def run() -> Any:
        outbox = Outbox()
        outbox.connect()
        return await outbox.take(linger=0.01)

    assert asyncio.run(run()) is None


def test_a_subscribed_call_answers_its_admission_and_its_deltas_come_on_the_subscription() -> None:
    replica = CadenceReplica(EngineConfig.from_options(**TINY), tiny=True)
    params = SamplingParams(n=2, max_tokens=4, ignore_eos=True, temperature=1.0, seed=3)

    async def run() -> tuple[list[Any], dict[str, list[Any]]]:
        sub = replica.subscribe("ingress-1")
        answers = [item async for item in replica.generate(
            GenerateCall(([5, 6, 7],), params, "a", subscriber="ingress-1"))]
        answers += [item async for item in replica.generate(
            GenerateCall(([8, 9],), SamplingParams(max_tokens=3, ignore_eos=True), "b", subscriber="ingress-1"))]
        got: dict[str, list[Any]] = {"a": [], "b": []}
        async for batch in sub:  # (it ends once both requests ended and it was idle a while)
            for rid, items in batch.items():
                got[rid].extend(items)
        return answers, got

    try:
        answers, got = asyncio.run(run())
    finally:
        replica.engine.shutdown(timeout=5.0)
    assert [type(a) for a in answers] == [Admitted, Admitted]
    for rid, tokens in (("a", 8), ("b", 3)):
        assert isinstance(got[rid][-1], Ended)
        deltas = [d for item in got[rid][:-1] for d in deltas_of(item)]
        assert sum(len(d.token_ids) for d in deltas) == tokens
    assert replica._outboxes == {} and replica._pumps == {}


def test_abort_ends_a_subscribed_request_on_the_replica() -> None:
    replica = CadenceReplica(EngineConfig.from_options(**TINY), tiny=True)

    async def run() -> list[Any]:
        sub = replica.subscribe("ingress-1")
        call = GenerateCall(([5, 6, 7],), SamplingParams(max_tokens=200, ignore_eos=True), "long",
                            subscriber="ingress-1")
        [_ async for _ in replica.generate(call)]
        assert await sub.__anext__() == {}  # (it answers at once)
        first = await sub.__anext__()
        await replica.abort("long")
        items = list(first["long"])
        async for batch in sub:
            items.extend(batch.get("long", []))
        return items

    try:
        items = asyncio.run(run())
        assert isinstance(items[-1], Ended)
        tokens = sum(len(d.token_ids) for item in items[:-1] for d in deltas_of(item))
        assert tokens < 200 and replica.engine.num_in_flight == 0
    finally:
        replica.engine.shutdown(timeout=5.0)


def test_the_router_counts_a_replicas_open_streams_and_not_its_subscriptions() -> None:
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    from cadence.fleet.router import CadenceRequestRouter
    from cadence.routing import ReplicaStats

    replica = SimpleNamespace(replica_id=ReplicaID("x", DeploymentID("CadenceReplica")),
                              routing_stats=ReplicaStats(0, 0, 64).to_dict())
    router = object.__new__(CadenceRequestRouter)  # (only its load arithmetic, without Serve)
    router._replica_queue_len_cache = {replica.replica_id: 1}  # Serve's count: the subscription alone
    state.subscription_opened("x")
    for _ in range(3):
        state.stream_opened("x")
    try:
        assert router._stats(replica, placed=1).load == 4  # three streaming, one being admitted
    finally:
        state.OPEN_STREAMS.clear()
        state.SUBSCRIPTIONS.clear()


def test_an_outbox_goes_once_the_streams_its_departed_subscriber_left_open_have_ended() -> None:
    replica = CadenceReplica(EngineConfig.from_options(**TINY), tiny=True)

    async def run() -> None:
        sub = replica.subscribe("ingress-1")
        call = GenerateCall(([5, 6, 7],), SamplingParams(max_tokens=200, ignore_eos=True), "long",
                            subscriber="ingress-1")
        [_ async for _ in replica.generate(call)]
        assert await sub.__anext__() == {}
        await sub.__anext__()  # the stream is under way
        await sub.aclose()  # the ingress went away with the stream open: its reader is cancelled
        for _ in range(200):  # the aborted pump ends on the engine's next step
            if not replica._pumps:
                break
            await asyncio.sleep(0.01)
        assert replica._pumps == {}
        assert replica._outboxes == {}

    try:
        asyncio.run(run())
        assert replica.engine.num_in_flight == 0
    finally:
        replica.engine.shutdown(timeout=5.0)


def test_an_outbox_waits_for_a_subscriber_that_has_not_connected_yet() -> None:
    replica = CadenceReplica(EngineConfig.from_options(**TINY), tiny=True)

    async def run() -> list[Any]:
        call = GenerateCall(([5, 6, 7],), SamplingParams(max_tokens=2, ignore_eos=True), "short",
                            subscriber="ingress-1")
        [_ async for _ in replica.generate(call)]
        for _ in range(200):  # the request ends before its subscriber connects
            if not replica._pumps:
                break
            await asyncio.sleep(0.01)
        assert "ingress-1" in replica._outboxes
        items: list[Any] = []
        async for batch in replica.subscribe("ingress-1"):
            items.extend(batch.get("short", []))
        return items

    try:
        items = asyncio.run(run())
        assert isinstance(items[-1], Ended)
        assert sum(len(d.token_ids) for item in items[:-1] for d in deltas_of(item)) == 2
    finally:
        replica.engine.shutdown(timeout=5.0)


def test_a_replica_prices_adaptive_drafts_with_the_profile_it_predicts_ttft_with() -> None:
    replica = CadenceReplica(EngineConfig.from_options(**TINY), tiny=True)
    try:
        predictor = replica.engine.predictor
        assert predictor is not None
        assert replica.engine.core.scheduler.step_cost == predictor.step_cost
    finally:
        replica.engine.shutdown(timeout=5.0)
