"""A verification row's logits are a decode step's, bit for bit, on the bfloat16 CPU kernels: at each
of its 1 + k positions, beside other requests in the step, and after rejected drafts left their K/V
in slots that the next row writes over.

The reference is one prefill of the whole sequence (every position's logits); the run under test
prefills a prefix, then feeds the rest as verification rows whose drafts are partly wrong (the
wrong ones stand for rejected drafts: the next row starts again at the first of them, as the
scheduler does after a rejection)."""

from __future__ import annotations

import random

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
