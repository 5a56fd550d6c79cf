"""W3C trace context from hostile or broken clients, against `cadence serve` exporting over OTLP/gRPC.

A malformed `traceparent` is ignored as the W3C spec says: the request is served and starts a new
trace. A valid one is continued. Spans are decoded from the wire by a gRPC TraceService the test runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import CliServer, start_cli_server

from otlp_receiver import GrpcReceiver, SpanSink

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
MALFORMED = [
    "garbage",
    f"00-{TRACE_ID}-{PARENT_ID}",  # no flags
    f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id: invalid
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id: invalid
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff: forbidden
    f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",  # upper-case hex: invalid
    f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 has exactly four fields
    "00-" + "x" * 4000,
]


@pytest.fixture(scope="module")
def grpc_served() -> Iterator[tuple[CliServer, SpanSink]]:
    receiver = GrpcReceiver()
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    src = str(Path(__file__).resolve().parents[2] / "src")
    mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    try:
        server = start_cli_server("--otlp-traces-endpoint", receiver.url)
    finally:
        mp.undo()
    yield server, receiver.sink
    server.stop()
    receiver.stop()


def _complete(server: CliServer, headers: dict[str, str]) -> str:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers,
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_a_valid_traceparent_is_continued_over_grpc(grpc_served):
    server, sink = grpc_served
    span = sink.wait(_complete(server, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}), timeout=60)
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert span.resource["service.name"] == "cadence"
    assert "tracing requests to" in server.log() and "OTLP grpc" in server.log()


@pytest.mark.parametrize("traceparent", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_traceparent_starts_a_new_trace(grpc_served, traceparent):
    server, sink = grpc_served
    span = sink.wait(_complete(server, {"traceparent": traceparent, "tracestate": "a=b"}), timeout=60)
    assert span.parent_span_id == "" and span.trace_id not in (TRACE_ID, "0" * 32)
    assert span.trace_state == ""


def test_a_tracestate_sent_in_several_header_lines_is_continued_whole(grpc_served):
    # W3C: several tracestate lines are one list, joined with commas in the order received.
    server, sink = grpc_served
    headers = [("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"), ("tracestate", "a=1"), ("tracestate", "b=2,c=3")]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    span = sink.wait(r.json()["id"], timeout=60)
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert span.trace_state == "a=1,b=2,c=3"
