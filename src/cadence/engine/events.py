"""What happened to each request inside the engine, for its trace: why it waited, prefill chunks,
preemptions, resumes.

Off unless the server traces requests (`EngineCore.record_request_events`): then the core hands each
step's output and the scheduler's stop record to `RequestEventRecorder.scheduled` and the scheduler
tells it of each preemption;
the async engine gives a request's events to the server with its final delta. With it off the
engine does none of this work (the simulator never turns it on).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.boundary import SchedulerOutput, WaitStop
from cadence.clock import Clock
from cadence.request import Request
from cadence.sched.introspect import wait_of

WAITING = "waiting"
PREFILL_CHUNK = "prefill_chunk"
PREEMPTED = "preempted"
RESUMED = "resumed"
MAX_EVENTS_PER_REQUEST = 1024  # a request recomputed over and over keeps its first events, then counts
# Runs of steps that stopped admitting for the same reason at the same request, kept to explain a
# tracked request's wait once it is admitted; a wait longer than these runs keeps its latest reasons.
MAX_STOP_RUNS = 4096


@dataclass(frozen=True)
class _StopRun:
    """Steps from `step` on (until the next run) stopped admitting as `stop` says (None: nothing
    was left waiting); `time`: when the first of them started."""

    step: int
    time: float
    stop: WaitStop | None
    behind: str | None = None  # the request it stopped at, by the name a trace gives it


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
        self._waiting_since: dict[str, float] = {}  # tracked, queued and not admitted since: when queued
        self._stops: deque[_StopRun] = deque(maxlen=MAX_STOP_RUNS)
        # The name a trace gives an engine request (the front end's request id of one of its choices).
        self.name_request: Callable[[str], str] = lambda request_id: request_id

    def track(self, request_id: str) -> None:
        """Record this request's events from now on (it has just been queued)."""
        if request_id not in self._events:
            self._events[request_id] = []
            self._waiting_since[request_id] = self._clock.now()

    def pop(self, request_id: str) -> tuple[EngineEvent, ...]:
        """The request's events, oldest first; forgets them."""
        self._preempted.discard(request_id)
        self._waiting_since.pop(request_id, None)
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

    def scheduled(
        self, out: SchedulerOutput, requests: dict[str, Request], now: float, stop: WaitStop | None = None
    ) -> None:
        """A step's prompt chunks (a preempted request's recompute included), the resumes it makes, and
        for each tracked request it admits, why it waited; `stop`: why this step admitted no further."""
        self._log_stop(out.step, now, stop)
        if not out.num_prefill_tokens and not self._preempted:
            return
        for sr in out.scheduled:
            n = len(sr.token_ids)
            rid = sr.request_id
            req = requests.get(rid)
            # A decode, unless it is a resume whose recompute the prefix cache cut to one token; a
            # verification row (speculative drafts) is a decode too.
            if req is None or sr.num_draft_tokens or (n == 1 and sr.start_pos >= req.num_prompt_tokens
                                                      and rid not in self._preempted):
                continue
            since = self._waiting_since.pop(rid, None)
            if since is not None:
                for event in self._waits(req, since, out.step):
                    self._add(rid, event)
            if rid in self._preempted:
                self._preempted.discard(rid)
                self._add(rid, EngineEvent(RESUMED, now, (("cadence.step", out.step),)))
            self._add(rid, EngineEvent(PREFILL_CHUNK, now, (
                ("cadence.step", out.step), ("cadence.tokens", n), ("cadence.start", sr.start_pos),
                ("cadence.last_chunk", sr.sample))))

    def _log_stop(self, step: int, now: float, stop: WaitStop | None) -> None:
        last = self._stops[-1].stop if self._stops else None
        same = (stop is None and last is None and bool(self._stops)) or (
            stop is not None and last is not None
            and (stop.reason, stop.request_id, stop.capped_tenants)
            == (last.reason, last.request_id, last.capped_tenants))
        if not same:
            behind = stop.request_id if stop is not None else None
            self._stops.append(_StopRun(step, now, stop, self.name_request(behind) if behind is not None else None))

    def _waits(self, req: Request, since: float, admitted_step: int) -> list[EngineEvent]:
        """One `waiting` event each time the reason `req` was not admitted changed, over the steps
        from its `queued_step` to the one before `admitted_step`. Waiting behind another request
        changes only with the reason that one was held for, not with each new head of the queue
        (a long queue would otherwise be an event per request ahead)."""
        first, last = req.queued_step, admitted_step - 1
        runs: list[_StopRun] = []  # those from the one covering `first` on (walked from the newest)
        for run in reversed(self._stops):
            runs.append(run)
            if run.step <= first:
                break
        runs.reverse()
        out: list[EngineEvent] = []
        prev: tuple[str, str | None] | None = None
        for i, run in enumerate(runs):
            end = runs[i + 1].step - 1 if i + 1 < len(runs) else last
            if run.stop is None or end < first or run.step > last:
                continue
            info = wait_of(run.stop, req)
            behind = info.behind is not None
            why = (info.reason.value, run.stop.reason.value if behind else None)
            if why == prev:
                continue
            prev = why
            attrs: tuple[tuple[str, Any], ...] = (("cadence.wait_reason", why[0]),)
            if behind:
                attrs += (("cadence.waiting_behind", run.behind), ("cadence.behind_reason", why[1]))
            attrs += (("cadence.step", max(run.step, first)),)
            out.append(EngineEvent(WAITING, max(run.time, since), attrs))
        return out

    def ended_waiting(self, request: Request, step: int) -> None:
        """The scheduler's listener for a request that ends while it waits: why it waited, up to
        `step` (the latest), as its admission would have recorded it."""
        rid = request.request_id
        since = self._waiting_since.pop(rid, None)
        if since is not None and rid in self._events:
            for event in self._waits(request, since, step + 1):
                self._add(rid, event)

    def preempted(self, request: Request, tokens_lost: int, reason: str) -> None:
        """The scheduler's preemption listener: `request` loses `tokens_lost` computed tokens."""
        rid = request.request_id
        if rid not in self._events:
            return
        self._preempted.add(rid)
        now = self._clock.now()
        self._waiting_since[rid] = now
        self._add(rid, EngineEvent(PREEMPTED, now, (
            ("cadence.reason", reason), ("cadence.tokens_lost", tokens_lost))))
