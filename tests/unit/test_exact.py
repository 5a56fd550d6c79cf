"""Exact by construction: a position's logits are the same bits however the position was computed.

On the bfloat16 CPU kernels (the default where the CPU has AVX512-BF16), a token's hidden state and
logits must not depend on whether it was part of one prefill, of any chunking of that prefill, a
decode step, or a recompute after preemption, nor on what else shares the step. The reference is
one prefill of the whole sequence; the run under test feeds the same tokens (teacher-forced) in
random chunks, then one at a time, with random neighbours in every step and, at a random point, a
recompute of everything so far into fresh blocks (what preemption does). Every logit compared with
`torch.equal`: no tolerance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cpu_kernels import kernel_model, needs_kernels
from test_int8_kernels import int8_model, needs_vnni

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.executor.model_runner import ModelRunner
from cadence.model.attention import AttentionMetadata, SeqSpan, quantize_kv
from cadence.model.llama import INT8_TWO_TERMS, LINEAR_KINDS
from cadence.request import SamplingParams

VOCAB, BLOCK, NUM_BLOCKS = 300, 4, 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)

pytestmark = needs_kernels


@cache
def kernel_runner(q4: bool, bias: bool, kv_cache_dtype: str = "auto") -> ModelRunner:
    """A random bfloat16 model the kernels take whole (test_cpu_kernels.kernel_model)."""
    arch, weights, q4_1 = kernel_model(q4, bias, seed=21)
    runner = ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, kv_cache_dtype=kv_cache_dtype)
    assert runner.model.fused_decode is not None and runner.model.decode_kernels is not None
    assert (runner.model.layers[0].down.q4_1 is not None) == q4
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK)
    return runner


# The fused decode step's kinds of o, gate-up and down: one int8 term 2 (Q4_0, Q4_1) and 3 (Q8_0),
# two terms 4 and 5; by default gate-up in two.
INT8_KINDS = {"default": [2, 4, 3], "one": [2, 2, 3], "two": [4, 4, 5]}


@cache
def int8_runner(terms: str = "default") -> ModelRunner:
    """A random model of Q4_1, Q4_0 and Q8_0 layers and a Q8_0 output layer, on int8 activations:
    the default layer kinds in two int8 terms, none ("one") or all ("two")."""
    arch, weights, q4_1, q8_0, q4_0 = int8_model(seed=21)
    two_terms = {"default": INT8_TWO_TERMS, "one": frozenset(), "two": frozenset(LINEAR_KINDS)}[terms]
    runner = ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, q8_0=q8_0, q4_0=q4_0,
                         activation_dtype="int8", int8_two_terms=two_terms)
    assert runner.model.fused_decode is not None
    kinds = runner.model.fused_decode.kinds  # o: Q4_0, gate-up: Q4_1; down: Q8_0
    assert (kinds[:, 1:] == torch.tensor(INT8_KINDS[terms])).all(), kinds
    assert runner.model.lm_head.i8_format == "Q8_0"
    assert runner.model.lm_head.i8_terms == (2 if "output" in two_terms else 1)
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK)
    return runner


def reference_logits(runner: ModelRunner, tokens: list[int], table: list[int]) -> torch.Tensor:
    """Every position's logits from one prefill of the whole sequence. [L, V]"""
    model = runner.model
    meta = AttentionMetadata.build([SeqSpan(0, len(tokens), table)], BLOCK, torch.device("cpu"),
                                   model.arch.num_kv_heads, model.decode_kernels)
    assert runner.kv_cache is not None
    with torch.inference_mode():
        return model(torch.tensor(tokens), meta, runner.kv_cache, torch.arange(len(tokens)))


@dataclass
class Stream:
    """A request fed teacher-forced: `sizes` tokens a step (its prefill chunks, then 1s)."""

    rid: str
    tokens: list[int]
    table: list[int]
    sizes: list[int]
    pos: int = 0
    got: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits there

    def next(self) -> ScheduledRequest | None:
        if not self.sizes:
            return None
        n = self.sizes.pop(0)
        s = ScheduledRequest(self.rid, tuple(self.tokens[self.pos : self.pos + n]), self.pos, tuple(self.table),
                             True, GREEDY)
        self.pos += n
        return s


def chunking(rng: random.Random, n: int) -> list[int]:
    """n tokens cut at random points (some chunks a single token)."""
    cuts = sorted(rng.sample(range(1, n), rng.randrange(min(n, 5)))) if n > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]


