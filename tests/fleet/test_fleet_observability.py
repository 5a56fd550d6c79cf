"""A fleet with --metrics-compat vllm and --otlp-traces-endpoint: the merged /metrics has the vLLM
series fed by the replicas, and the ingress exports one span per request, continuing the caller's trace."""

from __future__ import annotations

import httpx
from fleet_helpers import running_fleet
from prometheus_client.parser import text_string_to_metric_families

from otlp_receiver import HttpReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _totals(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "replica" not in s.labels:  # the fleet's sums, not each replica's gauge
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


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
            t = _totals(httpx.get(fleet.url + "/metrics", timeout=30).text)
            assert t["vllm:generation_tokens_total"] == t["cadence:generation_tokens_total"] == 9
            assert t["vllm:request_success_total"] == 3
            assert t["vllm:time_to_first_token_seconds_count"] == t["cadence:time_to_first_token_seconds_count"] == 3
    finally:
        receiver.stop()
