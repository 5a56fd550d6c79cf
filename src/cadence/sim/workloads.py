"""Workload transforms the simulator adds to the benchmark's: more requests from the same trace."""

from __future__ import annotations

from dataclasses import replace

from cadence.workload import Workload


def repeat_workload(workload: Workload, times: int) -> Workload:
    """The workload `times` times back to back: copy k starts one trace period after copy k-1.

    The period is the span of the arrivals plus one mean gap, so the seam looks like the rest of
    the trace. Prefix-group ids are kept: a shared system prompt stays shared across copies (a
    conversation's own history is rarely still cached a whole trace later).
    """
    if times < 1:
        raise ValueError("repeat: must be >= 1")
    if times == 1:
        return workload
    reqs = workload.requests
    times_known = [r.arrival_time for r in reqs if r.arrival_time is not None]
    if len(times_known) == len(reqs) and reqs:
        span = max(times_known) - min(times_known)
        period = span + (span / (len(reqs) - 1) if len(reqs) > 1 else 1.0)
    else:
        period = 0.0  # arrivals assigned later (closed loop): order is all that matters
    out = []
    for k in range(times):
        for r in reqs:
            t = None if r.arrival_time is None else r.arrival_time + k * period
            out.append(replace(r, arrival_time=t))
    note = f"repeated x{times}: {len(out)} requests, copy k shifted by k x {period:.1f}s"
    return replace(workload, requests=tuple(out)).with_note(note)
