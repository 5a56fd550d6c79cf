"""Plain data the engine core emits each step; exporters (Prometheus, the benchmark) read it.

The scheduler never imports an exporter: it fills these records and the engine passes them on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cadence.sched.output import RequestMetrics


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges: the state after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use by running requests
    num_live_tokens: int = 0  # tokens whose KV is held by running requests
    num_free_blocks: int = 0
    num_total_blocks: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    request_id: str
    tenant: str
    priority: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclass
class IterationStats:
    """Counters: what one step did."""

    step: int = 0
    now: float = 0.0
    step_time: float = 0.0  # seconds spent in execute()
    num_prompt_tokens: int = 0  # prefill tokens computed this step
    num_generation_tokens: int = 0  # tokens sampled this step
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    token_latencies: list[tuple[str, float]] = field(default_factory=list)  # (tenant, seconds since the previous token) per decode token
    first_token_latencies: list[tuple[str, float]] = field(default_factory=list)  # (tenant, ttft)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count


@dataclass(frozen=True)
class QueueCensus:
    """Who waits and runs, and what the KV cache keeps: counted by walking the queues, so taken
    now and then (the dashboard's, while one is watched), never every step."""

    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting_by_priority: dict[int, int] = field(default_factory=dict)
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    num_cached_free_blocks: int = 0  # free blocks still holding a prefix a later hit can reuse

    @classmethod
    def of(cls, waiting: Iterable[Any], running: Iterable[Any], num_cached_free_blocks: int) -> QueueCensus:
        """From the requests (anything with `tenant` and `priority`) waiting and running."""
        by_tenant: Counter[str] = Counter()
        by_priority: Counter[int] = Counter()
        for r in waiting:
            by_tenant[r.tenant] += 1
            by_priority[r.priority] += 1
        running_by_tenant = Counter(r.tenant for r in running)
        return cls(dict(by_tenant), dict(by_priority), dict(running_by_tenant), num_cached_free_blocks)
