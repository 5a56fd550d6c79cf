"""A fleet with --metrics-compat vllm and --otlp-traces-endpoint: the merged /metrics has the vLLM
series fed by the replicas, and the ingress exports one span per request, continuing the caller's trace;
each replica's span of a request is a child of the ingress's."""

from __future__ import annotations

import re

import httpx
from fleet_helpers import running_fleet
from prometheus_client.parser import text_string_to_metric_families

from otlp_receiver import HttpReceiver, ReceivedSpan

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _totals(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "replica" not in s.labels:  # the fleet's sums, not each replica's gauge
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _engine_span(receiver: HttpReceiver, request_id: str, timeout: float = 60.0) -> ReceivedSpan:
    return receiver.sink.wait(request_id, timeout, attribute="cadence.request_id")


def test_a_fleet_serves_vllm_series_and_traces():
    receiver = HttpReceiver()
    try:
        with running_fleet(metrics_compat=("vllm",), otlp_traces_endpoint=receiver.url) as fleet:
            headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
            ids = []
            for i in range(3):
                r = httpx.post(fleet.url + "/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 3,
                                                                      "ignore_eos": True}, headers=headers, timeout=60)
                assert r.status_code == 200
                ids.append(r.json()["id"])
            span = receiver.sink.wait(ids[-1], timeout=60)
            assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
            assert span.attributes["gen_ai.usage.completion_tokens"] == 3
            assert span.attributes["gen_ai.latency.e2e"] > 0
            # The replica's own span continues the trace: a child of the ingress's span.
            engine_span = _engine_span(receiver, ids[-1])
            assert engine_span.name == "engine_request"
            assert (engine_span.trace_id, engine_span.parent_span_id) == (TRACE_ID, span.span_id)
            assert engine_span.attributes["cadence.replica"] == r.headers["x-cadence-replica"]
            names = [e[0] for e in engine_span.events]
            assert names == ["queued", "scheduled", "prefill_chunk", "first_token", "finished"], names
            assert span.start_ns <= engine_span.start_ns <= engine_span.end_ns <= span.end_ns
            status = httpx.get(f"{fleet.url}/v1/requests/{ids[-1]}", timeout=30).json()
            assert status["state"] == "finished" and status["ttft"] > 0 and status["cost_profile"]["path"]
            t = _totals(httpx.get(fleet.url + "/metrics", timeout=30).text)
            assert t["vllm:generation_tokens_total"] == t["cadence:generation_tokens_total"] == 9
            assert t["vllm:request_success_total"] == 3
            assert t["vllm:time_to_first_token_seconds_count"] == t["cadence:time_to_first_token_seconds_count"] == 3
            # The queue-status comment comes from the replica's engine, as it admitted the request.
            body = {"prompt": "queued?", "max_tokens": 2, "stream": True,
                    "stream_options": {"include_queue_status": True}}
            text = httpx.post(fleet.url + "/v1/completions", json=body, timeout=60).text
            assert re.match(r": queued position=\d+ predicted_ttft_s=[0-9.]+ state=waiting\n\n", text), text[:200]
    finally:
        receiver.stop()
