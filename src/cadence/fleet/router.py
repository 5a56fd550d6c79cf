"""The fleet's Ray Serve request router: `cadence.routing` (the function `cadence sim` routes with)
over the replicas' published stats.

Each replica publishes a `ReplicaStats` through Serve's `record_routing_stats` every
`STATS_PERIOD_S`. A replica's load is Serve's own count of its ongoing calls where the router
has one (less this process's subscriptions to it), else the published running + waiting, and
never less than the requests this router placed there and has not seen admitted plus this
process's streams open there: a subscribed request's call ends with its admission, so Serve
stops counting it while it streams. Serve routes a burst's requests concurrently, each choice
made before the previous ones are sent (when Serve's count and the stats first show them), so
only the router's own count of its placements keeps a burst from landing on one replica.

The chosen replica comes first; the others follow, least loaded first, should it refuse (Serve's
`max_ongoing_requests`). Replicas a `GenerateCall` names in `avoid` (they refused it for a full
queue) are left out while any other remains.

Each request's placement is counted (`state.routing_decided`, the ingress's
`cadence:fleet_routed_requests_total`) once Serve sends it, by what decided the choice it went on:
Serve asks again while every replica is at its limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cadence.fleet import state
from cadence.fleet.protocol import GenerateCall, Target
from cadence.routing import ReplicaStats, Router, RoutingConfig

log = logging.getLogger("cadence.fleet")
T = TypeVar("T")


class CadenceRequestRouter(RequestRouter):
    """Serve calls `initialize_state` with the deployment's `request_router_kwargs`: `policy` (one
    of cadence.routing.ROUTERS) and optionally the `RoutingConfig` fields."""

    def initialize_state(self, policy: str = "prefix-affinity", **cfg: Any) -> None:
        self._router = Router(policy, RoutingConfig(**cfg))
        # Serve's internal request id -> the replica this router placed it on, until it finishes.
        self._placed: dict[str, ReplicaID] = {}
        self._watched: dict[str, asyncio.Future] = {}  # the request's pending future, watched
        # Serve's internal request id -> what decided its latest choice, counted once it is sent.
        self._outcome: dict[str, str] = {}

    def _deployment_name(self) -> str:
        return getattr(getattr(self, "_deployment_id", None), "name", "")

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        state.set_deployment_replicas(self._deployment_name(), {r.replica_id.unique_id for r in replicas})

    def _stats(self, replica: RunningReplica, placed: int) -> ReplicaStats:
        published = ReplicaStats.from_dict(replica.routing_stats or {})
        rid = replica.replica_id.unique_id
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:  # (Serve's count of calls there: this process's subscriptions are no load)
            queued = max(0, queued - state.SUBSCRIPTIONS[rid])
        load = max(published.load if queued is None else queued, placed + state.OPEN_STREAMS[rid])
        running = min(published.running, load)
        return ReplicaStats(running, load - running, published.free_blocks, published.digest)

    def _note_placed(self, pending: PendingRequest | None, replica: RunningReplica) -> None:
        """Count `pending` on `replica` now; the replica Serve sends it to (its future's result)
        replaces the guess, and a request that is never sent (cancelled) is dropped."""
        if pending is None:
            return
        rid = pending.metadata.internal_request_id
        self._placed[rid] = replica.replica_id
        future = pending.future
        if self._watched.get(rid) is not future:  # (a retried request gets a new future)
            self._watched[rid] = future
            future.add_done_callback(lambda f: self._settled(rid, f))

    def _settled(self, rid: str, future: asyncio.Future) -> None:
        current = self._watched.get(rid) is future
        if current:
            del self._watched[rid]
        if future.cancelled() or future.exception() is not None:
            self._placed.pop(rid, None)
            if current:
                self._outcome.pop(rid, None)
        else:
            self._placed[rid] = future.result().replica_id
            # Counted here, once a request: Serve asks again while every replica is at its limit.
            if (outcome := self._outcome.pop(rid, None)) is not None:
                state.routing_decided(self._deployment_name(), outcome)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        placed = getattr(self, "_placed", {})
        if placed.get(internal_request_id) == replica_id:
            del placed[internal_request_id]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if not hasattr(self, "_router"):  # (Serve calls initialize_state; a bare instance defaults)
            self.initialize_state()
        target = _arg_of(pending_request, Target)
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target.replica_id]]
        call = _arg_of(pending_request, GenerateCall)
        chain = call.chain if call is not None else ()
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if call is not None and call.avoid:
            replicas = [r for r in replicas if r.replica_id.unique_id not in call.avoid] or replicas
        # (Not this request's own earlier placement: Serve asks again for it while every replica is
        # at its limit, and it would read as load on the replica it was to go to.)
        rid = pending_request.metadata.internal_request_id if pending_request is not None else None
        placed = Counter(r for k, r in self._placed.items() if k != rid)
        stats = [self._stats(r, placed[r.replica_id]) for r in replicas]
        decision = self._router.decide(chain, stats, [r.replica_id.unique_id for r in replicas])
        best = decision.replica
        self._note_placed(pending_request, replicas[best])
        if call is not None:  # a request (a replica's info or metrics is no placement to count)
            if rid is None:
                state.routing_decided(self._deployment_name(), decision.outcome)
            else:
                self._outcome[rid] = decision.outcome
        rest = sorted((i for i in range(len(replicas)) if i != best), key=lambda i: stats[i].load)
        return [[replicas[best]], [replicas[i] for i in rest]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "_router"):
            self._router.forget_replica(replica_id.unique_id)
            for rid in [rid for rid, r in self._placed.items() if r == replica_id]:
                del self._placed[rid]


def _arg_of(pending: PendingRequest | None, cls: type[T]) -> T | None:
    for arg in pending.args if pending is not None else ():
        if isinstance(arg, cls):
            return arg
    return None
