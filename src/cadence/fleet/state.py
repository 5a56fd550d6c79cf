"""Per-process state of the fleet's router, read by the ingress.

Serve ships the router class to the ingress by value, so the router's own module globals are
copies; state the ingress reads lives here, in a module both import by name.
"""

from __future__ import annotations

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
