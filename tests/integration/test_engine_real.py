"""On the real default model, in its default dtype: a request's output does not depend on what
shares its batch, on chunking, on prefix-cache hits or on preemption.

Each scenario runs the same requests alone (one per call, prefix caching off) and together under
some pressure (64 concurrent, chunked prefill at several sizes, prefix-cache hits, preemption of
most of the requests). Outputs must be identical token for token: no tolerance for near-ties. That
holds by construction on cadence's bfloat16 CPU kernels (every kernel computes a row, and attention
a query, the same way whatever else is computed with it: tests/unit/test_exact.py), which is the
default on a CPU with AVX512-BF16; the torch fallback elsewhere is not bit-exact across batch shapes
(docs/performance.md), so these tests need the kernels.
"""

from __future__ import annotations

import pytest
import torch

from cadence import LLM, SamplingParams
from cadence.model.cpu_kernels import cpu_kernels

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels() is None, reason="exact by construction on the bfloat16 CPU kernels, "
                       "which this CPU cannot run (the torch fallback is not bit-exact across batch shapes)"),
]

MAX_TOKENS = 12
PREEMPT_TOKENS = 48  # long enough that a 16-block cache preempts most of 16 requests

_TOPICS = [
    "The history of the printing press",
    "How bees communicate",
    "A recipe for bread",
    "The rules of chess",
    "Why the sky is blue",
    "The water cycle",
    "How a bicycle works",
    "The causes of the French Revolution",
]


def _prompts(n: int) -> list[str]:
    """Mixed lengths: short questions up to paragraph-sized prompts, deterministic."""
    out = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        filler = " Please explain it clearly, with an example, for a curious student." * (i % 7)
        out.append(f"Question {i}: {topic}.{filler} Answer:")
    return out


def _shared_prefix_prompts() -> list[str]:
    system = "You are a careful assistant. Answer in one sentence, plainly, with no preamble. " * 4
    return [f"{system}Question: {t}? Answer:" for t in _TOPICS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LONG_GREEDY = SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS, ignore_eos=True)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=PREEMPT_TOKENS, ignore_eos=True)


def _roomy() -> LLM:
    """The reference engine: room for everything, no prefix caching (every prompt computed afresh)."""
    return LLM(max_num_seqs=64, max_num_batched_tokens=1024, num_kv_blocks=2048, enable_prefix_caching=False)


def _alone(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def _assert_identical(outs, want: list[list[int]], label: str, length: int = MAX_TOKENS) -> None:
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(g) == length for g in got), label
    differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not differ, f"{label}: requests {differ} differ from the same requests run alone"


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = _roomy()
    assert engine.engine.dtype == torch.bfloat16  # the default dtype on this CPU
    return engine


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[str, list[int]]:
    """Reference: each prompt of the largest scenario run by itself."""
    prompts = _prompts(64) + _shared_prefix_prompts()
    return dict(zip(prompts, _alone(llm, prompts, [GREEDY] * len(prompts)), strict=True))


def test_64_concurrent_mixed_lengths(llm: LLM, alone) -> None:
    prompts = _prompts(64)
    _assert_identical(llm.generate(prompts, GREEDY, use_tqdm=False), [alone[p] for p in prompts], "64 concurrent")


@pytest.mark.parametrize("chunk", [7, 32, 100])
def test_chunked_prefill(alone, chunk: int) -> None:
    llm = LLM(max_num_seqs=16, max_num_batched_tokens=chunk + 16, long_prefill_token_threshold=chunk,
              max_num_partial_prefills=2, num_kv_blocks=2048, enable_prefix_caching=False)
    prompts = _prompts(64)[::4]
    _assert_identical(llm.generate(prompts, GREEDY, use_tqdm=False), [alone[p] for p in prompts], f"chunk {chunk}")


