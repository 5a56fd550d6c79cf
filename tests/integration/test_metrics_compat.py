"""`--metrics-compat vllm`: vLLM's series names and labels, from the same measurements as cadence's."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from test_metrics import samples

from cadence.boundary import FinishedRequestStats, IterationStats, RequestMetrics, SchedulerStats
from cadence.cli import build_parser, serve_configs
from cadence.metrics.prometheus import PrometheusExporter

VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_sum", "vllm:request_params_max_tokens_count",
    "vllm:iteration_tokens_total_bucket",
]


def by_name(s: dict, name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in s.items() if n == name}


def total(s: dict, name: str) -> float:
    return sum(by_name(s, name).values())


def test_off_by_default():
    exp = PrometheusExporter()
    exp.record_step(IterationStats(num_prompt_tokens=3), SchedulerStats(num_running=1))
    assert not [k for k in samples(exp.render()[0]) if k[0].startswith("vllm:")]


def test_fed_by_hand_the_vllm_series_mirror_cadences():
    exp = PrometheusExporter(vllm_model_name="m1")
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.5, first_token_time=0.75, finished_time=2.0)
    it = IterationStats(num_prompt_tokens=40, num_generation_tokens=3, num_preemptions=2, prefix_cache_queries=32,
                        prefix_cache_hits=16, token_latencies=[("a", 0.02), ("b", 0.03)],
                        first_token_latencies=[("a", 0.75)],
                        finished=[FinishedRequestStats("r", "a", 0, "length", 5, 9, 0, m, max_tokens=9)])
    exp.record_step(it, SchedulerStats(num_running=3, num_waiting=4, kv_usage=0.25))
    s = samples(exp.render()[0])
    lab = (("engine", "0"), ("model_name", "m1"))
    assert s[("vllm:num_requests_running", lab)] == 3 and s[("vllm:num_requests_waiting", lab)] == 4
    assert s[("vllm:kv_cache_usage_perc", lab)] == 0.25
    assert s[("vllm:prompt_tokens_total", lab)] == 0  # no first token's request here says its prompt
    assert s[("vllm:generation_tokens_total", lab)] == 3
    assert s[("vllm:num_preemptions_total", lab)] == 2
    assert s[("vllm:prefix_cache_queries_total", lab)] == 32 and s[("vllm:prefix_cache_hits_total", lab)] == 16
    assert s[("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length"), ("model_name", "m1")))] == 1
    assert s[("vllm:inter_token_latency_seconds_count", lab)] == 2
    assert s[("vllm:inter_token_latency_seconds_sum", lab)] == pytest.approx(0.05)
    assert s[("vllm:time_to_first_token_seconds_sum", lab)] == 0.75
    assert s[("vllm:request_queue_time_seconds_sum", lab)] == 0.5
    assert s[("vllm:request_prefill_time_seconds_sum", lab)] == 0.25
    assert s[("vllm:request_decode_time_seconds_sum", lab)] == 1.25
    assert s[("vllm:request_inference_time_seconds_sum", lab)] == 1.5
    assert s[("vllm:e2e_request_latency_seconds_sum", lab)] == 2.0
    assert s[("vllm:request_generation_tokens_sum", lab)] == 9
    assert s[("vllm:request_params_max_tokens_sum", lab)] == 9 and s[("vllm:request_params_max_tokens_count", lab)] == 1
    # One step: no first token's prompt (as vllm:prompt_tokens_total), 3 tokens sampled.
    assert s[("vllm:iteration_tokens_total_sum", lab)] == 3 and s[("vllm:iteration_tokens_total_count", lab)] == 1
    exp.record_step(IterationStats(), None)  # a step that computed nothing (an abort between steps)
    assert samples(exp.render()[0])[("vllm:iteration_tokens_total_count", lab)] == 1


def test_the_serve_flag_reaches_the_server_config():
    args = build_parser().parse_args(["serve", "--tiny", "--metrics-compat", "vllm"])
    assert serve_configs(args)[1].metrics_compat == ("vllm",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-compat", "tgi"])


def test_a_scrape_after_a_workload_has_the_vllm_series_agreeing_with_cadences(server_factory):
    # A KV cache of 16 blocks of 16 tokens for 8 requests of ~90 tokens: some get preempted.
    live = server_factory({"num_kv_blocks": 16, "max_num_seqs": 8}, metrics_compat=("vllm",))
    prompt = "the same long prefix of words shared by every request " * 3

    def one(i: int) -> int:
        body = {"prompt": prompt + str(i), "max_tokens": 60, "ignore_eos": True, "stream": i % 2 == 0}
        return httpx.post(live.url + "/v1/completions", json=body, headers={"X-Tenant": f"t{i % 3}"},
                          timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert set(pool.map(one, range(8))) == {200}
    assert live.wait_idle()
    s = samples(httpx.get(live.url + "/metrics").text)
    model = live.engine.model_name
    for name in VLLM_NAMES:
        series = by_name(s, name)
        assert series, f"{name} missing"
        assert all(dict(labels)["model_name"] == model for labels in series), name
    pairs = [
        ("vllm:generation_tokens_total", "cadence:generation_tokens_total"),
        ("vllm:num_preemptions_total", "cadence:preempted_requests_total"),
        ("vllm:prefix_cache_queries_total", "cadence:prefix_cache_query_tokens_total"),
        ("vllm:prefix_cache_hits_total", "cadence:prefix_cache_hit_tokens_total"),
        ("vllm:request_success_total", "cadence:finished_requests_total"),
        ("vllm:num_requests_running", "cadence:running_requests"),
        ("vllm:num_requests_waiting", "cadence:waiting_requests"),
        ("vllm:kv_cache_usage_perc", "cadence:kv_cache_usage_ratio"),
    ]
    for kind in ("count", "sum"):
        for v, c in (("time_to_first_token", "time_to_first_token"), ("inter_token_latency", "inter_token_latency"),
                     ("e2e_request_latency", "e2e_request_latency"), ("request_queue_time", "request_queue_time")):
            pairs.append((f"vllm:{v}_seconds_{kind}", f"cadence:{c}_seconds_{kind}"))
    for v, c in pairs:
        assert total(s, v) == pytest.approx(total(s, c)), (v, c)
    assert total(s, "vllm:num_preemptions_total") > 0, "the workload was meant to preempt"
    # As vLLM counts it: every request's whole prompt, prefix-cache hits included, once (at its first
    # token), not the prompt tokens computed (hits left out, recomputation after preemption counted).
    assert total(s, "vllm:prompt_tokens_total") == total(s, "vllm:request_prompt_tokens_sum")
    assert total(s, "vllm:prompt_tokens_total") != total(s, "cadence:prompt_tokens_total")
    assert total(s, "vllm:prefix_cache_hits_total") > 0
    assert total(s, "vllm:request_success_total") == 8
    assert total(s, "vllm:request_params_max_tokens_count") == 8 and total(s, "vllm:request_params_max_tokens_sum") == 8 * 60
    # Every token a step sampled, and every prompt once, is in one step's observation.
    assert total(s, "vllm:iteration_tokens_total_sum") == (
        total(s, "vllm:generation_tokens_total") + total(s, "vllm:prompt_tokens_total"))
    assert by_name(s, "vllm:request_success_total") == {
        (("engine", "0"), ("finished_reason", "length"), ("model_name", model)): 8.0}


def test_speculative_decoding_counters_under_both_names():
    exp = PrometheusExporter(vllm_model_name="m1")
    exp.record_step(IterationStats(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=5,
                                   num_accepted_tokens_per_pos=[2, 2, 1]), None)
    exp.record_step(IterationStats(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=0), None)
    s = samples(exp.render()[0])
    lab = (("engine", "0"), ("model_name", "m1"))
    assert s[("cadence:spec_decode_num_drafts_total", ())] == s[("vllm:spec_decode_num_drafts_total", lab)] == 3
    assert s[("cadence:spec_decode_num_draft_tokens_total", ())] == 10
    assert s[("vllm:spec_decode_num_draft_tokens_total", lab)] == 10
    assert s[("cadence:spec_decode_num_accepted_tokens_total", ())] == 5
    assert s[("vllm:spec_decode_num_accepted_tokens_total", lab)] == 5
    assert s[("cadence:spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),))] == 1
    assert s[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*lab, ("position", "0")))] == 2
    assert s[("cadence:spec_decode_acceptance_ratio", ())] == 0.5


def test_vllm_prompt_tokens_count_each_request_prompt_once_at_its_first_token():
    exp = PrometheusExporter(vllm_model_name="m1")
    # A step that computes 24 prompt tokens (a 40-token prompt with 16 found in the prefix cache)
    # and samples that request's first token; then a recomputation after a preemption.
    exp.record_step(IterationStats(num_prompt_tokens=24, num_generation_tokens=1, first_token_prompt_tokens=40,
                                   first_token_latencies=[("a", 0.1)]), SchedulerStats(num_running=1))
    exp.record_step(IterationStats(num_prompt_tokens=30, num_generation_tokens=1), SchedulerStats(num_running=1))
    s = samples(exp.render()[0])
    assert s[("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", "m1")))] == 40
    assert s[("cadence:prompt_tokens_total", ())] == 54


def test_the_drafts_each_row_verified_are_a_histogram_with_turned_down_rows_at_zero():
    exp = PrometheusExporter(vllm_model_name="m1")
    exp.record_step(IterationStats(num_drafts=2, num_draft_tokens=6, chosen_draft_tokens=[0, 0, 4, 2]), None)
    exp.record_step(IterationStats(chosen_draft_tokens=[0]), None)  # a step that turned every row down
    exp.record_step(IterationStats(), None)  # a step without speculation adds nothing
    s = samples(exp.render()[0])
    name = "cadence:spec_decode_chosen_draft_tokens"
    assert s[(f"{name}_count", ())] == 5 and s[(f"{name}_sum", ())] == 6
    assert s[(f"{name}_bucket", (("le", "0.0"),))] == 3
    assert s[(f"{name}_bucket", (("le", "2.0"),))] == 4
    assert s[(f"{name}_bucket", (("le", "4.0"),))] == 5
