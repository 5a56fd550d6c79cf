"""The Prometheus exporter (fed by hand) and /metrics on a live server (fed by real requests)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cadence.metrics.prometheus import PrometheusExporter, meets_slo
from cadence.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from cadence.sched.output import RequestMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def samples(text: str | bytes) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the exposition text."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def finished(tenant="a", reason="stop", ttft=0.1, e2e=1.0, n_out=10, queued=0.05) -> FinishedRequestStats:
    m = RequestMetrics(
        arrival_time=0.0, first_scheduled_time=queued, first_token_time=ttft, finished_time=e2e
    )
    return FinishedRequestStats("r", tenant, 0, reason, 5, n_out, 0, m)


def test_step_stats_become_counters_gauges_and_histograms():
    exp = PrometheusExporter()
    it = IterationStats(
        step=1,
        num_prompt_tokens=40,
        num_generation_tokens=3,
        num_preemptions=1,
        prefix_cache_queries=32,
        prefix_cache_hits=16,
        token_latencies=[("a", 0.02), ("b", 0.03)],
        first_token_latencies=[("a", 0.2)],
        finished=[finished()],
        rejections={"queue_full": 2},
    )
    exp.record_step(it, SchedulerStats(num_running=3, num_waiting=4, kv_usage=0.25, num_live_tokens=99))
    exp.record_step(IterationStats(step=2, num_generation_tokens=2), None)
    s = samples(exp.render()[0])
    assert s[("cadence:prompt_tokens_total", ())] == 40
    assert s[("cadence:generation_tokens_total", ())] == 5
    assert s[("cadence:preempted_requests_total", ())] == 1
    assert s[("cadence:prefix_cache_query_tokens_total", ())] == 32
    assert s[("cadence:prefix_cache_hit_tokens_total", ())] == 16
    assert s[("cadence:rejected_requests_total", (("reason", "queue_full"),))] == 2
    assert s[("cadence:running_requests", ())] == 3 and s[("cadence:waiting_requests", ())] == 4
    assert s[("cadence:kv_cache_usage_ratio", ())] == 0.25 and s[("cadence:live_tokens", ())] == 99
    assert s[("cadence:time_to_first_token_seconds_count", (("tenant", "a"),))] == 1
    assert s[("cadence:inter_token_latency_seconds_count", (("tenant", "b"),))] == 1
    assert s[("cadence:e2e_request_latency_seconds_sum", (("tenant", "a"),))] == 1.0
    assert s[("cadence:request_queue_time_seconds_sum", (("tenant", "a"),))] == 0.05
    assert s[("cadence:finished_requests_total", (("reason", "stop"), ("tenant", "a")))] == 1
    assert s[("cadence:goodput_requests_total", (("tenant", "a"),))] == 1  # no SLO: every success counts


def test_goodput_counts_only_requests_within_every_slo():
    assert meets_slo(finished(ttft=0.1), slo_ttft=0.2, slo_itl=None)
    assert not meets_slo(finished(ttft=0.3), slo_ttft=0.2, slo_itl=None)
    # 9 gaps over 0.9 s: 0.1 s each
    assert meets_slo(finished(ttft=0.1, e2e=1.0, n_out=10), slo_ttft=None, slo_itl=0.1 + 1e-9)
    assert not meets_slo(finished(ttft=0.1, e2e=1.0, n_out=10), slo_ttft=None, slo_itl=0.05)
    assert not meets_slo(finished(reason="error"), slo_ttft=None, slo_itl=None)
    exp = PrometheusExporter(slo_ttft=0.2)
    exp.record_step(
        IterationStats(finished=[finished(ttft=0.1), finished(ttft=0.5), finished(reason="abort")]), None
    )
    s = samples(exp.render()[0])
    assert s[("cadence:goodput_requests_total", (("tenant", "a"),))] == 1
    assert s[("cadence:finished_requests_total", (("reason", "abort"), ("tenant", "a")))] == 1


def test_tenant_labels_are_bounded():
    exp = PrometheusExporter(max_tenant_labels=3)
    it = IterationStats(first_token_latencies=[(f"t{i}", 0.1) for i in range(50)])
    exp.record_step(it, None)
    s = samples(exp.render()[0])
    tenants = {dict(k[1]).get("tenant") for k in s if k[0] == "cadence:time_to_first_token_seconds_count"}
    assert tenants == {"t0", "t1", "t2", "other"}
    assert s[("cadence:time_to_first_token_seconds_count", (("tenant", "other"),))] == 47


def test_two_exporters_do_not_collide():
    a, b = PrometheusExporter(), PrometheusExporter()
    a.record_step(IterationStats(num_generation_tokens=7), None)
    assert samples(b.render()[0])[("cadence:generation_tokens_total", ())] == 0


def test_every_metric_is_documented_and_named_by_convention():
    exp = PrometheusExporter()
    names = {fam.name for fam in text_string_to_metric_families(exp.render()[0].decode())}
    doc = DOCS.read_text()
    assert len(names) >= 16
    for name in names:
        assert re.fullmatch(r"cadence:[a-z0-9_]+_(seconds|ratio|requests|tokens)", name), name
        assert f"`{name}" in doc, f"{name} is missing from docs/metrics.md"


# -- on a live server ---------------------------------------------------------------------------------


def test_metrics_endpoint_counts_real_requests(server):
    before = samples(httpx.get(server.url + "/metrics").text)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 5, "ignore_eos": True, "temperature": 0},
        headers={"X-Tenant": "acme"},
    )
    assert r.status_code == 200
    resp = httpx.get(server.url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = samples(resp.text)
    gen = ("cadence:generation_tokens_total", ())
    assert after[gen] - before.get(gen, 0) == 5
    prompt = ("cadence:prompt_tokens_total", ())
    assert (
        after[prompt] - before.get(prompt, 0)
        >= r.json()["usage"]["prompt_tokens"] - r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert after[("cadence:time_to_first_token_seconds_count", (("tenant", "acme"),))] == 1
    assert after[("cadence:inter_token_latency_seconds_count", (("tenant", "acme"),))] == 4
    assert after[("cadence:finished_requests_total", (("reason", "length"), ("tenant", "acme")))] == 1
    assert after[("cadence:e2e_request_latency_seconds_count", (("tenant", "acme"),))] == 1
    assert after[("cadence:running_requests", ())] == 0


def test_rejections_are_counted_by_reason(server):
    server.engine.begin_drain()
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        server.engine._draining = False
    s = samples(httpx.get(server.url + "/metrics").text)
    assert s[("cadence:rejected_requests_total", (("reason", "unavailable"),))] >= 1
