"""A verification row's logits are a decode step's, bit for bit, on the bfloat16 CPU kernels: at each
of its 1 + k positions, beside other requests in the step, and after rejected drafts left their K/V
in slots that the next row writes over.

The reference is one prefill of the whole sequence (every position's logits); the run under test
prefills a prefix, then feeds the rest as verification rows whose drafts are partly wrong (the
wrong ones stand for rejected drafts: the next row starts again at the first of them, as the
scheduler does after a rejection)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cpu_kernels import needs_kernels
from test_exact import BLOCK, GREEDY, NUM_BLOCKS, VOCAB, kernel_runner, reference_logits

from cadence.boundary import ScheduledRequest, SchedulerOutput

pytestmark = needs_kernels


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), prompt_len=st.integers(2, 40), decodes=st.integers(2, 24))
def test_verification_rows_give_the_decode_logits(seed: int, prompt_len: int, decodes: int) -> None:
    runner = kernel_runner(False, False)
    rng = random.Random(seed)
    tokens = [rng.randrange(VOCAB) for _ in range(prompt_len + decodes)]
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    blocks = -(-len(tokens) // BLOCK) + 4  # room for drafts past the end
    ref = reference_logits(runner, tokens, [free.pop() for _ in range(blocks - 4)])
    table = tuple(free.pop() for _ in range(blocks))
    runner.compute_logits(SchedulerOutput(0, (ScheduledRequest("t", tuple(tokens[:prompt_len]), 0, table, True, GREEDY),)))
    pos, step, checked = prompt_len, 1, 0  # pos: the first position not computed; its token is fed first
    while pos < len(tokens):
        k = rng.randint(1, 4)
        right = min(rng.randint(0, k), len(tokens) - 1 - pos)  # drafts that match the sequence; the rest are wrong
        drafts = tokens[pos + 1 : pos + 1 + right] + [rng.randrange(VOCAB) for _ in range(k - right)]
        row = ScheduledRequest("t", (tokens[pos], *drafts), pos, table, True, GREEDY, num_draft_tokens=k)
        neighbour_len = rng.randrange(1, 20)
        neighbour = ScheduledRequest("n", tuple(rng.randrange(VOCAB) for _ in range(neighbour_len)), 0,
                                     tuple(free[: -(-neighbour_len // BLOCK)]), True, GREEDY)
        scheduled = [row, neighbour] if rng.random() < 0.5 else [row]
        got = runner.compute_logits(SchedulerOutput(step, tuple(scheduled)))["t"]
        assert got.shape[0] == 1 + k
        # Positions pos .. pos + right hold true tokens: their logits are the reference's.
        for i in range(right + 1):
            assert torch.equal(got[i], ref[pos + i]), f"position {pos + i} (row of {1 + k} at {pos})"
            checked += 1
        pos += right + 1  # the kept tokens; the next row overwrites the wrong drafts' slots
        step += 1
    assert checked == decodes  # every position after the prompt, once


@pytest.mark.parametrize("variant", [(False, False, "auto"), (True, True, "auto"), (True, False, "int8")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verification_step_through_the_fused_kernel_matches_the_layer_path(variant, seed) -> None:
    """A step of a verification row beside decodes runs through the one-call decode kernel, its row
    laid out as single-token decodes sharing one block table, and gives the per-layer path's logits
    and cache bit for bit. The row's slots first hold K/V of other, rejected drafts: a row that
    attended before the rows before it wrote their K/V would read those."""
    runner = kernel_runner(*variant)
    assert runner.kv_cache is not None
    rng = random.Random(seed)
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    k = rng.randint(2, 6)
    prompt_len = rng.randint(BLOCK * 2 - 2, 40)
    table = tuple(free.pop() for _ in range(-(-(prompt_len + 1 + k) // BLOCK)))
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_len + 1)]
    runner.compute_logits(SchedulerOutput(0, (ScheduledRequest("t", tuple(prompt[:-1]), 0, table, True, GREEDY),)))
    others = []
    for i in range(2):
        n = rng.randint(1, 30)
        ctx = tuple(rng.randrange(VOCAB) for _ in range(n))
        t = tuple(free.pop() for _ in range(-(-(n + 1) // BLOCK)))
        runner.compute_logits(SchedulerOutput(0, (ScheduledRequest(f"d{i}", ctx, 0, t, True, GREEDY),)))
        others.append(ScheduledRequest(f"d{i}", (rng.randrange(VOCAB),), n, t, True, GREEDY))

    def row(drafts: list[int]) -> ScheduledRequest:
        return ScheduledRequest("t", (prompt[-1], *drafts), prompt_len, table, True, GREEDY, num_draft_tokens=k)

    runner.compute_logits(SchedulerOutput(1, (row([rng.randrange(VOCAB) for _ in range(k)]),)))  # rejected
    step = SchedulerOutput(2, (row([rng.randrange(VOCAB) for _ in range(k)]), *others))
    batch = runner.prepare(step.scheduled)
    assert not batch.meta.prefills and batch.meta.decodes[0].num_rows == 1 + k + len(others)  # one-call path
    before = runner.kv_cache.kv.clone()
    fused = runner.compute_logits(step)
    after_fused = runner.kv_cache.kv.clone()
    runner.kv_cache.kv.copy_(before)
    model = runner.model
    kept, model.fused_decode = model.fused_decode, None
    try:
        layered = runner.compute_logits(step)
    finally:
        model.fused_decode = kept
    assert fused.keys() == layered.keys()
    for rid in fused:
        assert torch.equal(fused[rid], layered[rid]), rid
    assert torch.equal(after_fused, runner.kv_cache.kv)