def test_prefix_cache_hits_same_as_caching_off(alone) -> None:
    llm = LLM(max_num_seqs=8, enable_prefix_caching=True, num_kv_blocks=2048)
    prompts = _shared_prefix_prompts()
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 16 for o in rest), [o.num_cached_tokens for o in rest]
    _assert_identical(first + rest, [alone[p] for p in prompts], "prefix cache")


def _preempting() -> LLM:
    # 16 blocks of 16 tokens cannot hold 16 running requests of ~20-100 + 48 tokens.
    return LLM(max_num_seqs=16, num_kv_blocks=16, enable_prefix_caching=False)


def _assert_most_preempted(outs) -> None:
    preempted = sum(1 for o in outs if o.metrics.num_preemptions > 0)
    assert preempted >= len(outs) // 2, f"only {preempted} of {len(outs)} requests were preempted"


@pytest.mark.parametrize("q4_kernels", ["1", "0"])
def test_preemption_keeps_greedy_outputs(monkeypatch, q4_kernels: str) -> None:
    """Greedy, on the Q4_1 weights as stored (the default) and on their bfloat16 dequantisation."""
    monkeypatch.setenv("CADENCE_Q4_KERNELS", q4_kernels)
    prompts = _prompts(64)[:16]
    want = _alone(_roomy(), prompts, [LONG_GREEDY] * len(prompts))
    outs = _preempting().generate(prompts, LONG_GREEDY, use_tqdm=False)
    _assert_most_preempted(outs)
    _assert_identical(outs, want, f"preemption, CADENCE_Q4_KERNELS={q4_kernels}", PREEMPT_TOKENS)


def test_seeded_sampling_same_alone_batched_and_preempted(llm: LLM) -> None:
    """temperature 1 with a seed per request: the same text alone, in a batch and after preemption."""
    prompts = _prompts(64)[:16]
    params = [_seeded(i) for i in range(len(prompts))]
    want = _alone(llm, prompts, params)
    assert len({tuple(w) for w in want}) == len(want)  # really sampled: no two alike
    _assert_identical(llm.generate(prompts, params, use_tqdm=False), want, "seeded, batched", PREEMPT_TOKENS)
    outs = _preempting().generate(prompts, params, use_tqdm=False)
    _assert_most_preempted(outs)
    _assert_identical(outs, want, "seeded, preempted", PREEMPT_TOKENS)


def test_8bit_kv_cache_same_alone_chunked_cached_and_preempted() -> None:
    """--kv-cache-dtype int8: each token's K/V quantised alone when written, so the promises hold as
    with the bfloat16 cache: the same greedy tokens alone, in chunked prefill under preemption of
    most requests, and on prefix-cache hits."""
    prompts = _prompts(64)[:12] + _shared_prefix_prompts()[:4]
    roomy = LLM(max_num_seqs=64, num_kv_blocks=2048, enable_prefix_caching=False, kv_cache_dtype="int8")
    assert roomy.engine.core.executor.kv_cache.is_8bit
    want = _alone(roomy, prompts, [LONG_GREEDY] * len(prompts))
    pressed = LLM(max_num_seqs=16, num_kv_blocks=16, max_num_batched_tokens=64, long_prefill_token_threshold=24,
                  enable_prefix_caching=False, kv_cache_dtype="int8")
    outs = pressed.generate(prompts, LONG_GREEDY, use_tqdm=False)
    _assert_most_preempted(outs)
    _assert_identical(outs, want, "8-bit cache, chunked and preempted", PREEMPT_TOKENS)
    cached = LLM(max_num_seqs=8, num_kv_blocks=2048, enable_prefix_caching=True, kv_cache_dtype="int8")
    shared = prompts[12:]
    first = cached.generate(shared[:1], LONG_GREEDY, use_tqdm=False)
    rest = cached.generate(shared[1:], LONG_GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in rest), [o.num_cached_tokens for o in rest]
    _assert_identical(first + rest, want[12:], "8-bit cache, prefix cache", PREEMPT_TOKENS)
