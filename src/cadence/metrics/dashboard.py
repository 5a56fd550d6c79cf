"""The live dashboard's numbers: bounded ring buffers fed where the Prometheus exporter is fed.

`DashboardRecorder.record_step` is a stats hook (the engine thread calls it after each step, with
the same `IterationStats` and `SchedulerStats` the exporter gets); `record_rejection` is called for
each refusal the server answers; `snapshot` builds the JSON that `GET /dashboard/data` returns.

Per step the recorder appends a few references to rings, no per-token work: the step's
composition, the step's lists of first-token and inter-token latencies (as they are), its
finishes. Percentiles are computed when the dashboard reads them, over the last `WINDOW_S`
seconds. Who waits, by tenant and priority, is counted by walking the queues (`QueueCensus`): the
recorder asks for a census at most every `CENSUS_EVERY_S`, and only while somebody has read a
snapshot in the last `WATCHED_FOR_S`, so an unwatched dashboard costs nothing beyond the rings.

Tenant names go through a bounded `TenantLabels` map, as in the Prometheus labels: the first
`max_tenant_labels` tenants keep their name, the rest are counted as "other". A snapshot for one
tenant (a caller whose API key belongs to it) keeps every total but lists that tenant's rows only.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from cadence.boundary import IterationStats, QueueCensus, SchedulerStats
from cadence.metrics.prometheus import OTHER_TENANT, TenantLabels

WINDOW_S = 60.0  # latency percentiles, share of service, rates: over this many seconds
STEP_HISTORY = 240  # the last steps shown (steps that did work)
CENSUS_EVERY_S = 0.5  # at most this often the queues are walked for the per-tenant counts
WATCHED_FOR_S = 10.0  # ... and only this long after a snapshot was last read
MAX_RING = 8192  # entries per event ring: steps with latencies, finishes, refusals, preemptions
MAX_LATENCY_SAMPLES = 20_000  # per percentile: beyond it an evenly spaced subset is used
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Limits:
    """What a step is measured against."""

    max_num_batched_tokens: int
    max_num_seqs: int


class StepSample(NamedTuple):  # (a tuple: one is made per step)
    at: float
    step: int
    prefill_tokens: int
    decode_rows: int  # tokens sampled for requests that already had one (a decode each)
    running: int
    waiting: int
    duration_s: float


class DashboardRecorder:
    def __init__(
        self,
        *,
        limits: Limits | None = None,
        census: Callable[[], QueueCensus] | None = None,
        max_tenant_labels: int = 32,
        known_tenants: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`census`: walks the engine's queues (called on the engine thread, from `record_step`);
        None where no engine steps here (a fleet's ingress). `known_tenants` (the API keys'
        tenants) always keep their own name."""
        self.limits = limits
        self._census_source = census
        known = list(dict.fromkeys(known_tenants))
        self.tenant = TenantLabels(max_tenant_labels + len(known))
        for name in known:
            self.tenant(name)
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._steps: deque[StepSample] = deque(maxlen=STEP_HISTORY)
        self._ttft: deque[tuple[float, list[tuple[str, float]]]] = deque(maxlen=MAX_RING)
        self._itl: deque[tuple[float, list[tuple[str, float]]]] = deque(maxlen=MAX_RING)
        self._finishes: deque[tuple[float, str, int, str]] = deque(maxlen=MAX_RING)  # at, tenant, tokens, reason
        self._preemptions: deque[tuple[float, int]] = deque(maxlen=MAX_RING)
        self._refusals: deque[tuple[float, str, int]] = deque(maxlen=MAX_RING)
        self._spec: deque[tuple[float, int, int]] = deque(maxlen=MAX_RING)  # at, draft tokens, accepted
        self._spec_totals = [0, 0]  # draft tokens, accepted, since the start
        self._total_preemptions = 0
        self._total_refusals = 0
        self._gauges: SchedulerStats | None = None
        self._census: QueueCensus | None = None
        self._census_at: float | None = None
        self._read_at: float | None = None

    # -- feeding ------------------------------------------------------------------------------------

    def record_step(self, it: IterationStats | None, st: SchedulerStats | None) -> None:
        """A stats hook: one engine step's records (or what ended between steps). Engine thread."""
        now = self._clock()
        with self._lock:
            if st is not None:
                self._gauges = st
            if it is not None:
                self._record_iteration(now, it, st)
        source = self._census_source
        if st is None or source is None:
            return
        if self._census_due(now, st):
            census = self._fold(source())
            with self._lock:
                self._census, self._census_at = census, now
        elif not self._watched(now) and self._census is not None:
            # The queues moved in a step that no census followed: an old count would show requests
            # long gone (the engine takes no step while idle, so nothing would ever replace it).
            with self._lock:
                self._census, self._census_at = None, None

    def _record_iteration(self, now: float, it: IterationStats, st: SchedulerStats | None) -> None:
        decode_rows = len(it.token_latencies)
        if it.num_prompt_tokens or it.num_generation_tokens:
            running = st.num_running if st is not None else 0
            waiting = st.num_waiting if st is not None else 0
            self._steps.append(
                StepSample(now, it.step, it.num_prompt_tokens, decode_rows, running, waiting, it.step_time)
            )
        if it.first_token_latencies:
            self._ttft.append((now, it.first_token_latencies))
        if it.token_latencies:
            self._itl.append((now, it.token_latencies))
        for f in it.finished:
            if f.handed_off:  # counted by the engine the request went on to
                continue
            self._finishes.append((now, self.tenant(f.tenant), f.num_output_tokens, f.finish_reason))
        if it.num_draft_tokens:
            self._spec.append((now, it.num_draft_tokens, it.num_accepted_tokens))
            self._spec_totals[0] += it.num_draft_tokens
            self._spec_totals[1] += it.num_accepted_tokens
        if it.num_preemptions:
            self._preemptions.append((now, it.num_preemptions))
            self._total_preemptions += it.num_preemptions

    def _watched(self, now: float) -> bool:
        return self._read_at is not None and now - self._read_at <= WATCHED_FOR_S

    def _census_due(self, now: float, st: SchedulerStats) -> bool:
        if self._census_source is None or not self._watched(now):
            return False
        if self._census_at is None or now - self._census_at >= CENSUS_EVERY_S:
            return True
        # The engine has just emptied (it takes no step while idle): count the empty queues now.
        return st.num_running == 0 and st.num_waiting == 0

    def record_rejection(self, reason: str, count: int = 1) -> None:
        """A refused request, as the server answers it (any thread)."""
        now = self._clock()
        with self._lock:
            self._refusals.append((now, reason, count))
            self._total_refusals += count

    # -- reading ------------------------------------------------------------------------------------

    def snapshot(self, *, tenant: str | None = None, gauges: SchedulerStats | None = None) -> dict[str, Any]:
        """The dashboard's JSON. `tenant`: list that tenant's rows only (totals stay whole).
        `gauges`: the engine's gauges as of now, where the caller can read them."""
        now = self._clock()
        with self._lock:
            self._read_at = now
            cutoff = now - WINDOW_S
            for ring in (self._ttft, self._itl, self._finishes, self._preemptions, self._refusals, self._spec):
                while ring and ring[0][0] < cutoff:
                    ring.popleft()
            steps = list(self._steps)
            ttft, itl = list(self._ttft), list(self._itl)
            finishes, preemptions, refusals = list(self._finishes), list(self._preemptions), list(self._refusals)
            total_preemptions, total_refusals = self._total_preemptions, self._total_refusals
            spec, spec_totals = list(self._spec), (self._spec_totals[0], self._spec_totals[1])
            census, census_at = self._census, self._census_at
            gauges = gauges or self._gauges
        show = self._visible(tenant)
        span = max(1e-9, min(WINDOW_S, now - self._started))
        return {
            "source": "engine" if self._census_source is not None else "ingress",
            "tenant": tenant,
            "window_s": WINDOW_S,
            "limits": self._limits_json(gauges),
            "requests": {
                "running": gauges.num_running if gauges else 0,
                "waiting": gauges.num_waiting if gauges else 0,
            },
            "queue": _queue_json(census, census_at, now, gauges, show),
            "steps": [_step_json(s, now) for s in steps],
            "kv": _kv_json(gauges, census),
            "latency": {"ttft": _percentiles(ttft), "itl": _percentiles(itl)},
            "service": _service_json(finishes, show),
            "preemptions": _events_json(total_preemptions, sum(n for _, n in preemptions), span),
            "refusals": {
                **_events_json(total_refusals, sum(n for _, _, n in refusals), span),
                "by_reason": dict(_sum_by(((reason, n) for _, reason, n in refusals))),
            },
            "speculative": _spec_json(spec, spec_totals, span),
        }

    def _visible(self, tenant: str | None) -> Callable[[str], bool]:
        """Which tenant rows a snapshot lists: all, or the caller's own (under its own name)."""
        if tenant is None:
            return lambda _name: True
        own = self.tenant(tenant)
        if own == OTHER_TENANT:  # folded in with others: its rows are theirs too, so none is shown
            return lambda _name: False
        return lambda name: name == own

    def _limits_json(self, gauges: SchedulerStats | None) -> dict[str, int | None]:
        return {
            "max_num_batched_tokens": self.limits.max_num_batched_tokens if self.limits else None,
            "max_num_seqs": self.limits.max_num_seqs if self.limits else None,
            "kv_blocks": gauges.num_total_blocks if gauges else None,
        }

    def _fold(self, census: QueueCensus) -> QueueCensus:
        """The census with its tenant names folded onto the bounded labels."""

        def fold(counts: dict[str, int]) -> dict[str, int]:
            return dict(_sum_by((self.tenant(name), n) for name, n in counts.items()))

        return QueueCensus(fold(census.waiting_by_tenant), dict(census.waiting_by_priority),
                           fold(census.running_by_tenant), census.num_cached_free_blocks)


