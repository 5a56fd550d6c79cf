"""OpenTelemetry traces of served requests: one span per request, exported over OTLP.

Off unless `--otlp-traces-endpoint` is given; then the server holds one `RequestTracer`. Nothing is
traced while a request runs: the span is built once the request has ended, from the timestamps its
final delta carries (`RequestMetrics`, on the engine clock), so the token path does no tracing work.

Export is asynchronous and bounded: spans go to the SDK's `BatchSpanProcessor`, whose worker thread
talks to the collector. `BoundedExport` caps the spans waiting for that worker (OTEL_BSP_MAX_QUEUE_SIZE)
and counts every span lost, queue full or export failed, so a slow or unreachable collector costs
spans (counted in Prometheus), never serving time.

The standard OTEL_* variables apply: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (http/protobuf, the default,
or grpc), OTEL_EXPORTER_OTLP_TRACES_HEADERS / _TIMEOUT / _COMPRESSION / _CERTIFICATE, OTEL_SERVICE_NAME
and OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER / _ARG (unless --otlp-traces-sample-ratio is given),
OTEL_BSP_* and OTEL_PROPAGATORS (W3C tracecontext and baggage by default).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode

from cadence.boundary import RequestMetrics
from cadence.engine.events import WAITING
from cadence.engine.output_processor import StreamDelta

log = logging.getLogger("cadence.server")

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("http/protobuf", "grpc")
SPAN_NAME = "llm_request"  # vLLM's span name, so queries written for vLLM's traces find cadence's
ENGINE_SPAN_NAME = "engine_request"  # a fleet replica's span, a child of the ingress's llm_request
DEFAULT_SERVICE_NAME = "cadence"
DEFAULT_MAX_QUEUE = 2048  # the SDK's own default for OTEL_BSP_MAX_QUEUE_SIZE
SHUTDOWN_WAIT_S = 2.0  # how long stopping the server waits for the last spans to leave

DropCounter = Callable[[str, int], None]  # (reason, spans): "queue_full" or "export_failed"


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py), then cadence's own."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    TENANT = "cadence.tenant"
    PRIORITY = "cadence.priority"
    DEADLINE = "cadence.deadline_s"
    PREFIX_CACHE_HIT_TOKENS = "cadence.prefix_cache_hit_tokens"
    NUM_PREEMPTIONS = "cadence.num_preemptions"
    PREEMPTED_TOKENS = "cadence.preempted_tokens"
    REQUEST_ID = "cadence.request_id"  # on a replica's engine span (gen_ai.request.id is the ingress span's)
    REPLICA = "cadence.replica"
    ERROR_TYPE = "error.type"


# -- export ------------------------------------------------------------------------------------------


def traces_protocol(endpoint: str) -> str:
    """The OTLP protocol named by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL; when unset, grpc for a grpc://
    endpoint (as vLLM's examples write it) and http/protobuf, the OpenTelemetry default, otherwise."""
    grpc_url = urlparse(endpoint).scheme == "grpc"
    value = os.environ.get(PROTOCOL_ENV, "").strip().lower() or ("grpc" if grpc_url else "http/protobuf")
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}: must be one of {', '.join(PROTOCOLS)}, got {value!r}")
    if grpc_url and value != "grpc":
        raise ValueError(f"--otlp-traces-endpoint: {endpoint!r} is a gRPC URL but {PROTOCOL_ENV} is {value}")
    return value


def make_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The official OTLP span exporter for `protocol`. Over HTTP a bare http://host:port gets the
    standard /v1/traces path; any other URL is used as given."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=urlparse(endpoint).scheme != "https")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    url = urlparse(endpoint)
    if url.path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint)


