"""OTLP trace receivers run by the tests: spans decoded from the wire, as a collector would get them.

`HttpReceiver` answers POST /v1/traces (OTLP/HTTP protobuf), `GrpcReceiver` is an OTLP gRPC
TraceService; both decode `ExportTraceServiceRequest` with opentelemetry-proto. `SilentListener`
accepts connections and never answers: a collector that hangs.
"""

from __future__ import annotations

import socket
import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str  # 32 hex digits
    span_id: str
    parent_span_id: str  # "" for a root span
    trace_state: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time, attributes)
    resource: dict[str, Any]
    status_code: int


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.trace_state,
                    s.start_time_unix_nano, s.end_time_unix_nano, _attrs(s.attributes),
                    [(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events], resource,
                    s.status.code,
                ))
    return out


@dataclass
class SpanSink:
    """Spans received so far; `wait` blocks until the wanted ones arrived (a condition, no polling)."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self.cond:
            self.spans.extend(spans)
            self.cond.notify_all()

    def wait(self, request_id: str, timeout: float = 30.0, attribute: str = "gen_ai.request.id") -> ReceivedSpan:
        """The first span whose `attribute` is `request_id` (an ingress span by default; a replica's
        engine span carries `cadence.request_id`), waiting up to `timeout` seconds for it."""
        def found() -> ReceivedSpan | None:
            return next((s for s in self.spans if s.attributes.get(attribute) == request_id), None)

        with self.cond:
            self.cond.wait_for(lambda: found() is not None, timeout)
            span = found()
        assert span is not None, f"no span for {request_id} within {timeout} s; got {len(self.spans)} others"
        return span


class HttpReceiver:
    def __init__(self) -> None:
        self.sink = SpanSink()
        sink = self.sink

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                sink.add(decode(req))
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver:
    def __init__(self) -> None:
        self.sink = SpanSink()
        sink = self.sink

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the gRPC method's name)
                sink.add(decode(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None)


class SilentListener:
    """Accepts TCP connections and never answers (nor reads): an OTLP endpoint that hangs."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def stop(self) -> None:
        self._sock.close()