def _sum_by(pairs: Iterable[tuple[Any, int]]) -> Counter:
    out: Counter = Counter()
    for key, n in pairs:
        out[key] += n
    return out


def _queue_json(
    census: QueueCensus | None, at: float | None, now: float, gauges: SchedulerStats | None, show: Callable[[str], bool]
) -> dict[str, Any]:
    """The queue's rows. `waiting` is the live gauge; every other count comes from the one census,
    so that the rows of a table add up together (the census may be up to CENSUS_EVERY_S older)."""
    waiting = gauges.num_waiting if gauges else 0
    if census is None or at is None:
        # Uncounted; but an engine that holds no request has nothing to list.
        if gauges is not None and gauges.num_waiting == 0 and gauges.num_running == 0:
            return {"waiting": 0, "counted": 0, "by_tenant": {}, "other_tenants": 0, "by_priority": {},
                    "running_by_tenant": {}, "age_s": None}
        return {"waiting": waiting, "counted": None, "by_tenant": None, "other_tenants": None, "by_priority": None,
                "running_by_tenant": None, "age_s": None}
    by_tenant = _rows(census.waiting_by_tenant, show)
    counted = sum(census.waiting_by_tenant.values())
    return {
        "waiting": waiting,
        "counted": counted,
        "by_tenant": by_tenant,
        "other_tenants": counted - sum(by_tenant.values()),
        "by_priority": {str(p): n for p, n in sorted(census.waiting_by_priority.items())},
        "running_by_tenant": _rows(census.running_by_tenant, show),
        "age_s": round(now - at, 3),
    }


