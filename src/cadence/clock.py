"""Clocks: the engine reads time only through one of these, so the simulator can swap in virtual time."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class RealClock:
    """Monotonic wall time in seconds."""

    def now(self) -> float:
        return time.monotonic()


def unix_offset() -> float:
    """What to add to a `RealClock` reading to get Unix time (as `time.time()` gives it)."""
    return time.time() - time.monotonic()


class VirtualClock:
    """Time that moves only when told to: the simulator advances it by each step's modelled cost."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)
