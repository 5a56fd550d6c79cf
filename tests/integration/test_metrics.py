"""The Prometheus exporter (fed by hand) and /metrics on a live server (fed by real requests)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cadence.boundary import FinishedRequestStats, IterationStats, RequestMetrics, SchedulerStats
from cadence.engine.thread_times import PHASES, EngineThreadTimes
from cadence.metrics.prometheus import PrometheusExporter, meets_slo

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
    # The HTTP side counts refusals as it answers them; the step's own count would arrive late (or never).
    assert ("cadence:rejected_requests_total", (("reason", "queue_full"),)) not in s
    assert s[("cadence:running_requests", ())] == 3 and s[("cadence:waiting_requests", ())] == 4
    assert s[("cadence:kv_cache_usage_ratio", ())] == 0.25 and s[("cadence:live_tokens", ())] == 99
    assert s[("cadence:time_to_first_token_seconds_count", (("tenant", "a"),))] == 1
    assert s[("cadence:inter_token_latency_seconds_count", (("tenant", "b"),))] == 1
    assert s[("cadence:e2e_request_latency_seconds_sum", (("tenant", "a"),))] == 1.0
    assert s[("cadence:request_queue_time_seconds_sum", (("tenant", "a"),))] == 0.05
    assert s[("cadence:finished_requests_total", (("reason", "stop"), ("tenant", "a")))] == 1
    assert s[("cadence:goodput_requests_total", (("tenant", "a"),))] == 1  # no SLO: every success counts


def test_refusals_are_counted_as_recorded_not_from_engine_steps():
    exp = PrometheusExporter()
    exp.record_step(IterationStats(rejections={"queue_full": 2}), None)
    exp.record_rejection("queue_full")
    s = samples(exp.render()[0])
    assert s[("cadence:rejected_requests_total", (("reason", "queue_full"),))] == 1


def test_queue_time_buckets_resolve_sub_millisecond_waits():
    exp = PrometheusExporter()
    exp.record_step(IterationStats(finished=[finished(queued=0.0003), finished(queued=0.004)]), None)
    s = samples(exp.render()[0])
    bucket = "cadence:request_queue_time_seconds_bucket"
    assert s[(bucket, (("le", "0.001"), ("tenant", "a")))] == 1
    assert s[(bucket, (("le", "0.005"), ("tenant", "a")))] == 2
    assert s[(bucket, (("le", "960.0"), ("tenant", "a")))] == 2


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
    exp.watch_thread_times(lambda: EngineThreadTimes().as_dict())
    names = {fam.name for fam in text_string_to_metric_families(exp.render()[0].decode())}
    doc = DOCS.read_text()
    assert len(names) >= 16
    for name in names:
        # A unit suffix on every name but the one state without a unit (1 or 0); the speculative
        # decoding counters keep vLLM's names (drafts, and accepted tokens per position).
        assert re.fullmatch(r"cadence:[a-z0-9_]+_(seconds|ratio|requests|tokens|spans|steps|drafts)"
                            r"|cadence:engine_healthy|cadence:spec_decode_num_accepted_tokens_per_pos", name), name
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


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_refusals_are_counted_at_once_even_on_an_idle_engine(server):
    """Every refused generation request counts once, when it is answered: the server's own 400s (bad
    body, bad parameter, prompt longer than the context) and the engine's (prompt + max_tokens over
    max_model_len), with no engine step after them."""
    url = server.url
    before = samples(httpx.get(url + "/metrics").text)
    refused = [
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
        ("/v1/completions", {"prompt": "hi " * 2000, "max_tokens": 5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 2000}], "max_tokens": 5}),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 1024, "n": 2}),  # refused by the engine
    ]
    for path, body in refused:
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert server.wait_idle()
    after = samples(httpx.get(url + "/metrics").text)
    assert delta(before, after, "cadence:rejected_requests_total", reason="invalid_request") == len(refused) + 1
    assert delta(before, after, "cadence:prompt_tokens_total") == 0


def test_a_request_with_two_choices_counts_each_choice_once(server):
    url = server.url
    before = samples(httpx.get(url + "/metrics").text)
    body = {"prompt": "Two choices", "max_tokens": 4, "n": 2, "ignore_eos": True, "temperature": 1.0}
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Tenant": "twice"}, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 8
    assert server.wait_idle()
    after = samples(httpx.get(url + "/metrics").text)
    t = {"tenant": "twice"}
    assert delta(before, after, "cadence:generation_tokens_total") == usage["completion_tokens"]
    assert delta(before, after, "cadence:time_to_first_token_seconds_count", **t) == 2
    assert delta(before, after, "cadence:inter_token_latency_seconds_count", **t) == 2 * 3
    assert delta(before, after, "cadence:e2e_request_latency_seconds_count", **t) == 2
    assert delta(before, after, "cadence:request_queue_time_seconds_count", **t) == 2
    assert delta(before, after, "cadence:finished_requests_total", reason="length", **t) == 2
    # Prompt tokens: computed per choice, less the prefix-cache hits (usage counts the prompt once).
    computed = delta(before, after, "cadence:prompt_tokens_total")
    queried = delta(before, after, "cadence:prefix_cache_query_tokens_total")
    hits = delta(before, after, "cadence:prefix_cache_hit_tokens_total")
    assert queried == 2 * usage["prompt_tokens"] and computed == queried - hits


def _finished(text: str, tenant: str) -> float:
    return sum(v for (name, labels), v in samples(text).items()
               if name == "cadence:finished_requests_total" and ("tenant", tenant) in labels)


def _poll_finished(url: str, tenant: str, want: float, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        got = _finished(httpx.get(url + "/metrics").text, tenant)
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_finishes_between_steps_are_counted_when_the_engine_goes_idle(server):
    """An abort (the client leaves) or a stop string found in the text ends a request between
    engine steps, into the next step's stats. With nothing else to run no step follows: the
    engine reports them as it goes idle (they used to wait for the next request's first step)."""
    url = server.url
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    r = httpx.post(url + "/v1/completions", json={**body, "stop": [stop]}, headers={"X-Tenant": "idle-stop"},
                   timeout=60)
    assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert r.json()["usage"]["queue_time"] is not None  # a stop string's finish keeps its metrics
    assert _poll_finished(url, "idle-stop", 1) == 1
    with httpx.stream("POST", url + "/v1/completions", headers={"X-Tenant": "idle-abort"}, timeout=60,
                      json={**body, "max_tokens": 400, "stream": True}) as s:
        next(s.iter_lines())  # the first event: the request runs; then the client leaves
    assert server.wait_idle()
    assert _poll_finished(url, "idle-abort", 1) == 1
    after = httpx.get(url + "/metrics").text
    assert samples(after)[("cadence:running_requests", ())] == 0


def test_engine_thread_times_account_for_its_uptime_and_its_work(server):
    """The phases are measured back to back, so they add up to the thread's running time; the
    forward passes of real requests show in `execute`, and each step's output reaches the HTTP side."""
    start = samples(httpx.get(server.url + "/metrics").text)
    t0 = time.monotonic()
    for _ in range(3):
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True, "stream": True})
        assert r.status_code == 200
    s = samples(httpx.get(server.url + "/metrics").text)
    elapsed = time.monotonic() - t0

    def grew(name, labels=()):
        return s[(name, labels)] - start.get((name, labels), 0.0)

    phase = {p: grew("cadence:engine_thread_seconds_total", (("phase", p),)) for p in PHASES}
    assert set(phase) == {"idle", "inbox", "schedule_update", "execute", "detokenize", "publish"}
    # Every phase is a share of the time that passed (the last pass may be open at either scrape).
    assert sum(phase.values()) <= elapsed + 0.6
    assert sum(phase.values()) >= elapsed - 0.6
    assert phase["execute"] > 0 and phase["schedule_update"] > 0 and phase["detokenize"] > 0
    assert grew("cadence:engine_steps_total") >= 3 * 8
    busy = sum(v for p, v in phase.items() if p != "idle")
    assert 0 < grew("cadence:engine_thread_busy_cpu_seconds_total") <= busy + 0.05
    handed = grew("cadence:engine_handoff_steps_total")
    assert handed >= 3 * 8
    assert 0 <= grew("cadence:engine_handoff_delay_seconds_total") / handed < 1.0


def test_the_engine_thread_is_named_where_the_os_shows_it(server):
    """top -H and /proc show which thread is the engine's (benchmarks/serving_breakdown.py reads it)."""
    names = {Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task")}
    assert "cadence-engine" in names
