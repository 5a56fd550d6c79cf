"""Verifying sampled drafts keeps the target distribution: over many draws from fixed
logits, the first token's frequencies match p at position 0 whatever the draft, and the second
token's, among rows that accepted the first draft, match p at position 1; a seeded row draws the
same tokens as plain decoding, whatever its neighbours."""

from __future__ import annotations

import math

import torch

from cadence.boundary import ScheduledRequest
from cadence.model.sampler import Sampler
from cadence.request import SamplingParams

V = 6


def _row(rid: str, drafts: tuple[int, ...], params: SamplingParams, outputs: int = 3) -> ScheduledRequest:
    return ScheduledRequest(rid, (0, *drafts), 10, (0,), True, params, num_output_tokens=outputs,
                            num_draft_tokens=len(drafts))


def _close(counts: torch.Tensor, p: torch.Tensor, n: int) -> None:
    """Frequencies within 5 standard errors of p, token by token (a fixed seed: deterministic)."""
    freq = counts / n
    bound = 5 * torch.sqrt(p * (1 - p) / n) + 1e-9
    assert bool(((freq - p).abs() <= bound).all()), (freq.tolist(), p.tolist())


def test_each_position_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 2.5, 1.0, 1.0, -0.5, 0.2],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(temperature=0.8, max_tokens=16)
    p = torch.softmax(logits / 0.8, dim=-1)
    n = 20_000
    sampler = Sampler(seed=1)
    drafts = (5, 1)  # p0(5) ~ 0.26: often rejected; p1(1) ~ 0.5
    # Every row reads the same logits rows: n independent verifications of the same draft.
    out = sampler.verify(logits, [(_row(f"r{i}", drafts, params), 0) for i in range(n)])
    first = torch.zeros(V)
    second = torch.zeros(V)
    accepted_first = 0
    for toks in out.values():
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            accepted_first += 1
            second[toks[1]] += 1
    _close(first, p[0], n)
    _close(second, p[1], accepted_first)
    assert {len(t) for t in out.values()} == {1, 2, 3}
    # Acceptance of the first draft happens with probability p0(5).
    assert math.isclose(accepted_first / n, float(p[0, 5]), abs_tol=5 * math.sqrt(0.25 / n))


def test_filters_apply_before_verification() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 2.5, 1.0, 1.0, -0.5, 0.2]])
    top2 = SamplingParams(temperature=1.0, top_k=2, max_tokens=16)
    # Token 2 is outside the top 2 at position 0: a draft of it is never accepted.
    out = Sampler(seed=3).verify(logits, [(_row(f"k{i}", (2,), top2), 0) for i in range(300)])
    assert all(toks[0] in (0, 5) and len(toks) == 1 for toks in out.values())


def test_a_seeded_row_keeps_the_tokens_plain_decoding_draws() -> None:
    """Each position draws what a decode step at that output index draws (the same seeded uniform,
    filters and kernel), so a seeded request's output does not change with speculation."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, V, generator=gen) * 2
    seeded = SamplingParams(temperature=1.0, seed=42, top_p=0.9, max_tokens=16)
    plain = [Sampler(seed=9)(logits[j : j + 1], [_row("s", (), seeded, outputs=3 + j)]).token_ids[0]
             for j in range(5)]
    right = tuple(plain[:4])
    assert Sampler(seed=1).verify(logits, [(_row("s", right, seeded), 0)])["s"] == tuple(plain)
    wrong = (plain[0], (plain[1] + 1) % V, plain[2], plain[3])
    assert Sampler(seed=2).verify(logits, [(_row("s", wrong, seeded), 0)])["s"] == tuple(plain[:2])
    # Beside another request's row (an unseeded one, drawing from the engine's generator): the same.
    other = (_row("x", (1, 2), SamplingParams(temperature=1.0, max_tokens=16)), 0)
    assert Sampler(seed=3).verify(logits, [other, (_row("s", right, seeded), 0)])["s"] == tuple(plain)
