"""Per-process state of the fleet's router, read by the ingress.

Serve ships the router class to the ingress by value, so the router's own module globals are
copies; state the ingress reads lives here, in a module both import by name.
"""

from __future__ import annotations

from collections import Counter

from cadence.routing import OUTCOMES

REPLICA_IDS: set[str] = set()  # the replicas this process's fleet routers route to
DEPLOYMENT_REPLICAS: dict[str, set[str]] = {}  # the same, by deployment name


def replica_ids() -> list[str]:
    """The ids of the replicas this process's fleet router currently routes to (sorted)."""
    return sorted(REPLICA_IDS)


def set_deployment_replicas(deployment: str, ids: set[str]) -> None:
    """A router's replicas changed: record them for its deployment (and in the union)."""
    DEPLOYMENT_REPLICAS[deployment] = ids
    REPLICA_IDS.clear()
    REPLICA_IDS.update(*DEPLOYMENT_REPLICAS.values())


def deployment_replica_ids(deployment: str) -> list[str]:
    """The ids of one deployment's replicas (sorted)."""
    return sorted(DEPLOYMENT_REPLICAS.get(deployment, ()))


# This process's routing choices, by (deployment, `cadence.routing.Decision.outcome`): the ingress
# shows them on /metrics (`cadence:fleet_routed_requests_total`).
ROUTING_DECISIONS: Counter[tuple[str, str]] = Counter()
ROUTED_DEPLOYMENTS: set[str] = set()  # the deployments this process's ingress sends requests to


def routes_to(deployment: str) -> None:
    """The ingress sends requests to `deployment`: its counts are shown (at 0) before its first."""
    ROUTED_DEPLOYMENTS.add(deployment)


def routing_decided(deployment: str, outcome: str) -> None:
    ROUTING_DECISIONS[(deployment, outcome)] += 1


def routing_decisions() -> dict[tuple[str, str], int]:
    """The counts, with every outcome of every deployment routed to present (at 0 from the start, so
    rate() and alerts see them)."""
    deployments = ROUTED_DEPLOYMENTS | {d for d, _ in ROUTING_DECISIONS}
    return {(d, o): ROUTING_DECISIONS[(d, o)] for d in sorted(deployments) for o in OUTCOMES}


# This process's streams and subscriptions by replica id: the router counts a replica's streams
# itself (a subscribed stream is no ongoing Serve call), and subtracts the subscriptions from
# Serve's count of its calls.
OPEN_STREAMS: Counter[str] = Counter()
SUBSCRIPTIONS: Counter[str] = Counter()


def stream_opened(replica: str) -> None:
    OPEN_STREAMS[replica] += 1


def stream_closed(replica: str) -> None:
    _closed(OPEN_STREAMS, replica)


def subscription_opened(replica: str) -> None:
    SUBSCRIPTIONS[replica] += 1


def subscription_closed(replica: str) -> None:
    _closed(SUBSCRIPTIONS, replica)


def _closed(counts: Counter[str], replica: str) -> None:
    """One fewer for `replica`; a replica with none left is dropped (the router reads absence as 0)."""
    counts[replica] -= 1
    if counts[replica] <= 0:
        del counts[replica]
