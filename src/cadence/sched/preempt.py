"""Preemption policies: which running request gives way when blocks or sequence slots run out.

`choose_victim` answers when the scheduler must free room for a running request (it may name
that very request). `victim_for` answers whether a waiting request is worth more than some
running one, so that admitting it justifies a preemption; only the priority policy says yes.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.config import SchedulerConfig
from cadence.request import Request


class PreemptionPolicy:
    """Lowest priority (highest value) first, then latest arrival; never displaces for arrivals."""

    def choose_victim(self, running: Sequence[Request]) -> Request:
        if not running:
            raise ValueError("running: no request to preempt")
        # On a full tie the later-admitted request (later in `running`) goes.
        best_i = 0
        best_key = (running[0].priority, running[0].arrival_time)
        for i in range(1, len(running)):
            req = running[i]
            key = (req.priority, req.arrival_time)
            if key >= best_key:
                best_i, best_key = i, key
        return running[best_i]

    def victim_for(self, candidate: Request, running: Sequence[Request]) -> Request | None:
        """A running request to preempt so that the waiting `candidate` can be admitted, or None."""
        return None


class PriorityPreemption(PreemptionPolicy):
    """Also lets a waiting request preempt a running one of strictly lower priority."""

    def victim_for(self, candidate: Request, running: Sequence[Request]) -> Request | None:
        # Asked every step while seats are full: a cheap scan rules out the usual "no" first.
        if not running or max(r.priority for r in running) <= candidate.priority:
            return None
        return self.choose_victim(running)


def make_preemption_policy(config: SchedulerConfig) -> PreemptionPolicy:
    return PriorityPreemption() if config.policy == "priority" else PreemptionPolicy()
