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
