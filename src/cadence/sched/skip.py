"""The scheduler's side of steps run all at once: what a driver that applies several planned
steps without `schedule` and `update` (the simulator's fast-forward, sim/fast_forward.py) reads
of the scheduler, and the bookkeeping of those steps. The decisions stay in the scheduler; the
driver calls its `chunk`, `eligible`, `stop_status` and `finish`.

`SkippedSteps` is a base of `Scheduler`; the fast-forward's `StretchScheduler` protocol names
everything it uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cadence.boundary import IterationStats, RequestDelta


class SkippedSteps:
    # The scheduler's state read and changed here (set by `Scheduler.__init__`).
    last_decoded: list[str]
    _step: int
    _now: float
    _num_live_tokens: int
    _deadlines: list[tuple[float, str]]
    _pending_deltas: list[RequestDelta]
    _finished_ids: list[str]
    _preempted_ids: list[str]
    _stats: IterationStats
    _close_stats: Callable[[], None]

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def next_deadline(self) -> float:
        """The earliest pending deadline (inf if none)."""
        return self._deadlines[0][0] if self._deadlines else math.inf

    @property
    def has_pending_deltas(self) -> bool:
        """Whether finishes decided between steps (evictions, deadlines) wait to go out."""
        return bool(self._pending_deltas)

    @property
    def open_stats(self) -> IterationStats:
        """The counters of the step in progress."""
        return self._stats

    def forget_finished(self) -> None:
        """A step's output carried the ids of the requests finished so far."""
        self._finished_ids.clear()

    def skip_steps(self, num_steps: int, now: float, num_computed: int) -> None:
        """`num_steps` steps, the last starting at `now`, ran outside `schedule` and `update`,
        computing `num_computed` tokens; the first one's output carried the ids pending."""
        self._num_live_tokens += num_computed
        self._step += num_steps
        self._now = now
        self._finished_ids.clear()
        self._preempted_ids.clear()

    def close_skipped_steps(self, went_on: list[str], num_sampled: int) -> None:
        """Close the skipped steps' stats as one record, `num_sampled` tokens generated; `went_on`
        is the last one's `last_decoded`."""
        self.last_decoded = went_on
        stats = self._stats
        stats.step, stats.now = self._step, self._now
        stats.num_generation_tokens += num_sampled
        self._close_stats()
