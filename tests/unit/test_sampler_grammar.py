"""The sampler under a grammar bitmask: constrained rows draw only allowed tokens in every sampling
mode; unconstrained rows in the same batch are untouched; logprobs stay those of the raw logits."""

from __future__ import annotations

import torch

from cadence.boundary import ScheduledRequest
from cadence.model.sampler import Sampler, apply_token_bitmask
from cadence.request import SamplingParams

V = 1000  # not a multiple of 32: the last bitmask word is partly past the vocabulary


def req(params: SamplingParams, rid: str = "r", n_out: int = 0) -> ScheduledRequest:
    return ScheduledRequest(rid, (1,), 0, (0,), True, params, num_output_tokens=n_out)


def bitmask(allowed: list[set[int]]) -> torch.Tensor:
    words = torch.zeros(len(allowed), (V + 31) // 32, dtype=torch.int64)
    for i, toks in enumerate(allowed):
        for t in toks:
            words[i, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 set: a negative int32


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_apply_sets_minus_inf_exactly_on_disallowed_tokens_of_the_listed_rows():
    x = logits(3)
    before = x.clone()
    allowed = [{0, 31, 32, 999}, {5, 500}]
    apply_token_bitmask(x, [2, 0], bitmask(allowed))
    assert torch.equal(x[1], before[1])
    for row, toks in ((2, allowed[0]), (0, allowed[1])):
        finite = set(torch.nonzero(torch.isfinite(x[row])).flatten().tolist())
        assert finite == toks
        assert torch.equal(x[row, sorted(toks)], before[row, sorted(toks)])


def test_every_sampling_mode_draws_only_allowed_tokens():
    modes = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.5, seed=3),
             SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.5),
             SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.7, logprobs=3),
             SamplingParams(temperature=1.0, repetition_penalty=1.3)]
    allowed = {7, 64, 65, 400, 998}
    s = Sampler(seed=1)
    for step in range(30):
        x = logits(len(modes), seed=step)
        x[:, 123] = 50.0  # a token the model loves and the grammar forbids
        reqs = [ScheduledRequest(f"r{i}", (1,), 0, (0,), True, p, step, history=(1, 2, 123))
                for i, p in enumerate(modes)]
        out = s(x, reqs, (list(range(len(modes))), bitmask([allowed] * len(modes))))
        assert set(out.token_ids) <= allowed, (step, out.token_ids)


def test_unconstrained_rows_draw_as_without_a_mask_and_logprobs_are_raw():
    x = logits(4, seed=9)
    reqs = [req(SamplingParams(temperature=1.0, seed=i, logprobs=2), f"r{i}", 3) for i in range(4)]
    free = Sampler()(x.clone(), reqs)
    masked = Sampler()(x.clone(), reqs, ([1, 3], bitmask([{10, 11}, {12}])))
    assert masked.token_ids[0] == free.token_ids[0] and masked.token_ids[2] == free.token_ids[2]
    assert masked.token_ids[1] in (10, 11) and masked.token_ids[3] == 12
    raw = torch.log_softmax(x, dim=-1)
    assert abs(masked.logprobs[3].logprob - float(raw[3, 12])) < 1e-4
    assert masked.logprobs[0] == free.logprobs[0]
