"""The fleet router's count of its placements (`cadence:fleet_routed_requests_total`): once a
request, by what decided the choice Serve sent it on, however often Serve asks while every replica
is at its limit; a replica's info call is no placement. Driven without Serve: the router's own
methods, with stand-ins for Serve's pending request and replicas."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")  # (the fleet's extra: `make serve` / `make test` install it)

from ray.serve._private.common import DeploymentID  # noqa: E402
from ray.serve.request_router import ReplicaID  # noqa: E402

from cadence.fleet import state  # noqa: E402
from cadence.fleet.protocol import GenerateCall  # noqa: E402
from cadence.fleet.router import CadenceRequestRouter  # noqa: E402
from cadence.request import SamplingParams  # noqa: E402
from cadence.routing import ReplicaStats  # noqa: E402


def _replica(name: str, digest: frozenset[int] = frozenset()) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID("CadenceReplica")),
                           routing_stats=ReplicaStats(0, 0, 64, digest).to_dict())


def _pending(rid: str, *args: object) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=rid), future=asyncio.get_running_loop()
                           .create_future(), args=args)


def test_a_request_counts_once_when_sent_and_an_info_call_not_at_all() -> None:
    router = object.__new__(CadenceRequestRouter)  # (its own methods, without Serve's state)
    router._replica_queue_len_cache = {}
    router.initialize_state("prefix-affinity")
    chain = (11, 12, 13)
    a, b = _replica("a", frozenset(chain)), _replica("b")
    call = GenerateCall(([1, 2, 3],), SamplingParams(max_tokens=1), "req", chain=chain)

    async def run() -> None:
        sent = _pending("r1", call)
        for _ in range(3):  # Serve asks again while the replicas are at their limit
            [[first], _rest] = await router.choose_replicas([a, b], sent)
            assert first is a
        assert not state.ROUTING_DECISIONS  # nothing sent yet
        sent.future.set_result(a)
        info = _pending("r2")  # (a replica's info: no GenerateCall)
        await router.choose_replicas([a, b], info)
        info.future.set_result(b)
        dropped = _pending("r3", call)  # cancelled before Serve sent it
        await router.choose_replicas([a, b], dropped)
        dropped.future.cancel()
        await asyncio.sleep(0)  # (done callbacks run on the loop)

    state.ROUTING_DECISIONS.clear()
    try:
        asyncio.run(run())
        assert dict(state.ROUTING_DECISIONS) == {("", "prefix"): 1}
    finally:
        state.ROUTING_DECISIONS.clear()


def test_every_outcome_of_a_routed_deployment_shows_before_its_first_request() -> None:
    state.ROUTING_DECISIONS.clear()
    state.routes_to("CadencePrefill")
    try:
        counts = state.routing_decisions()
        assert {o for (d, o) in counts if d == "CadencePrefill"} == {"prefix", "diverted", "unbalanced", "no-prefix",
                                                                     "load"}
        assert all(n == 0 for n in counts.values())
    finally:
        state.ROUTED_DEPLOYMENTS.discard("CadencePrefill")


def _loaded(name: str, running: int, waiting: int, digest: frozenset[int] = frozenset()) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID("CadenceReplica")),
                           routing_stats=ReplicaStats(running, waiting, 64, digest).to_dict())


def test_a_request_is_held_while_every_replica_is_at_its_seats() -> None:
    router = object.__new__(CadenceRequestRouter)
    router._replica_queue_len_cache = {}
    router.initialize_state("prefix-affinity", seats=3)
    chain = (11, 12, 13)
    call = GenerateCall(([1, 2, 3],), SamplingParams(max_tokens=1), "req", chain=chain)

    async def run() -> None:
        full_a, full_b = _loaded("a", 2, 1, frozenset(chain)), _loaded("b", 1, 2)
        held = _pending("r1", call)
        held.routing_context = SimpleNamespace(should_backoff=False)
        assert await router.choose_replicas([full_a, full_b], held) == []
        assert held.routing_context.should_backoff  # (Serve pauses before it asks again)
        # A seat frees on b: the request goes there, though its prefix is cached on the full a.
        room_b = _loaded("b", 1, 1)
        assert await router.choose_replicas([full_a, room_b], held) == [[room_b], []]
        # A call to a named replica (its metrics, an abort) is never held.
        from cadence.fleet.protocol import Target
        named = _pending("r2", Target("a"))
        assert await router.choose_replicas([full_a, full_b], named) == [[full_a]]

    state.ROUTING_DECISIONS.clear()
    try:
        asyncio.run(run())
    finally:
        state.ROUTING_DECISIONS.clear()


def test_without_seats_a_full_fleet_still_routes() -> None:
    router = object.__new__(CadenceRequestRouter)
    router._replica_queue_len_cache = {}
    router.initialize_state("least-loaded")
    call = GenerateCall(([1, 2, 3],), SamplingParams(max_tokens=1), "req")

    async def run() -> list:
        return await router.choose_replicas([_loaded("a", 5, 5), _loaded("b", 5, 6)], _pending("r1", call))

    [[first], [second]] = asyncio.run(run())
    assert first.replica_id.unique_id == "a" and second.replica_id.unique_id == "b"
    state.ROUTING_DECISIONS.clear()
