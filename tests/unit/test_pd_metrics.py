"""A disaggregated fleet's merged /metrics count each request once: the ingress (`PDFleetClient`)
drives two real `PDReplica`s in this process (no Ray cluster), and the sum of their expositions
is compared with one engine's for the same requests."""

from __future__ import annotations

import asyncio
import inspect
from collections import defaultdict
from typing import Any

import pytest

pytest.importorskip("ray")  # (the fleet's extra: `make serve` / `make test` install it)

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cadence.config import EngineConfig  # noqa: E402
from cadence.fleet.protocol import GenerateCall, deltas_of  # noqa: E402
from cadence.fleet.replica import ReplicaInfo  # noqa: E402
from cadence.metrics.prometheus import merge_expositions  # noqa: E402
from cadence.request import SamplingParams  # noqa: E402

CONFIG = {"num_kv_blocks": 64, "block_size": 16, "max_model_len": 512, "device": "cpu", "dtype": "float32",
          "num_threads": 1, "max_num_seqs": 4}
# Distinct prompts (nothing cached between them), ending mid-block, and their output lengths.
PROMPTS = [[(7 * i + 13 * j) % 500 + 10 for i in range(40 + 9 * j)] for j in range(3)]
MAX_TOKENS = (6, 9, 3)
COUNTED = ("cadence:finished_requests_total", "cadence:goodput_requests_total", "cadence:prompt_tokens_total",
           "cadence:generation_tokens_total", "cadence:time_to_first_token_seconds_count",
           "cadence:inter_token_latency_seconds_count", "cadence:e2e_request_latency_seconds_count",
           "cadence:request_queue_time_seconds_count", "vllm:request_success_total",
           "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
           "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count")


class _Stream:
    """A Serve streaming response over a replica's async generator."""

    def __init__(self, gen: Any) -> None:
        self._gen = gen

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self._gen.aclose())


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        out = self.fn(*args)
        return _Stream(out) if inspect.isasyncgen(out) else out


class _Handle:
    """A Serve handle to one replica: `handle.options(...).method.remote(...)` calls it."""

    def __init__(self, replica: Any) -> None:
        self._replica = replica

    def options(self, **_: Any) -> _Handle:
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._replica, name))


def _replicas(n: int) -> list[Any]:
    from cadence.fleet.pd import PDReplica

    cfg = EngineConfig.from_options(**CONFIG)
    return [PDReplica(cfg, tiny=True, metrics_compat=("vllm",)) for _ in range(n)]


def _totals(exposition: str) -> dict[str, float]:
    """Every sample's value summed over its labels (replicas, tenants, reasons)."""
    totals: dict[str, float] = defaultdict(float)
    for fam in text_string_to_metric_families(exposition):
        for s in fam.samples:
            totals[s.name] += s.value
    return totals


async def _through_pd(prefill: Any, decode: Any) -> list[list[int]]:
    from cadence.fleet.pd_client import PDFleetClient

    info = ReplicaInfo("tiny", 512, 512, 1000, 16, "sha256")
    client = PDFleetClient(_Handle(prefill), _Handle(decode), info, tokenizer=None,
                           engine_config=EngineConfig.from_options(**CONFIG), transfer_timeout=10.0)
    outputs = []
    for j, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        stream = await client.submit([prompt], params, request_id=f"r{j}")
        outputs.append([t async for d in stream for t in d.token_ids])
    for r in (prefill, decode):
        await r.engine.run_in_engine(lambda: None)  # (its last steps' stats are recorded)
    return outputs


async def _on_one(engine: Any) -> list[list[int]]:
    outputs = []
    for j, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        # (deltas ready at once travel as one `Deltas` item)
        items = [d async for i in engine.generate(GenerateCall((prompt,), params, f"r{j}")) for d in deltas_of(i)]
        outputs.append([t for i in items for t in getattr(i, "token_ids", ())])
    await engine.engine.run_in_engine(lambda: None)
    return outputs


def test_the_merged_metrics_of_a_pd_fleet_count_each_request_as_one_engine_does() -> None:
    prefill, decode, one = _replicas(3)
    try:
        outputs = asyncio.run(_through_pd(prefill, decode))
        expected = asyncio.run(_on_one(one))
        merged = _totals(merge_expositions("", {"p": prefill.metrics(), "d": decode.metrics()}))
        single = _totals(one.metrics())
    finally:
        for r in (prefill, decode, one):
            r.engine.shutdown()
    assert outputs == expected  # (the same work: greedy outputs equal)
    assert single["cadence:finished_requests_total"] == 3
    assert {k: merged[k] for k in COUNTED} == {k: single[k] for k in COUNTED}
    # The request's e2e latency spans its first token and every gap after it (one engine's exactly,
    # the fleet's plus the moves between the ingress and the replicas).
    ttft, itl = merged["cadence:time_to_first_token_seconds_sum"], merged["cadence:inter_token_latency_seconds_sum"]
    assert merged["cadence:e2e_request_latency_seconds_sum"] >= ttft + itl - 1e-6
