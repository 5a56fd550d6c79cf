"""What the scheduler tells about its state without deciding anything: why the waiting wait, a
request's snapshot, the gauges, and the integrity check the tests and the engine's debug mode run.

`SchedulerIntrospection` is a base of `Scheduler`: it reads the state the scheduler keeps and
changes none of it except the per-step stop record (`_record_stop`), which `schedule` sets.
"""

from __future__ import annotations

import math
from collections import Counter

from cadence.boundary import RequestDelta, RequestSnapshot, SchedulerStats, WaitInfo, WaitReason, WaitStop
from cadence.config import SchedulerConfig
from cadence.kv.manager import KVCacheManager
from cadence.request import Request, RequestStatus
from cadence.sched.queue import RequestQueue
from cadence.sched.records import request_snapshot

_RUNNING = RequestStatus.RUNNING
_NO_TENANTS: frozenset[str] = frozenset()


def wait_of(stop: WaitStop, req: Request) -> WaitInfo:
    """Why `req`, waiting in step `stop.step`, was not admitted in it: the step's own reason if the
    step stopped at `req` (or stopped for everyone), its tenant's cap, else the request it stopped at."""
    if stop.request_id == req.request_id:
        return WaitInfo(stop.step, stop.reason)
    if req.tenant in stop.capped_tenants:  # not admissible whatever else held it
        return WaitInfo(stop.step, WaitReason.TENANT_QUOTA)
    if stop.request_id is None:
        return WaitInfo(stop.step, stop.reason)
    return WaitInfo(stop.step, WaitReason.BEHIND, stop.request_id)


class SchedulerIntrospection:
    # The scheduler's state read here (set by `Scheduler.__init__`).
    config: SchedulerConfig
    kv: KVCacheManager
    waiting: RequestQueue
    running: list[Request]
    requests: dict[str, Request]
    _step: int
    _num_live_tokens: int
    _deadlines: list[tuple[float, str]]
    _pending_deltas: list[RequestDelta]
    _tenant_running: Counter[str]
    # Why the latest step admitted no further, as `WaitStop`'s fields (a tuple: this is set every
    # step); each waiting request's own reason is derived from it on demand (`wait_info`), never
    # by walking the queue.
    _wait_stop: tuple[int, WaitReason, str | None, frozenset[str]] | None

    @property
    def step_count(self) -> int:
        """Steps scheduled so far (the number of the latest)."""
        return self._step

    @property
    def next_deadline(self) -> float:
        """The earliest pending deadline (inf if none): the first step at or after it ends a request."""
        return self._deadlines[0][0] if self._deadlines else math.inf

    @property
    def has_pending_deltas(self) -> bool:
        """Whether finishes decided between steps (evictions, deadlines) wait to go out with the next `update`."""
        return bool(self._pending_deltas)

    def _record_stop(self, stop: tuple[WaitReason, str | None] | None) -> None:
        """Keep why this step admitted no further (nothing when nothing waits)."""
        if stop is None or not self.waiting:
            self._wait_stop = None
            return
        cap = self.config.tenant_max_running
        capped = frozenset(t for t, k in self._tenant_running.items() if k >= cap) if cap is not None else _NO_TENANTS
        self._wait_stop = (self._step, stop[0], stop[1], capped)

    @property
    def wait_stop(self) -> WaitStop | None:
        """Why the latest step admitted no further (None if nothing was left waiting)."""
        return WaitStop(*self._wait_stop) if self._wait_stop is not None else None

    def wait_info(self, request_id: str) -> WaitInfo | None:
        """Why a waiting (or preempted) request was not admitted in the latest step, derived from
        that step's `wait_stop`; None if it is not waiting."""
        req = self.requests.get(request_id)
        if req is None or req.status is _RUNNING:
            return None
        stop = self.wait_stop
        if stop is None or req.queued_step > stop.step:
            return WaitInfo(self._step, WaitReason.NOT_REACHED)
        return wait_of(stop, req)

    def snapshot(self, request_id: str) -> RequestSnapshot | None:
        """An unfinished request's state, its place in the queue and why it waits; None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return request_snapshot(req, self.waiting.position(req), self.wait_info(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_live_tokens=self._num_live_tokens,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
        )

    def check_integrity(self) -> None:
        """KV refcounts match the running requests' tables; bookkeeping agrees with itself."""
        self.kv.check_integrity(self.running, published=True)
        assert all(r.status is _RUNNING for r in self.running)
        assert len(self.running) + len(self.waiting) == len(self.requests)
        assert sum(self._tenant_running.values()) == len(self.running)
        assert self._num_live_tokens == sum(r.num_computed_tokens for r in self.running)
