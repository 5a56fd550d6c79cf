"""Prometheus exporter: turns the engine's per-step `IterationStats` and `SchedulerStats` into metrics.

Names follow `cadence:<what>_<unit>` (docs/metrics.md lists each one). Each exporter owns its own
`CollectorRegistry`, so several apps (tests) in one process never collide. The engine thread calls
`record_step`; the HTTP side calls `record_rejection` and `render`. prometheus_client is thread-safe,
and the tenant-label table has its own lock.

Refusals are counted by the HTTP side only, when it answers one (`record_rejection`), whoever refused:
the engine core puts its own refusals in the next step's `IterationStats.rejections`, which an idle
engine never runs, so `record_step` leaves that field to other readers (the simulator, benchmarks).

Tenant labels are bounded: the first `max_tenant_labels` tenants seen keep their name, later ones
are counted as "other", so a client inventing tenants cannot grow the series without limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from cadence.config import SpeculativeConfig

from cadence.boundary import FinishedRequestStats, IterationStats, SchedulerStats
from cadence.metrics.vllm_compat import VllmMetrics

# Drafts a row verifies: 1 to 16 (num_speculative_tokens' range), 0 for a row turned down.
CHOSEN_DRAFT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)

# The `_created` series (a timestamp per counter) double the output and no dashboard reads them.
disable_created_metrics()

OTHER_TENANT = "other"
SUCCESS_REASONS = frozenset({"stop", "length"})

TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
# Queue time starts near zero (an idle server schedules a request within a millisecond) and grows to
# minutes under overload: the latency buckets, with finer ones below 10 ms.
QUEUE_TIME_BUCKETS = (0.001, 0.0025, 0.005)
LATENCY_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class TenantLabels:
    """Maps tenant names to a bounded set of label values."""

    def __init__(self, limit: int) -> None:
        self._limit = max(0, limit)
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        with self._lock:
            if tenant in self._known:
                return tenant
            if len(self._known) < self._limit and tenant != OTHER_TENANT:
                self._known.add(tenant)
                return tenant
        return OTHER_TENANT


def meets_slo(f: FinishedRequestStats, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """A successfully finished request within every SLO given (inter-token: its mean gap after the first)."""
    if f.finish_reason not in SUCCESS_REASONS:
        return False
    ttft = f.metrics.ttft
    if slo_ttft is not None and (ttft is None or ttft > slo_ttft):
        return False
    if slo_itl is not None and f.num_output_tokens > 1:
        e2e = f.metrics.e2e_latency
        if ttft is None or e2e is None:
            return False
        if (e2e - ttft) / (f.num_output_tokens - 1) > slo_itl:
            return False
    return True


class PrometheusExporter:
    def __init__(
        self,
        *,
        slo_ttft: float | None = None,
        slo_itl: float | None = None,
        max_tenant_labels: int = 32,
        registry: CollectorRegistry | None = None,
        vllm_model_name: str | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.slo_ttft = slo_ttft
        self.slo_itl = slo_itl
        self.tenant = TenantLabels(max_tenant_labels)
        # Also told of each refusal (the dashboard's rates); called from the HTTP side.
        self.rejection_listeners: list[Callable[[str, int], None]] = []
        self._define()
        # --metrics-compat vllm: the same measurements again under vLLM's names (None: off).
        self.vllm = VllmMetrics(self.registry, vllm_model_name) if vllm_model_name is not None else None

    # (The metric definitions below are alike in shape by nature: one declaration each, with its
    # name, help, labels and buckets; no two define the same thing.)
    def _define(self) -> None:
        r = self.registry
        t = ("tenant",)
        self.ttft = Histogram(
            "cadence:time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            t,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "cadence:inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            t,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "cadence:e2e_request_latency_seconds",
            "Time from arrival to finish (any finish reason).",
            t,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "cadence:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            t,
            buckets=QUEUE_TIME_BUCKETS + LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("cadence:running_requests", "Requests holding KV blocks (running).", registry=r)
        self.waiting = Gauge("cadence:waiting_requests", "Requests in the waiting queue.", registry=r)
        self.kv_usage = Gauge(
            "cadence:kv_cache_usage_ratio", "Fraction of KV blocks in use (0 to 1).", registry=r
        )
        self.live_tokens = Gauge(
            "cadence:live_tokens", "Tokens whose KV is held by running requests.", registry=r
        )
        self.kv_capacity = Gauge(
            "cadence:kv_cache_capacity_tokens", "Tokens the KV cache holds (its blocks times the block size), "
            "by what it stores (kv_cache_dtype: the model's dtype, or int8).", ("kv_cache_dtype",), registry=r
        )
        self.prompt_tokens = Counter("cadence:prompt_tokens", "Prompt tokens computed (prefill).", registry=r)
        self.generation_tokens = Counter("cadence:generation_tokens", "Output tokens sampled.", registry=r)
        self.preemptions = Counter(
            "cadence:preempted_requests",
            "Preemptions: a running request's KV freed, recomputed later.",
            registry=r,
        )
        self.spec_drafts = Counter(
            "cadence:spec_decode_num_drafts",
            "Speculative decoding: verification rows (a decode step of one request that carried drafts).",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "cadence:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed and verified.",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "cadence:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "cadence:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by their position in the draft (0: the first).",
            ("position",),
            registry=r,
        )
        self.spec_acceptance = Gauge(
            "cadence:spec_decode_acceptance_ratio",
            "Speculative decoding: draft tokens accepted over draft tokens verified, since the start.",
            registry=r,
        )
        self.spec_k = Gauge(
            "cadence:spec_decode_num_speculative_tokens",
            "Speculative decoding: num_speculative_tokens configured (the most drafts a request verifies a step); "
            "0: the server does not speculate.",
            registry=r,
        )
        self.spec_chosen = Histogram(
            "cadence:spec_decode_chosen_draft_tokens",
            "Speculative decoding: per decode row that had drafts in a step, the drafts it verified "
            "(adaptive k's choice; 0: turned down for that step).",
            buckets=CHOSEN_DRAFT_BUCKETS,
            registry=r,
        )
        self._spec_totals = [0, 0]  # draft tokens, accepted
        self.cache_queries = Counter(
            "cadence:prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.cache_hits = Counter(
            "cadence:prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.rejected = Counter(
            "cadence:rejected_requests",
            "Generation requests refused before any work (one per HTTP request), by reason.",
            ("reason",),
            registry=r,
        )
        self.finished = Counter(
            "cadence:finished_requests",
            "Engine requests (one per choice) ended, by finish reason.",
            ("reason", "tenant"),
            registry=r,
        )
        self.goodput = Counter(
            "cadence:goodput_requests", "Finished requests that met every configured SLO.", t, registry=r
        )
        self.engine_healthy = Gauge(
            "cadence:engine_healthy",
            "1 while the engine loop runs; 0 once it has died or stalled (the process needs a restart).",
            registry=r,
        )
        self.engine_healthy.set(1)
        self.trace_spans_dropped = Counter(
            "cadence:dropped_trace_spans",
            "Trace spans lost: the export queue was full, or the OTLP export failed.",
            ("reason",),
            registry=r,
        )
        for reason in ("queue_full", "export_failed"):  # at 0 from the start, so rate() and alerts see them
            self.trace_spans_dropped.labels(reason)

    def watch_thread_times(self, read: Callable[[], Mapping[str, Any]]) -> None:
        """Export the engine thread's time totals (`EngineThreadTimes.as_dict`), read at each scrape."""
        self.registry.register(_ThreadTimesCollector(read))

    def watch_routing_decisions(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        """A fleet's ingress: its router's choices by (deployment, outcome), read at each scrape."""
        self.registry.register(_RoutingDecisionsCollector(read))

    def record_kv_cache(self, kv_cache_dtype: str, capacity_tokens: int) -> None:
        """The KV cache's size and storage, once at start-up."""
        self.kv_capacity.labels(kv_cache_dtype).set(capacity_tokens)

    def record_speculation(self, config: SpeculativeConfig | None) -> None:
        """Whether, and how far, the server speculates (its `SpeculativeConfig`, None: it does not):
        once at start-up."""
        self.spec_k.set(config.num_speculative_tokens if config is not None else 0)

    def watch_engine(self, is_healthy: Callable[[], bool]) -> None:
        """Read the engine's health at each scrape (a stall is seen by no step, so no step reports it)."""
        self.engine_healthy.set_function(lambda: 1.0 if is_healthy() else 0.0)

    # -- feeding ------------------------------------------------------------------------------------

    def record_step(self, it: IterationStats | None, st: SchedulerStats | None) -> None:
        """One engine step's counters and the gauges after it. Called from the engine thread."""
        if st is not None:
            self.record_scheduler(st)
        if it is None:
            return
        _inc(self.prompt_tokens, it.num_prompt_tokens)
        _inc(self.generation_tokens, it.num_generation_tokens)
        _inc(self.preemptions, it.num_preemptions)
        _inc(self.cache_queries, it.prefix_cache_queries)
        _inc(self.cache_hits, it.prefix_cache_hits)
        if it.num_drafts:
            self._record_spec(it)
        for k in it.chosen_draft_tokens:
            self.spec_chosen.observe(k)
        for tenant, seconds in it.first_token_latencies:
            self.ttft.labels(self.tenant(tenant)).observe(seconds)
        for tenant, seconds in it.token_latencies:
            self.itl.labels(self.tenant(tenant)).observe(seconds)
        if self.vllm is not None:
            self.vllm.record_step(it)
        for f in it.finished:
            self.record_finished(f)
        # it.rejections is not read: the HTTP side counts every refusal as it answers it (module doc).

    def _record_spec(self, it: IterationStats) -> None:
        _inc(self.spec_drafts, it.num_drafts)
        _inc(self.spec_draft_tokens, it.num_draft_tokens)
        _inc(self.spec_accepted_tokens, it.num_accepted_tokens)
        for pos, n in enumerate(it.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(str(pos)).inc(n)
        totals = self._spec_totals
        totals[0] += it.num_draft_tokens
        totals[1] += it.num_accepted_tokens
        self.spec_acceptance.set(totals[1] / totals[0] if totals[0] else 0.0)

    def record_scheduler(self, st: SchedulerStats) -> None:
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_usage.set(st.kv_usage)
        self.live_tokens.set(st.num_live_tokens)
        if self.vllm is not None:
            self.vllm.record_scheduler(st)

    def record_finished(self, f: FinishedRequestStats) -> None:
        if f.handed_off:  # the request goes on on another engine, whose record counts it
            return
        tenant = self.tenant(f.tenant)
        self.finished.labels(f.finish_reason, tenant).inc()
        m = f.metrics
        if m.e2e_latency is not None:
            self.e2e.labels(tenant).observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue_time.labels(tenant).observe(m.queue_time)
        if meets_slo(f, self.slo_ttft, self.slo_itl):
            self.goodput.labels(tenant).inc()
        if self.vllm is not None:
            self.vllm.record_finished(f)

    def record_rejection(self, reason: str, count: int = 1) -> None:
        """A refused generation request, as the server answers it: its own refusals (invalid input,
        tenant quota, draining) and the engine's (queue full, too long for the KV cache, deadline)."""
        _inc(self.rejected.labels(reason), count)
        for listener in self.rejection_listeners:
            listener(reason, count)

    def record_spans_dropped(self, reason: str, count: int) -> None:
        """Trace spans lost (`reason`: queue_full, export_failed); called from any thread."""
        _inc(self.trace_spans_dropped.labels(reason), count)

    # -- reading ------------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVTransferMetrics:
    """A decode replica's KV imports (disaggregated prefill and decode), in its exporter's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.bytes = Counter("cadence:kv_transfer_bytes", "KV bytes imported from prefill replicas.", registry=r)
        self.blocks = Counter("cadence:kv_transfer_blocks",
                              "Prompt blocks of imported requests: transferred, or found in this cache.",
                              ("source",), registry=r)
        self.seconds = Histogram("cadence:kv_transfer_seconds",
                                 "From reading a request's KV blocks on the prefill replica to their publication "
                                 "here.", buckets=KV_TRANSFER_BUCKETS, registry=r)
        self.refused = Counter("cadence:kv_reservations_refused",
                               "KV reservations refused for want of free blocks (the request waits and asks again).",
                               registry=r)

    def record_import(self, nbytes: int, transferred: int, cached: int, seconds: float) -> None:
        self.bytes.inc(nbytes)
        self.blocks.labels("transferred").inc(transferred)
        self.blocks.labels("cached").inc(cached)
        self.seconds.observe(seconds)


class _RoutingDecisionsCollector(Collector):
    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "cadence:fleet_routed_requests",
            "Requests the fleet's router placed, by what decided each: prefix (a replica holding the longest "
            "cached prefix), diverted (another, for its load), unbalanced (the least loaded: the fleet was "
            "unbalanced), no-prefix (the least loaded: no replica held any of it), load (round-robin, least-loaded).",
            labels=("deployment", "outcome"),
        )
        for (deployment, outcome), n in sorted(self._read().items()):
            family.add_metric((deployment, outcome), n)
        yield family


class _ThreadTimesCollector(Collector):
    """The engine thread's running totals as counters: no work per step, one read per scrape."""

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        t = self._read()
        phases = CounterMetricFamily(
            "cadence:engine_thread_seconds",
            "Wall time of the engine thread by phase: idle, inbox (admission), schedule_update, execute "
            "(forward and sampling), detokenize, publish (metrics, hand-off to the HTTP side).",
            labels=("phase",),
        )
        for phase, seconds in t["phases"].items():
            phases.add_metric((phase,), seconds)
        yield phases
        yield CounterMetricFamily(
            "cadence:engine_thread_busy_cpu_seconds",
            "CPU time of the engine thread over its busy phases; below their wall time when the thread "
            "waited for a core or the GIL.",
            value=t["busy_cpu"],
        )
        yield CounterMetricFamily("cadence:engine_steps", "Engine steps run.", value=t["steps"])
        yield CounterMetricFamily(
            "cadence:engine_handoff_delay_seconds",
            "Summed delay between the engine thread handing a step's output over and the HTTP side running it.",
            value=t["handoff"],
        )
        yield CounterMetricFamily("cadence:engine_handoff_steps", "Steps whose output was handed to the HTTP side.",
                                  value=t["handoffs"])


def _inc(counter: Counter, amount: float) -> None:
    if amount > 0:  # prometheus_client refuses negative increments; zero is a no-op anyway
        counter.inc(amount)


# -- a fleet's /metrics ------------------------------------------------------------------------------
#
# The replicas' expositions merged into one, with the same names as a single server's: counters and
# histograms (buckets, sums, counts) add up over the replicas; gauges appear once per replica with a
# `replica` label and once summed without it. The ingress's own exposition (the refusals it answers)
# is one more source of counters; its gauges are not the fleet's and are left out.

Labels = tuple[tuple[str, str], ...]


@dataclass
class _Family:
    type: str
    help: str
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)


def merge_expositions(local: str, replicas: Mapping[str, str], retired: Mapping[str, str] | None = None) -> str:
    """One exposition from the ingress's (`local`) and each replica's, by replica name. `retired`:
    the last expositions of replicas gone (or not answering): their counters and buckets still
    count, so the fleet's counters never go down; their gauges are not shown."""
    families: dict[str, _Family] = {}
    sources = [("", local, False), *((k, v, True) for k, v in replicas.items()),
               *((k, v, False) for k, v in (retired or {}).items())]
    for source, text, live in sources:
        for fam in text_string_to_metric_families(text):
            if fam.type == "gauge" and not live:
                continue
            merged = families.setdefault(fam.name, _Family(fam.type, fam.documentation))
            for s in fam.samples:
                labels = tuple(sorted(s.labels.items()))
                key = (s.name, labels)
                merged.samples[key] = merged.samples.get(key, 0.0) + s.value
                if fam.type == "gauge":
                    merged.samples[(s.name, (*labels, ("replica", source)))] = s.value
    return _render(families)


def _render(families: dict[str, _Family]) -> str:
    lines = []
    for family, fam in families.items():
        name = f"{family}_total" if fam.type == "counter" else family  # (as prometheus_client writes it)
        lines.append(f"# HELP {name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {name} {fam.type}")
        for (sample, labels), value in fam.samples.items():
            lines.append(f"{sample}{_labels(labels)} {floatToGoString(value)}")
    return "\n".join(lines) + "\n"


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in labels) + "}"


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n")
