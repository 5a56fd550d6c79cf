"""`--metrics-compat vllm`: cadence's measurements again under vLLM's metric names and labels.

vLLM's dashboards and alerts query `vllm:*` series labelled `model_name` (and `engine`, one per
engine process: always "0" here). `VllmMetrics` is fed from the same per-step records as the
`cadence:*` series (`PrometheusExporter` calls it), with vLLM's histogram buckets, so the counts
and sums agree with cadence's own and the quantiles match what a vLLM dashboard expects.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cadence.boundary import FinishedRequestStats, IterationStats, SchedulerStats

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LABELS = ("model_name", "engine")
ENGINE = "0"


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.labels = (model_name, ENGINE)
        r = registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(*self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_kv_usage = gauge("vllm:gpu_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage (vLLM's older name).")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.cache_queries = counter("vllm:prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.")
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", (*LABELS, "position"), registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*LABELS, "finished_reason"), registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (vLLM's older name for the "
                              "inter-token latency).", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", TOKEN_COUNT_BUCKETS)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", TOKEN_COUNT_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)

    def record_scheduler(self, st: SchedulerStats) -> None:
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_usage.set(st.kv_usage)
        self.gpu_kv_usage.set(st.kv_usage)

    def record_step(self, it: IterationStats) -> None:
        # vLLM counts a request's whole prompt (prefix-cache hits too) once, as its first token comes.
        for counter, amount in ((self.prompt_tokens, it.first_token_prompt_tokens),
                                (self.generation_tokens, it.num_generation_tokens),
                                (self.preemptions, it.num_preemptions),
                                (self.cache_queries, it.prefix_cache_queries),
                                (self.cache_hits, it.prefix_cache_hits),
                                (self.spec_drafts, it.num_drafts),
                                (self.spec_draft_tokens, it.num_draft_tokens),
                                (self.spec_accepted_tokens, it.num_accepted_tokens)):
            if amount > 0:
                counter.inc(amount)
        if it.num_prompt_tokens or it.num_generation_tokens:  # a step that computed something
            # As vLLM: the prompts counted in vllm:prompt_tokens this step, and the tokens sampled.
            self.iteration_tokens.observe(it.first_token_prompt_tokens + it.num_generation_tokens)
        for pos, n in enumerate(it.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(*self.labels, str(pos)).inc(n)
        for _, seconds in it.first_token_latencies:
            self.ttft.observe(seconds)
        for _, seconds in it.token_latencies:
            self.itl.observe(seconds)
            self.tpot.observe(seconds)

    def record_finished(self, f: FinishedRequestStats) -> None:
        self.success.labels(*self.labels, f.finish_reason).inc()
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_output_tokens)
        if f.max_tokens:
            self.request_max_tokens.observe(f.max_tokens)
        m = f.metrics
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None and m.finished_time is not None:
            self.decode_time.observe(max(0.0, m.finished_time - m.first_token_time))
        if m.first_scheduled_time is not None and m.finished_time is not None:
            self.inference_time.observe(max(0.0, m.finished_time - m.first_scheduled_time))
