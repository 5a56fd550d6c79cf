"""A fleet's /metrics: the replicas' expositions merged (metrics/prometheus.merge_expositions)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cadence.boundary import IterationStats, SchedulerStats
from cadence.metrics.prometheus import PrometheusExporter, merge_expositions


def _replica(prompt: int, generated: int, ttfts: list[float], running: int) -> str:
    e = PrometheusExporter()
    e.record_step(IterationStats(num_prompt_tokens=prompt, num_generation_tokens=generated,
                                 first_token_latencies=[("default", t) for t in ttfts]),
                  SchedulerStats(num_running=running, num_waiting=1))
    return e.render()[0].decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_counters_and_buckets_add_gauges_per_replica_and_summed() -> None:
    ingress = PrometheusExporter()
    ingress.record_rejection("queue_full", 3)
    ingress.record_scheduler(SchedulerStats(num_running=99))  # (not the fleet's: left out)
    merged = _samples(merge_expositions(ingress.render()[0].decode(), {
        "r1": _replica(10, 4, [0.03, 0.3], running=2),
        "r2": _replica(5, 6, [0.03], running=3),
    }))
    assert merged[("cadence:prompt_tokens_total", ())] == 15
    assert merged[("cadence:generation_tokens_total", ())] == 10
    assert merged[("cadence:rejected_requests_total", (("reason", "queue_full"),))] == 3
    ttft = "cadence:time_to_first_token_seconds"
    assert merged[(f"{ttft}_count", (("tenant", "default"),))] == 3
    assert merged[(f"{ttft}_bucket", (("le", "0.04"), ("tenant", "default")))] == 2
    assert merged[(f"{ttft}_bucket", (("le", "+Inf"), ("tenant", "default")))] == 3
    assert merged[("cadence:running_requests", ())] == 5
    assert merged[("cadence:running_requests", (("replica", "r1"),))] == 2
    assert merged[("cadence:running_requests", (("replica", "r2"),))] == 3
    assert merged[("cadence:waiting_requests", ())] == 2


def test_the_same_names_as_a_single_server() -> None:
    single = {fam.name for fam in text_string_to_metric_families(_replica(1, 1, [0.1], 1))}
    fleet = {fam.name for fam in text_string_to_metric_families(
        merge_expositions(PrometheusExporter().render()[0].decode(), {"r": _replica(1, 1, [0.1], 1)}))}
    assert fleet == single


def test_a_replica_gone_keeps_its_counters_not_its_gauges() -> None:
    """A replica that died (or did not answer the scrape) counts with its last exposition: the
    fleet's counters never go down (Prometheus would read a reset); its gauges are not shown."""
    ingress = PrometheusExporter().render()[0].decode()
    r1, r2 = _replica(10, 4, [0.03], running=2), _replica(5, 6, [0.03], running=3)
    both = _samples(merge_expositions(ingress, {"r1": r1, "r2": r2}))
    after = _samples(merge_expositions(ingress, {"r2": r2}, retired={"r1": r1}))
    for key, value in both.items():
        if key[0].endswith(("_total", "_bucket", "_count", "_sum")):
            assert after[key] == value, key
    assert after[("cadence:running_requests", ())] == 3
    assert ("cadence:running_requests", (("replica", "r1"),)) not in after
