"""Per-process state of the fleet's router, read by the ingress.

Serve ships the router class to the ingress by value, so the router's own module globals are
copies; state the ingress reads lives here, in a module both import by name.
"""

from __future__ import annotations

REPLICA_IDS: set[str] = set()  # the replicas this process's fleet router routes to


def replica_ids() -> list[str]:
    """The ids of the replicas this process's fleet router currently routes to (sorted)."""
    return sorted(REPLICA_IDS)