def _rows(counts: dict[str, int], show: Callable[[str], bool]) -> dict[str, int]:
    return {name: n for name, n in sorted(counts.items()) if show(name)}


def _step_json(s: StepSample, now: float) -> dict[str, Any]:
    return {
        "age_s": round(now - s.at, 3),
        "step": s.step,
        "prefill_tokens": s.prefill_tokens,
        "decode_rows": s.decode_rows,
        "running": s.running,
        "waiting": s.waiting,
        "duration_s": round(s.duration_s, 6),
    }


def _kv_json(gauges: SchedulerStats | None, census: QueueCensus | None) -> dict[str, int | None]:
    if gauges is None:
        return {"total": None, "used": None, "cached": None, "free": None}
    free = gauges.num_free_blocks
    cached = min(free, census.num_cached_free_blocks) if census is not None else None
    return {
        "total": gauges.num_total_blocks,
        "used": gauges.num_total_blocks - free,
        "cached": cached,
        "free": free - (cached or 0),
    }


def _percentiles(ring: list[tuple[float, list[tuple[str, float]]]]) -> dict[str, float | int | None]:
    count = sum(len(samples) for _, samples in ring)
    # Every stride-th sample of the window, picked by slicing each step's list (no Python work for
    # the samples skipped): the read costs at most MAX_LATENCY_SAMPLES, whatever the token rate.
    stride = max(1, math.ceil(count / MAX_LATENCY_SAMPLES))
    values: list[float] = []
    position = 0
    for _, samples in ring:
        values.extend(seconds for _, seconds in samples[(-position) % stride::stride])
        position += len(samples)
    values.sort()
    out: dict[str, float | int | None] = {"count": count}
    for p in PERCENTILES:
        out[f"p{p}"] = _nearest_rank(values, p) if values else None
    return out


def _nearest_rank(ordered: list[float], p: float) -> float:
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return round(ordered[rank - 1], 6)


def _service_json(finishes: list[tuple[float, str, int, str]], show: Callable[[str], bool]) -> dict[str, Any]:
    by_tenant = _sum_by((tenant, tokens) for _, tenant, tokens, _ in finishes)
    return {
        "output_tokens": sum(by_tenant.values()),
        "finished": len(finishes),
        "by_tenant": {name: n for name, n in sorted(by_tenant.items()) if show(name)},
        "by_reason": dict(_sum_by((reason, 1) for _, _, _, reason in finishes)),
    }


def _events_json(total: int, in_window: int, span: float) -> dict[str, float | int]:
    return {"total": total, "window": in_window, "per_s": round(in_window / span, 3)}


def _spec_json(window: list[tuple[float, int, int]], totals: tuple[int, int], span: float) -> dict[str, Any] | None:
    """Speculative decoding's drafts: None until a step has verified one (a server that does not
    speculate). The acceptance rate is the last minute's (None when it verified no draft)."""
    if not totals[0]:
        return None
    drafted = sum(d for _, d, _ in window)
    accepted = sum(a for _, _, a in window)
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "draft_tokens_per_s": round(drafted / span, 3),
        "accepted_tokens_per_s": round(accepted / span, 3),
        "total_draft_tokens": totals[0],
        "total_accepted_tokens": totals[1],
    }
