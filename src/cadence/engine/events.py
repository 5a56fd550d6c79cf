"""What happened to each request inside the engine, for its trace: prefill chunks, preemptions, resumes.

Off unless the server traces requests (`EngineCore.record_request_events`): then the core hands each
step's output to `RequestEventRecorder.scheduled` and the scheduler tells it of each preemption;
the async engine gives a request's events to the server with its final delta. With it off the
engine does none of this work (the simulator never turns it on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cadence.boundary import SchedulerOutput
from cadence.clock import Clock
from cadence.request import Request

PREFILL_CHUNK = "prefill_chunk"
PREEMPTED = "preempted"
RESUMED = "resumed"
MAX_EVENTS_PER_REQUEST = 1024  # a request recomputed over and over keeps its first events, then counts


@dataclass(frozen=True)
class EngineEvent:
    """One event of one request: `time` on the engine clock, `attributes` for its span event."""

    name: str
    time: float
    attributes: tuple[tuple[str, Any], ...] = ()


class RequestEventRecorder:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._events: dict[str, list[EngineEvent]] = {}
        self._preempted: set[str] = set()  # preempted, not yet resumed
        self._dropped: dict[str, int] = {}

    def track(self, request_id: str) -> None:
        """Record this request's events from now on."""
        self._events.setdefault(request_id, [])

    def pop(self, request_id: str) -> tuple[EngineEvent, ...]:
        """The request's events, oldest first; forgets them."""
        self._preempted.discard(request_id)
        events = self._events.pop(request_id, [])
        dropped = self._dropped.pop(request_id, 0)
        if dropped:
            events.append(EngineEvent("events_dropped", events[-1].time, (("cadence.events_dropped", dropped),)))
        return tuple(events)

    def discard(self, request_id: str) -> None:
        self.pop(request_id)

    def __len__(self) -> int:
        return len(self._events)

    def _add(self, request_id: str, event: EngineEvent) -> None:
        events = self._events.get(request_id)
        if events is None:
            return  # not tracked
        if len(events) >= MAX_EVENTS_PER_REQUEST:
            self._dropped[request_id] = self._dropped.get(request_id, 0) + 1
            return
        events.append(event)

    def scheduled(self, out: SchedulerOutput, requests: dict[str, Request], now: float) -> None:
        """A step's prompt chunks (a preempted request's recompute included) and the resumes it makes."""
        if not out.num_prefill_tokens:
            return
        for sr in out.scheduled:
            n = len(sr.token_ids)
            req = requests.get(sr.request_id)
            if req is None or (n == 1 and sr.start_pos >= req.num_prompt_tokens):
                continue  # a decode
            rid = sr.request_id
            if rid in self._preempted:
                self._preempted.discard(rid)
                self._add(rid, EngineEvent(RESUMED, now, (("cadence.step", out.step),)))
            self._add(rid, EngineEvent(PREFILL_CHUNK, now, (
                ("cadence.step", out.step), ("cadence.tokens", n), ("cadence.start", sr.start_pos),
                ("cadence.last_chunk", sr.sample))))

    def preempted(self, request: Request, tokens_lost: int, reason: str) -> None:
        """The scheduler's preemption listener: `request` loses `tokens_lost` computed tokens."""
        rid = request.request_id
        if rid not in self._events:
            return
        self._preempted.add(rid)
        self._add(rid, EngineEvent(PREEMPTED, self._clock.now(), (
            ("cadence.reason", reason), ("cadence.tokens_lost", tokens_lost))))
