"""Where the engine thread's time goes, and how long its output waits for the HTTP side.

The simulator charges each step what the cost model says the forward pass costs, plus a fitted
serving overhead. A served run pays more than that, and more as load rises: the engine thread
also schedules, detokenizes and publishes, and on a machine with few cores it competes with the
HTTP thread (and a client on the same cores) for a core and for the GIL. These running totals
split the engine thread's wall time into its phases, and put its CPU time beside its busy wall
time: the difference is time it was ready to run but did not (no free core, or the GIL held
elsewhere). `cadence:engine_thread_seconds_total` and its siblings export them (docs/metrics.md);
benchmarks/serving_breakdown.py reads them at several loads.

The engine thread writes every field but the two hand-off ones, which the HTTP side's event loop
writes as it takes each batch; /metrics reads them at scrape time. Each field is a float or an
int replaced whole, so a reader sees each total as of some recent step.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from dataclasses import dataclass, fields
from typing import Any

# The phases of the engine thread's loop, in loop order.
PHASES = ("idle", "inbox", "schedule_update", "execute", "detokenize", "publish")


@dataclass
class EngineThreadTimes:
    """Running totals in seconds since the engine started (see the module docstring)."""

    idle: float = 0.0  # waiting for work (nothing to run, or every request blocked)
    inbox: float = 0.0  # admitting arrivals, applying aborts, answering status questions
    schedule_update: float = 0.0  # the core's step less the executor: scheduling and bookkeeping
    execute: float = 0.0  # the executor: forward pass and sampling
    detokenize: float = 0.0  # the output processor: text, stop strings
    publish: float = 0.0  # stats hooks (metrics) and handing deltas to the HTTP side
    busy_cpu: float = 0.0  # the thread's CPU time over its busy phases (all but idle)
    steps: int = 0
    handoff: float = 0.0  # summed delay from handing a batch of deltas over to the HTTP side running it
    handoffs: int = 0

    @property
    def busy(self) -> float:
        return self.inbox + self.schedule_update + self.execute + self.detokenize + self.publish

    def as_dict(self) -> dict[str, Any]:
        """Every total by name, and the phases' again under "phases" (in loop order), so that a
        reader needs no list of them of its own."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "phases": {p: getattr(self, p) for p in PHASES}}


class StepTimer:
    """Times one pass of the engine loop into an `EngineThreadTimes`: `mark(phase)` closes the
    phase that started at the previous mark. Two clock reads a phase (wall and thread CPU)."""

    __slots__ = ("_cpu", "_t", "times")

    def __init__(self, times: EngineThreadTimes) -> None:
        self.times = times
        self._t = time.perf_counter()
        self._cpu = time.thread_time()

    def mark(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        t = self.times
        setattr(t, phase, getattr(t, phase) + (now - self._t))
        if phase != "idle":
            t.busy_cpu += cpu - self._cpu
        self._t, self._cpu = now, cpu

    def split(self, phase: str, seconds: float, rest: str) -> None:
        """Close a span of which `seconds` (measured inside it) belong to `phase`, the rest to `rest`."""
        now, cpu = time.perf_counter(), time.thread_time()
        t = self.times
        span = now - self._t
        inner = min(max(seconds, 0.0), span)
        setattr(t, phase, getattr(t, phase) + inner)
        setattr(t, rest, getattr(t, rest) + (span - inner))
        t.busy_cpu += cpu - self._cpu
        self._t, self._cpu = now, cpu


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` where the OS shows it (top -H, /proc/PID/task/TID/comm; Linux
    keeps 15 bytes). Python's own thread names stay inside Python before 3.14, so without this
    every thread of the server looks alike from outside. Best effort: elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
