"""Routers: which replica a new request goes to, seen from a load balancer in front of N engines.

A router sees what a real balancer can: each replica's count of requests it has sent and not yet
seen finish (open connections), and the request's prefix-group ids. It never looks inside an
engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cadence.workload import WorkloadRequest

ROUTERS = ("round-robin", "least-loaded", "prefix-affinity")
_MIX = 0x9E3779B97F4A7C15  # 64-bit multiplicative hash: nearby block ids land on different replicas


class Router(Protocol):
    def choose(self, req: WorkloadRequest, outstanding: Sequence[int]) -> int:
        """Index of the replica for `req`; `outstanding[i]` is replica i's open requests."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: WorkloadRequest, outstanding: Sequence[int]) -> int:
        i = self._next % len(outstanding)
        self._next = i + 1
        return i


class LeastLoaded:
    """Fewest open requests; ties go round robin so an idle fleet still spreads the load."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: WorkloadRequest, outstanding: Sequence[int]) -> int:
        # The first replica with the fewest, looking from `_next` on and wrapping around.
        start = self._next % len(outstanding)
        least = min(outstanding)
        try:
            best = outstanding.index(least, start)
        except ValueError:
            best = outstanding.index(least)
        self._next = best + 1
        return best


class PrefixAffinity:
    """Requests with the same leading prefix block go to the same replica, where that prefix is
    already cached; requests without one go to the least loaded. With `max_imbalance`, a replica
    holding more than that many times the mean load sheds affinity traffic to the least loaded."""

    def __init__(self, max_imbalance: float | None = None) -> None:
        self._fallback = LeastLoaded()
        self.max_imbalance = max_imbalance

    @staticmethod
    def home(block_id: int, n: int) -> int:
        return (((block_id * _MIX) & 0xFFFFFFFFFFFFFFFF) >> 32) % n

    def choose(self, req: WorkloadRequest, outstanding: Sequence[int]) -> int:
        if not req.prefix_group:
            return self._fallback.choose(req, outstanding)
        i = self.home(req.prefix_group[0], len(outstanding))
        if self.max_imbalance is not None:
            mean = sum(outstanding) / len(outstanding)
            if outstanding[i] > self.max_imbalance * max(mean, 1.0):
                return self._fallback.choose(req, outstanding)
        return i


def make_router(name: str) -> Router:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-affinity":
        return PrefixAffinity()
    raise ValueError(f"router: expected one of {ROUTERS}, got {name!r}")