class _CountingExporter(SpanExporter):
    """Passes batches to the real exporter; releases them from the bound and counts failed ones."""

    def __init__(self, inner: SpanExporter, release: Callable[[int], None], on_drop: DropCounter) -> None:
        self.inner, self._release, self._on_drop = inner, release, on_drop

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._release(len(spans))
        try:
            result = self.inner.export(spans)
        except Exception:  # the SDK would only log it; a lost batch is counted here
            log.exception("exporting %d spans failed", len(spans))
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._on_drop("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class BoundedExport(SpanProcessor):
    """A `BatchSpanProcessor` whose waiting spans are capped and whose losses are counted.

    A span is waiting from `on_end` until the worker hands its batch to the exporter; beyond
    `max_queue` waiting, a new span is dropped (and counted) here, so the SDK's queue never overflows
    silently and `on_end` never blocks."""

    def __init__(self, exporter: SpanExporter, on_drop: DropCounter, max_queue: int | None = None) -> None:
        self.max_queue = max_queue or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE)
        self._waiting = 0
        self._lock = threading.Lock()
        self._on_drop = on_drop
        self._batch = BatchSpanProcessor(
            _CountingExporter(exporter, self._release, on_drop), max_queue_size=self.max_queue,
            max_export_batch_size=min(self.max_queue, _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
        )

    def _release(self, n: int) -> None:
        with self._lock:
            self._waiting -= n

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        with self._lock:
            full = self._waiting >= self.max_queue
            if not full:
                self._waiting += 1
        if full:
            self._on_drop("queue_full", 1)
            return
        self._batch.on_end(span)

    def shutdown(self) -> None:
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


def _env_int(name: str, default: int) -> int:
    """A positive count from the environment; anything else warns and gives `default` (as the SDK does)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        log.warning("%s=%r is not a positive integer: using %d", name, raw, default)
        return default
    return value


def _resource() -> Resource:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES as set; service.name "cadence" otherwise."""
    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


# -- spans -------------------------------------------------------------------------------------------


@dataclass
class RequestTrace:
    """What the server notes about one request while it runs, for its span once it has ended."""

    parent: Context
    start_ns: int  # Unix time the server began on the request
    submit_ns: int = 0  # Unix time it was handed to the engine (its engine arrival time)
    error: BaseException | None = None
    finals: dict[int, StreamDelta] = field(default_factory=dict)  # choice -> its last delta
    span: Any = None  # started by `begin` (so that its context can travel on), ended by `end`
    client_left: bool = False  # the client went away before the response began

    def carrier(self) -> dict[str, str]:
        """The W3C context of this request's span (traceparent, tracestate), for the process that
        runs it (a fleet's replica), whose own span becomes its child."""
        out: dict[str, str] = {}
        if self.span is not None:
            propagate.inject(out, context=trace_api.set_span_in_context(self.span, self.parent))
        return out


@dataclass(frozen=True)
class SpanFacts:
    """The request's own data for its span (from the server's `Job` and the usage it counted)."""

    request_id: str
    model: str
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    num_sequences: int
    tenant: str
    priority: int
    deadline: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class RequestTracer:
    """Starts nothing per token: `begin` reads the caller's trace context, `end` builds the span."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("cadence.server")

    @classmethod
    def create(cls, endpoint: str, sample_ratio: float | None, on_drop: DropCounter) -> RequestTracer:
        sampler = None if sample_ratio is None else ParentBased(TraceIdRatioBased(sample_ratio))
        provider = TracerProvider(sampler=sampler, resource=_resource())  # sampler None: OTEL_TRACES_SAMPLER
        provider.add_span_processor(BoundedExport(make_exporter(endpoint, traces_protocol(endpoint)), on_drop))
        return cls(provider)

    def begin(self, headers: Mapping[str, str], start_ns: int | None = None) -> RequestTrace:
        """Start the request's span (`start_ns`: when the server received it; now by default). A
        malformed traceparent is ignored (W3C): the request starts a new trace."""
        parent = propagate.extract(_one_line_per_field(headers))
        start = start_ns or time.time_ns()
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, start_time=start)
        return RequestTrace(parent, start, span=span)

    def end(self, trace: RequestTrace, facts: SpanFacts) -> None:
        end_ns = max(time.time_ns(), trace.start_ns)
        span = trace.span
        if span is None:
            span = self._tracer.start_span(SPAN_NAME, context=trace.parent, kind=SpanKind.SERVER,
                                           start_time=trace.start_ns)
        if span.is_recording():  # not sampled: nothing more to build
            span.set_attributes(_attributes(facts, trace))
            _add_events(span, trace, end_ns)
            reasons = [d.finish_reason for d in trace.finals.values()]
            if trace.error is not None or "error" in reasons:
                span.set_status(Status(StatusCode.ERROR, _error_text(trace.error)))
        span.end(end_time=end_ns)

    def end_engine_span(self, carrier: Mapping[str, str], request_id: str, replica: str, start_ns: int,
                        finals: dict[int, StreamDelta], error: BaseException | None = None) -> None:
        """A fleet replica's span of a request it ran, a child of the ingress's span (`carrier`: its
        W3C context): from the moment the replica took the request to its end, with the engine's
        events (scheduled, prefill chunks, preemptions, resumes, first token, finish)."""
        parent = propagate.extract(carrier)
        end_ns = max(time.time_ns(), start_ns)
        span = self._tracer.start_span(ENGINE_SPAN_NAME, context=parent, kind=SpanKind.INTERNAL, start_time=start_ns)
        if span.is_recording():
            trace = RequestTrace(parent, start_ns, submit_ns=start_ns, error=error, finals=finals)
            a = SpanAttributes
            attrs: dict[str, Any] = {a.REQUEST_ID: request_id, a.REPLICA: replica}
            ms = _metrics(trace)
            if ms:
                attrs[a.NUM_PREEMPTIONS] = sum(m.num_preemptions for m in ms)
                attrs.update(_latencies(ms))
            span.set_attributes(attrs)
            _add_events(span, trace, end_ns)
            if error is not None or "error" in [d.finish_reason for d in finals.values()]:
                span.set_status(Status(StatusCode.ERROR, _error_text(error)))
        span.end(end_time=end_ns)

    def shutdown(self, timeout: float = SHUTDOWN_WAIT_S) -> None:
        """Send what is queued, waiting `timeout` seconds at most (an unreachable collector)."""
        t = threading.Thread(target=self.provider.shutdown, name="cadence-trace-shutdown", daemon=True)
        t.start()
        t.join(timeout)


LIST_FIELDS = ("tracestate", "baggage")  # W3C: several header lines of these are one comma-separated list


def _one_line_per_field(headers: Mapping[str, str]) -> Mapping[str, str]:
    """The request's headers as the propagators read them: a list field sent in several lines joined
    in the order received (a mapping reads only the first line); any other field, its first line."""
    getlist = getattr(headers, "getlist", None)
    if getlist is None or all(len(getlist(name)) < 2 for name in LIST_FIELDS):
        return headers
    out = {name: headers[name] for name in headers}
    for name in LIST_FIELDS:
        lines = getlist(name)
        if len(lines) > 1:
            out[name] = ",".join(lines)
    return out


def _metrics(trace: RequestTrace) -> list[RequestMetrics]:
    return [d.metrics for d in trace.finals.values() if d.metrics is not None]


def _attributes(f: SpanFacts, trace: RequestTrace) -> dict[str, Any]:
    a = SpanAttributes
    out: dict[str, Any] = {
        a.GEN_AI_REQUEST_ID: f.request_id,
        a.GEN_AI_RESPONSE_MODEL: f.model,
        a.GEN_AI_REQUEST_MAX_TOKENS: f.max_tokens,
        a.GEN_AI_REQUEST_TEMPERATURE: f.temperature,
        a.GEN_AI_REQUEST_TOP_P: f.top_p,
        a.GEN_AI_REQUEST_N: f.n,
        a.GEN_AI_USAGE_NUM_SEQUENCES: f.num_sequences,
        a.GEN_AI_USAGE_PROMPT_TOKENS: f.prompt_tokens,
        a.GEN_AI_USAGE_COMPLETION_TOKENS: f.completion_tokens,
        a.TENANT: f.tenant,
        a.PRIORITY: f.priority,
        a.PREFIX_CACHE_HIT_TOKENS: f.cached_tokens,
    }
    if f.deadline is not None:
        out[a.DEADLINE] = f.deadline
    reasons = [d.finish_reason or "" for _, d in sorted(trace.finals.items())]
    if reasons:
        out[a.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    if trace.error is not None:
        out[a.ERROR_TYPE] = _error_type(trace.error)
    ms = _metrics(trace)
    if ms:
        out[a.NUM_PREEMPTIONS] = sum(m.num_preemptions for m in ms)
        out.update(_latencies(ms))
    lost = [v for d in trace.finals.values() for e in d.events if e.name == "preempted"
            for k, v in e.attributes if k == "cadence.tokens_lost"]
    if lost:
        out[a.PREEMPTED_TOKENS] = sum(lost)
    return out


def _latencies(ms: list[RequestMetrics]) -> dict[str, float]:
    """Over the request's choices: the longest queue wait, the first first token, the last finish."""
    a = SpanAttributes
    out: dict[str, float] = {}
    queue = [m.queue_time for m in ms if m.queue_time is not None]
    ttft = [m.ttft for m in ms if m.ttft is not None]
    e2e = [m.e2e_latency for m in ms if m.e2e_latency is not None]
    if queue:
        out[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = max(queue)
    if ttft:
        out[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = min(ttft)
    if e2e:
        out[a.GEN_AI_LATENCY_E2E] = max(e2e)
    scheduled = [m.first_scheduled_time for m in ms if m.first_scheduled_time is not None]
    first = [m.first_token_time for m in ms if m.first_token_time is not None]
    done = [m.finished_time for m in ms if m.finished_time is not None]
    if scheduled and first:
        out[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = max(0.0, min(first) - min(scheduled))
    if first and done:
        out[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = max(0.0, max(done) - min(first))
    if scheduled and done:
        out[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = max(0.0, max(done) - min(scheduled))
    return out


def _add_events(span: Any, trace: RequestTrace, end_ns: int) -> None:
    """queued, scheduled, first_token and finished, per choice, at their engine times (placed on the
    Unix clock by the moment the request reached the engine), with the engine's own events, all in
    the order they happened (a viewer that lists events as sent shows the first token before a
    later preemption, not after it)."""
    events: list[tuple[int, str, dict[str, Any]]] = []  # (time, name, attributes), at a tie as added

    def add(name: str, attrs: dict[str, Any], ns: int) -> None:
        events.append((ns, name, attrs))

    if trace.submit_ns:
        add("queued", {}, trace.submit_ns)
    for choice, d in sorted(trace.finals.items()):
        m = d.metrics
        if m is None:
            continue

        def at(t: float, m: RequestMetrics = m) -> int:
            return min(end_ns, trace.submit_ns + int((t - m.arrival_time) * 1e9))

        attrs: dict[str, Any] = {"cadence.choice": choice}
        # The engine's: why it waited (before it was first scheduled), prefill chunks, preemptions, resumes.
        waited = next((i for i, e in enumerate(d.events) if e.name != WAITING), len(d.events))
        for e in d.events[:waited]:
            add(e.name, {**attrs, **dict(e.attributes)}, at(e.time))
        if m.first_scheduled_time is not None:
            add("scheduled", attrs, at(m.first_scheduled_time))
        for e in d.events[waited:]:
            add(e.name, {**attrs, **dict(e.attributes)}, at(e.time))
        if m.first_token_time is not None:
            add("first_token", attrs, at(m.first_token_time))
        if m.finished_time is not None:
            finish = {**attrs, "finish_reason": d.finish_reason or "", "cadence.num_preemptions": m.num_preemptions}
            add("finished", finish, at(m.finished_time))
    for ns, name, attrs in sorted(events, key=lambda e: e[0]):
        span.add_event(name, attrs, timestamp=ns)


def _error_type(e: BaseException) -> str:
    kind = getattr(e, "kind", None)
    return str(getattr(kind, "value", kind)) if kind is not None else type(e).__name__


def _error_text(e: BaseException | None) -> str:
    return "generation failed" if e is None else f"{_error_type(e)}: {e}"
