"""Tracing set-up without a server: the OTLP protocol choice, option checks, and the bounded export
queue with its loss counts (a fake exporter that blocks until released)."""

from __future__ import annotations

import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from cadence.cli import build_parser, serve_configs
from cadence.config import ServerConfig
from cadence.server.tracing import PROTOCOL_ENV, BoundedExport, traces_protocol


def test_the_protocol_comes_from_the_standard_variable(monkeypatch):
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    assert traces_protocol("http://collector:4318") == "http/protobuf"
    assert traces_protocol("grpc://collector:4317") == "grpc"  # as vLLM's examples write them
    monkeypatch.setenv(PROTOCOL_ENV, "grpc")
    assert traces_protocol("http://collector:4317") == "grpc"
    monkeypatch.setenv(PROTOCOL_ENV, "http/json")
    with pytest.raises(ValueError, match=PROTOCOL_ENV):
        traces_protocol("http://collector:4318")
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    with pytest.raises(ValueError, match="gRPC URL"):
        traces_protocol("grpc://collector:4317")


@pytest.mark.parametrize("endpoint", ["", "localhost", "collector:4318", "http://"])
def test_an_endpoint_that_is_not_a_url_is_refused(endpoint):
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerConfig(otlp_traces_endpoint=endpoint).validate()


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_a_sample_ratio_outside_0_1_is_refused(ratio):
    with pytest.raises(ValueError, match="otlp_traces_sample_ratio"):
        ServerConfig(otlp_traces_endpoint="http://c:4318", otlp_traces_sample_ratio=ratio).validate()


def test_serve_refuses_a_bad_protocol_before_loading_the_model(monkeypatch):
    monkeypatch.setenv(PROTOCOL_ENV, "carrier-pigeon")
    args = build_parser().parse_args(["serve", "--tiny", "--otlp-traces-endpoint", "http://c:4318"])
    with pytest.raises(ValueError, match=PROTOCOL_ENV):
        serve_configs(args)
    monkeypatch.delenv(PROTOCOL_ENV)
    cfg = serve_configs(build_parser().parse_args(
        ["serve", "--tiny", "--otlp-traces-endpoint", "http://c:4318", "--otlp-traces-sample-ratio", "0.25"]))[1]
    assert (cfg.otlp_traces_endpoint, cfg.otlp_traces_sample_ratio) == ("http://c:4318", 0.25)


class BlockingExporter(SpanExporter):
    """Blocks each export until released; answers `result`."""

    def __init__(self, result: SpanExportResult) -> None:
        self.result = result
        self.entered = threading.Event()
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.entered.set()
        self.release.wait(30)
        self.exported += len(spans)
        return self.result

    def shutdown(self) -> None:
        self.release.set()


def _provider(exporter: SpanExporter, drops: dict[str, int], monkeypatch) -> TracerProvider:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "5")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1")

    def on_drop(reason: str, n: int) -> None:
        drops[reason] = drops.get(reason, 0) + n

    provider = TracerProvider()
    provider.add_span_processor(BoundedExport(exporter, on_drop, max_queue=2))
    return provider


def _span(provider: TracerProvider, name: str) -> None:
    provider.get_tracer("t").start_span(name).end()


def test_a_stuck_exporter_bounds_the_queue_and_counts_what_it_drops(monkeypatch):
    exporter, drops = BlockingExporter(SpanExportResult.SUCCESS), {}
    provider = _provider(exporter, drops, monkeypatch)
    _span(provider, "first")
    assert exporter.entered.wait(10)  # the worker holds "first" in a stuck export
    for i in range(5):  # two wait in the queue, three are dropped, and none of this blocks
        _span(provider, f"more{i}")
    assert drops == {"queue_full": 3}
    exporter.release.set()
    provider.force_flush()
    assert exporter.exported == 3 and drops == {"queue_full": 3}
    provider.shutdown()


def test_failed_exports_are_counted(monkeypatch):
    exporter, drops = BlockingExporter(SpanExportResult.FAILURE), {}
    exporter.release.set()
    provider = _provider(exporter, drops, monkeypatch)
    _span(provider, "a")
    _span(provider, "b")
    provider.force_flush()
    assert drops == {"export_failed": 2}
    provider.shutdown()


@pytest.mark.parametrize("value", ["-5", "0", "many"])
def test_a_bad_queue_size_falls_back_to_the_default_with_a_warning(monkeypatch, caplog, value):
    # As the OpenTelemetry SDK does with a value it cannot use: not a queue of one span.
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", value)
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", value)
    with caplog.at_level("WARNING", logger="cadence.server"):
        export = BoundedExport(BlockingExporter(SpanExportResult.SUCCESS), lambda reason, n: None)
    try:
        assert export.max_queue == 2048
        assert export._batch._batch_processor._max_export_batch_size == 512
        assert "OTEL_BSP_MAX_QUEUE_SIZE" in caplog.text and "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" in caplog.text
    finally:
        export.shutdown()
