"""The fleet's Ray Serve request router: `cadence.routing` (the function `cadence sim` routes with)
over the replicas' published stats.

Each replica publishes a `ReplicaStats` through Serve's `record_routing_stats` every
`STATS_PERIOD_S`. A request's load on a replica is taken from Serve's own count of its ongoing
requests where the router has one (it counts its own sends at once), else from the published
running + waiting. The chosen replica comes first; the others follow, least loaded first, should
it refuse (Serve's `max_ongoing_requests`).
"""

from __future__ import annotations

import logging
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

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        deployment = getattr(getattr(self, "_deployment_id", None), "name", "")
        state.set_deployment_replicas(deployment, {r.replica_id.unique_id for r in replicas})

    def _stats(self, replica: RunningReplica) -> ReplicaStats:
        published = ReplicaStats.from_dict(replica.routing_stats or {})
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        if queued is None:
            return published
        running = min(published.running, queued)
        return ReplicaStats(running, queued - running, published.free_blocks, published.digest)

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
        stats = [self._stats(r) for r in replicas]
        best = self._router.route(chain, stats, [r.replica_id.unique_id for r in replicas])
        rest = sorted((i for i in range(len(replicas)) if i != best), key=lambda i: stats[i].load)
        return [[replicas[best]], [replicas[i] for i in rest]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "_router"):
            self._router.forget_replica(replica_id.unique_id)


def _arg_of(pending: PendingRequest | None, cls: type[T]) -> T | None:
    for arg in pending.args if pending is not None else ():
        if isinstance(arg, cls):
            return arg
    return None
