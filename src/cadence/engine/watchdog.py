"""Stall detection for the engine loop: a step that never returns must not look like a healthy engine.

The engine thread writes a heartbeat (one clock reading) at the start of each turn of its loop,
and feeds each step's duration and token count to a `StepPace`. A daemon thread wakes a few times a
second; when work is waiting or running and the current turn has lasted longer than the limit, it
calls `on_stall` once and stops. The limit is the largest of

- the floor (`step_timeout`, 60 s by default),
- `STALL_FACTOR` x the longest step run so far,
- `STALL_FACTOR` x the time a full step (`max_num_batched_tokens` tokens) is expected to take, from
  the seconds per token of the largest step run so far (only steps of at least a sixteenth of a full
  one count: the fixed cost of a step of a few tokens, spread over them, says nothing of a full one),

so a long prefill on a slow machine is a step the engine expects, not a stall. Nothing here touches
the engine's state: what a stall means is `on_stall`'s business.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

STALL_FACTOR = 5.0  # a step this many times longer than the longest one expected is a stall


@dataclass
class StepPace:
    """The longest step the engine should expect, learnt from the steps it ran."""

    max_step_tokens: int  # the most tokens one step may compute (max_num_batched_tokens)
    longest: float = 0.0  # seconds, the longest step so far
    largest_tokens: int = 0  # tokens of the largest step so far
    largest_seconds: float = 0.0  # and its duration

    def observe(self, seconds: float, tokens: int) -> None:
        if seconds > self.longest:
            self.longest = seconds
        if tokens >= self.largest_tokens and tokens * 16 >= self.max_step_tokens:
            self.largest_tokens, self.largest_seconds = tokens, seconds

    def expected_longest(self) -> float:
        """Seconds the longest step should take: the longest seen, or a full step at the pace of the
        largest one seen (attention makes long steps cost more per token: STALL_FACTOR covers it)."""
        full = self.largest_seconds * self.max_step_tokens / self.largest_tokens if self.largest_tokens else 0.0
        return max(self.longest, full)


class Watchdog:
    """Calls `on_stall(running_for, limit)` once, from its own thread, when `has_work()` and the
    engine loop's current turn (since the last `beat`) has run longer than `limit()`."""

    def __init__(
        self,
        floor: float,
        pace: StepPace,
        has_work: Callable[[], bool],
        on_stall: Callable[[float, float], None],
    ) -> None:
        self.floor = floor
        self.pace = pace
        self.beat = time.monotonic()  # written by the engine thread at the start of every turn
        self._has_work = has_work
        self._on_stall = on_stall
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cadence-watchdog", daemon=True)

    @property
    def enabled(self) -> bool:
        return self.floor > 0

    def start(self) -> None:
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def limit(self) -> float:
        return max(self.floor, STALL_FACTOR * self.pace.expected_longest())

    def stalled(self, now: float) -> tuple[float, float] | None:
        """(seconds the current turn has run, the limit) when that is a stall, else None."""
        running, limit = now - self.beat, self.limit()
        if running > limit and self._has_work():
            return running, limit
        return None

    def _watch(self) -> None:
        interval = min(1.0, self.floor / 4)
        while not self._stop.wait(interval):
            hit = self.stalled(time.monotonic())
            if hit is not None:
                self._on_stall(*hit)
                return