def run_with_neighbours(runner: ModelRunner, target: Stream, rng: random.Random, free: list[int]) -> None:
    """Step the target until it is done, with 0-3 random neighbours (chunks or decodes) in each step."""
    neighbours: list[Stream] = []
    step = 0
    while target.sizes:
        while len(neighbours) < 3 and rng.random() < 0.5:
            n = rng.randrange(1, 30)
            nb = Stream(f"n{step}-{len(neighbours)}", [rng.randrange(VOCAB) for _ in range(n)],
                        [free.pop() for _ in range(-(-n // BLOCK))], [])
            nb.sizes = chunking(rng, n)
            neighbours.append(nb)
        scheduled = [s for s in (x.next() for x in [target, *neighbours] if rng.random() < 0.9 or x is target) if s]
        rng.shuffle(scheduled)
        logits = runner.compute_logits(SchedulerOutput(step=step, scheduled=tuple(scheduled)))
        target.got[target.pos - 1] = logits[target.rid]
        for nb in [x for x in neighbours if not x.sizes]:
            free.extend(nb.table)
            neighbours.remove(nb)
        step += 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), prompt_len=st.integers(1, 70), decodes=st.integers(1, 24),
       variant=st.sampled_from([(False, False), (True, False), (False, True)]))
def test_logits_bit_identical_however_computed(seed, prompt_len, decodes, variant):
    check_exact(kernel_runner(*variant), seed, prompt_len, decodes)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), prompt_len=st.integers(1, 70), decodes=st.integers(1, 24),
       q4=st.booleans())
def test_logits_bit_identical_however_computed_with_8bit_cache(seed, prompt_len, decodes, q4):
    """The same promise with --kv-cache-dtype int8: each token's K/V is quantised alone when written,
    so prefill, chunking, decode and recompute store and read the same bits."""
    runner = kernel_runner(q4, False, "int8")
    assert runner.kv_cache is not None and runner.kv_cache.is_8bit
    check_exact(runner, seed, prompt_len, decodes)


def check_exact(runner: ModelRunner, seed: int, prompt_len: int, decodes: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(VOCAB) for _ in range(prompt_len + decodes)]
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    blocks = -(-len(tokens) // BLOCK)
    ref = reference_logits(runner, tokens, [free.pop() for _ in range(blocks)])
    # Chunked prefill, then decodes; at a random decode, recompute everything so far into fresh
    # blocks in a new random chunking (preemption by recompute), then decode on.
    cut = prompt_len + rng.randrange(decodes)
    first = Stream("t", tokens, [free.pop() for _ in range(blocks)], chunking(rng, prompt_len) + [1] * (cut - prompt_len))
    run_with_neighbours(runner, first, rng, free)
    again = Stream("t", tokens, [free.pop() for _ in range(blocks)], chunking(rng, cut) + [1] * (len(tokens) - cut))
    run_with_neighbours(runner, again, rng, free)
    for run in (first, again):
        for pos, logits in run.got.items():
            assert torch.equal(logits, ref[pos]), f"position {pos} of {len(tokens)} (prompt {prompt_len})"
    assert len(first.got) + len(again.got) >= 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_attention_kernels_share_one_arithmetic(kv_cache_dtype):
    """The decode kernel's row and the prefill kernel's row for the same query and context: the same
    bits, over block sizes, group sizes, head sizes and lengths across 16-key chunk edges (in the
    bfloat16 cache and in the 8-bit one)."""
    from cadence.model.attention import PagedKVCache, paged_attention
    from cadence.model.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    assert kernels is not None
    cpu = torch.device("cpu")
    for kvh, g, d, bs in [(3, 3, 64, 16), (2, 2, 32, 4), (1, 8, 64, 16), (2, 1, 128, 8), (1, 5, 96, 32)]:
        gen = torch.Generator().manual_seed(kvh * 100 + d)
        for length in [1, 2, 15, 16, 17, 33, 100, 257]:
            nb = -(-length // bs) + 2
            cache = PagedKVCache.allocate(num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                          dtype=torch.bfloat16, device=cpu, kv_cache_dtype=kv_cache_dtype)
            values = torch.randn(*cache.kv.shape[:-1], d, generator=gen).to(torch.bfloat16)
            cache.kv.copy_(quantize_kv(values) if cache.is_8bit else values)
            table = random.Random(length).sample(range(nb), -(-length // bs))
            qkv = torch.randn(1, kvh * g + 2 * kvh, d, generator=gen).to(torch.bfloat16)
            q, kv_new = qkv[:, : kvh * g], qkv[:, kvh * g :].unflatten(1, (2, kvh))
            meta = AttentionMetadata.build([SeqSpan(length - 1, 1, table)], bs, cpu, num_kv_heads=kvh, kernels=kernels)
            decoded = paged_attention(q, kv_new, cache.layer(0), meta)
            prefilled = kernels.prefill_attention(q, cache.layer(0), torch.tensor(table), length - 1)
            assert torch.equal(decoded, prefilled), (kvh, g, d, bs, length)


@needs_vnni
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), prompt_len=st.integers(1, 70), decodes=st.integers(1, 24))
@pytest.mark.parametrize("terms", list(INT8_KINDS))
def test_int8_activations_bit_identical_however_computed(terms, seed, prompt_len, decodes):
    """The same with int8 activations: each row quantized on its own (in one int8 term or two), the
    same kernels for a prefill chunk's rows and in the all-decode step."""
    check_exact(int8_runner(terms), seed, prompt_len, decodes)
