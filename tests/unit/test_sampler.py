"""The batched sampler: filters, penalties, seeds, min_tokens, logprobs, logit_bias."""

from __future__ import annotations

import math

import pytest
import torch

from cadence.boundary import ScheduledRequest
from cadence.model.sampler import Sampler, apply_penalties, filter_logits
from cadence.request import SamplingParams

V = 50


def req(params: SamplingParams, rid: str = "r", *, n_out: int = 0, history: tuple[int, ...] | None = None,
        eos: frozenset[int] = frozenset()) -> ScheduledRequest:
    return ScheduledRequest(rid, (1,), 0, (0,), True, params, num_output_tokens=n_out, history=history,
                            eos_token_ids=eos)


def rand_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_exact_argmax_on_both_paths():
    logits = rand_logits(8)
    s = Sampler()
    plain = s(logits, [req(SamplingParams(temperature=0.0))] * 8)
    assert plain.token_ids == logits.argmax(-1).tolist()
    # Mixed batch (slow path): greedy rows still take the argmax, with logprobs asked on one.
    mixed = [req(SamplingParams(temperature=0.0, logprobs=2))] + [req(SamplingParams(temperature=1.0, seed=i))
                                                                 for i in range(7)]
    out = s(logits, mixed)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert not plain.logprobs and set(out.logprobs) == {0}


def allowed_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row, -1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += probs[t].item()
        if mass >= p:
            break
    return set(kept)


@pytest.mark.parametrize(
    "params,allowed",
    [
        (SamplingParams(temperature=1.5, top_k=5), lambda row: set(row.topk(5).indices.tolist())),
        (SamplingParams(temperature=1.0, top_p=0.6), lambda row: allowed_top_p(row, 0.6)),
        (SamplingParams(temperature=1.0, min_p=0.2),
         lambda row: set(torch.nonzero(torch.softmax(row, -1) >= 0.2 * torch.softmax(row, -1).max()).flatten().tolist())),
        (SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05), None),
    ],
)
def test_filters_never_pick_filtered_tokens(params, allowed):
    row = rand_logits(1, seed=3)[0] / 3  # milder logits: many tokens are plausible before filtering
    logits = row.expand(2000, V).contiguous()
    out = Sampler(seed=1)(logits, [req(params)] * 2000).token_ids
    scaled = row / params.temperature
    if allowed is None:
        ok = set(scaled.topk(10).indices.tolist()) & allowed_top_p(scaled, 0.9)
    else:
        ok = allowed(scaled)
    assert set(out) <= ok
    assert len(set(out)) > 1  # the filter did not collapse to greedy


def test_temperature_sampling_follows_the_distribution():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 8000
    out = Sampler(seed=2)(row.expand(n, 4).contiguous(), [req(SamplingParams(temperature=2.0))] * n).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / n
    expected = torch.softmax(row / 2.0, -1)
    assert (freq - expected).abs().max() < 0.025  # ~5 standard errors at n = 8000


def test_penalties_match_hand_computation():
    row = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, 1.0])
    prompt, outputs = (0, 1, 5), (2, 2, 3, 1)
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5)
    r = req(p, n_out=len(outputs), history=prompt + outputs)
    got = row.clone()
    apply_penalties(got, r)
    expected = []
    for tok, x in enumerate(row.tolist()):
        if tok in prompt + outputs:  # repetition: prompt and outputs
            x = x / 1.5 if x > 0 else x * 1.5
        count = outputs.count(tok)  # presence and frequency: outputs only
        x -= 0.5 * count + (0.25 if count else 0.0)
        expected.append(x)
    torch.testing.assert_close(got, torch.tensor(expected))
    assert got[5] == pytest.approx(1.0 / 1.5) and got[4] == 3.0  # prompt-only token: repetition only


def test_penalties_change_the_greedy_choice_and_need_history():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert Sampler()(logits, [req(p, n_out=1, history=(3, 0))]).token_ids == [1]
    assert Sampler()(logits, [req(SamplingParams(temperature=0.0))]).token_ids == [0]
    with pytest.raises(ValueError, match="history"):
        Sampler()(logits, [req(p, n_out=1, history=None)])


def test_seeded_request_is_reproducible_alone_and_in_any_batch():
    logits = rand_logits(1, seed=4)[0] / 3
    p = SamplingParams(temperature=1.0, seed=1234)

    def draw(step: int, batch_seed: int, position: int, size: int) -> int:
        others = [req(SamplingParams(temperature=1.0, seed=None if i % 2 else 99 + i), f"o{i}") for i in range(size)]
        reqs = others[:position] + [req(p, n_out=step)] + others[position:]
        out = Sampler(seed=batch_seed)(logits.expand(len(reqs), V).contiguous(), reqs)
        return out.token_ids[position]

    alone = [draw(step, 0, 0, 0) for step in range(30)]
    crowded = [draw(step, 7 + step, step % 5, 6) for step in range(30)]
    assert alone == crowded
    assert len(set(alone)) > 3  # the step index really changes the draw
    other_seed = [Sampler()(logits[None], [req(SamplingParams(temperature=1.0, seed=4321), n_out=s)]).token_ids[0]
                  for s in range(30)]
    assert other_seed != alone


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8], logits[0, 9] = 10.0, 9.0, 8.0  # eos 7, stop token 8 dominate
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(8,))
    s = Sampler()
    assert s(logits, [req(p, n_out=2, eos=frozenset({7}))]).token_ids == [9]
    assert s(logits, [req(p, n_out=3, eos=frozenset({7}))]).token_ids == [7]
    sampled = s(logits.expand(500, V).contiguous(),
                [req(SamplingParams(temperature=5.0, min_tokens=2), n_out=0, eos=frozenset({7}))] * 500)
    assert 7 not in sampled.token_ids


def test_logprobs_shape_values_and_cap():
    logits = rand_logits(3, seed=5)
    reqs = [req(SamplingParams(temperature=0.0, logprobs=5)), req(SamplingParams(temperature=0.0)),
            req(SamplingParams(temperature=1.0, seed=3, logprobs=20))]
    out = Sampler()(logits, reqs)
    assert set(out.logprobs) == {0, 2}
    ref = torch.log_softmax(logits, -1)
    lp0, lp2 = out.logprobs[0], out.logprobs[2]
    assert len(lp0.top) == 5 and len(lp2.top) == 20
    assert lp0.token_id == out.token_ids[0] and lp0.logprob == pytest.approx(ref[0].max().item(), abs=1e-6)
    assert lp2.logprob == pytest.approx(ref[2, out.token_ids[2]].item(), abs=1e-6)
    vals = [v for _, v in lp2.top]
    assert vals == sorted(vals, reverse=True) and all(v <= 0 for v in vals)
    assert sum(math.exp(v) for v in vals) <= 1.0 + 1e-5
    assert [t for t, _ in lp0.top] == ref[0].topk(5).indices.tolist()
    zero = Sampler()(logits[:1], [req(SamplingParams(temperature=0.0, logprobs=0))]).logprobs[0]
    assert zero.top == () and zero.logprob <= 0
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


def test_logit_bias_moves_the_choice():
    logits = rand_logits(1, seed=6)
    top2 = logits[0].topk(2).indices.tolist()
    low = int(logits[0].argmin())
    s = Sampler()
    assert s(logits, [req(SamplingParams(temperature=0.0, logit_bias={low: 100.0}))]).token_ids == [low]
    assert s(logits, [req(SamplingParams(temperature=0.0, logit_bias={top2[0]: -100.0}))]).token_ids == [top2[1]]
    # Out-of-vocabulary bias entries are ignored rather than crashing the batch.
    assert s(logits, [req(SamplingParams(temperature=0.0, logit_bias={V + 5: 5.0}))]).token_ids == [top2[0]]


def test_bad_logits_are_rejected():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, V), [req(SamplingParams())])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, V, dtype=torch.bfloat16), [req(SamplingParams())])


def reference_keep(row: torch.Tensor, k: int, p: float) -> set[int]:
    """top-k then top-p (renormalised over the top-k) by a full sort, written out plainly."""
    order = row.argsort(descending=True).tolist()[: k if k > 0 else None]
    probs = torch.softmax(row[order].double(), -1).tolist()
    kept, mass = set(), 0.0
    for tok, pr in zip(order, probs, strict=True):
        if mass >= p:
            break
        kept.add(tok)
        mass += pr
    return kept


def test_top_k_top_p_candidates_and_fallback_match_a_full_sort():
    """Vocabulary wider than the sampler's top-p candidates: peaked rows use them, flat rows fall back."""
    vocab = 2000
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, vocab, generator=g)
    logits[0] *= 8.0  # peaked: the nucleus fits in the candidates
    logits[1] *= 0.5  # flat: a 0.9 nucleus needs far more than 256 tokens
    cases = [(0, 0.9), (0, 0.95), (300, 0.9), (5, 1.0), (1000, 0.97)]
    reqs = [req(SamplingParams(temperature=1.0, top_k=k, top_p=p)) for k, p in cases]
    out = filter_logits(logits.clone(), reqs)
    for i, (k, p) in enumerate(cases):
        kept = set(torch.nonzero(torch.isfinite(out[i])).flatten().tolist())
        assert kept == reference_keep(logits[i], k, p), f"row {i}"
        assert torch.equal(out[i][sorted(kept)], logits[i][sorted(kept)])  # kept logits untouched
    assert len(reference_keep(logits[1], 0, 0.9)) > 256  # the fallback really was exercised


kernels_or_skip = pytest.mark.skipif(
    __import__("cadence.model.cpu_kernels", fromlist=["cpu_kernels"]).cpu_kernels() is None,
    reason="CPU without AVX512-BF16 or no C compiler: the torch path samples every row")


@kernels_or_skip
def test_sampling_kernel_inverts_the_same_cdf_as_torch():
    """The kernel's draw at a given uniform is the torch path's (softmax, cumsum, search) but where
    the two roundings put the uniform on different sides of a boundary; -inf tokens never come out,
    at u = 0 and at u just below 1 included; a ragged vocabulary (not a multiple of 16) is read to its end."""
    from cadence.model.cpu_kernels import cpu_kernels

    k = cpu_kernels()
    g = torch.Generator().manual_seed(5)
    for vocab in (49152, 1000, 37):
        logits = torch.randn(64, vocab, generator=g) * 4
        logits[:, ::3] = float("-inf")  # a third filtered out
        temps = torch.rand(64, generator=g) * 1.5 + 0.2
        agree = 0
        for trial in range(8):
            u = torch.rand(64, generator=g)
            if trial == 0:
                u[:4] = torch.tensor([0.0, 1e-9, 1.0 - 2**-24, 0.5])
            got = k.sample(logits, temps, u)
            want = Sampler._inverse_cdf(logits.clone(), temps.clone(), u, [req(SamplingParams(temperature=1.0))] * 64)
            assert bool((got % 3 != 0).all()), "a filtered token was drawn"
            assert bool(((got >= 0) & (got < vocab)).all())
            agree += int((got == want).sum())
        assert agree >= 0.99 * 8 * 64, agree


@kernels_or_skip
def test_rows_sample_the_same_beside_filtered_rows():
    """Plain, top-p and greedy rows side by side: none depends on the others."""
    logits = rand_logits(3, seed=9)
    seeded = [req(SamplingParams(temperature=0.8, seed=7), "a", n_out=n) for n in range(20)]
    alone = [Sampler()(logits[:1], [r]).token_ids[0] for r in seeded]
    beside = [Sampler()(logits, [r, req(SamplingParams(temperature=0.7, top_p=0.5, seed=3), "b"),
                                 req(SamplingParams(temperature=0.0), "c")]).token_ids[0] for r in seeded]
    assert alone == beside and len(set(alone)) > 3
    mixed = Sampler()(logits, [seeded[0], req(SamplingParams(temperature=0.7, top_p=0.5, seed=3), "b"),
                               req(SamplingParams(temperature=0.0), "c")]).token_ids
    assert mixed[2] == int(logits[2].argmax())
    top_p_alone = Sampler()(logits[1:2], [req(SamplingParams(temperature=0.7, top_p=0.5, seed=3), "b")]).token_ids[0]
    assert mixed[1] == top_p_alone


@kernels_or_skip
def test_filtered_kernel_keeps_what_filter_logits_keeps_and_draws_as_torch():
    """top-k, top-p and min-p rows on the kernel: across the uniforms, the tokens drawn are exactly the
    ones `filter_logits` keeps (peaked rows, flat rows whose nucleus spans thousands of tokens, rows
    with -inf tokens, top-k with top-p, ragged vocabularies), and each draw is the torch path's at the
    same uniform but where the two roundings put it on different sides of a boundary."""
    from cadence.model.cpu_kernels import cpu_kernels

    k = cpu_kernels()
    g = torch.Generator().manual_seed(11)
    cases = [  # (temperature, top_k, top_p, min_p, logit scale)
        (1.0, 0, 0.9, 0.0, 4.0), (0.7, 0, 0.95, 0.0, 1.0), (1.0, 0, 0.97, 0.0, 0.3), (1.0, 40, 1.0, 0.0, 2.0),
        (0.8, 50, 0.9, 0.0, 0.5), (1.2, 0, 1.0, 0.05, 2.0), (0.9, 20, 0.8, 0.1, 1.0), (1.0, 3, 0.5, 0.0, 3.0),
        (1.0, 0, 0.995, 0.0, 0.3),  # row 3 spiked: its nucleus reaches into a tail of weights below 2^-12
    ]
    for vocab in (3000, 1001):
        for temp, top_k, top_p, min_p, scale in cases:
            logits = torch.randn(4, vocab, generator=g) * scale
            logits[1, ::7] = float("-inf")
            logits[2, :] = logits[2, :].round()  # many exact ties
            if 0.99 < top_p < 1:
                logits[3, 7] = 10.0  # one token e^10 above a flat tail whose mass the nucleus needs
            params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
            reqs = [req(params)] * 4
            kept = torch.isfinite(filter_logits(logits / temp, reqs))
            temps = torch.full((4,), temp)
            filters = (torch.full((4,), top_k, dtype=torch.int64) if top_k else None,
                       torch.full((4,), top_p) if top_p < 1 else None, torch.full((4,), min_p) if min_p else None)
            n_u = 600  # every row at each of n_u evenly spaced uniforms, all in one call per path
            big = logits.repeat(n_u, 1)
            uu = torch.linspace(0, 1 - 2**-24, n_u).repeat_interleave(4)
            got = k.sample(big, temps.repeat(n_u), uu, *(None if f is None else f.repeat(n_u) for f in filters))
            want = Sampler._inverse_cdf(big.clone(), temps.repeat(n_u), uu, reqs * n_u)
            got, want = got.view(n_u, 4), want.view(n_u, 4)
            drawn = [set(got[:, r].tolist()) for r in range(4)]
            agree = int((got == want)[:, [0, 1, 3]].sum())  # row 2's ties may cut elsewhere
            total = 3 * n_u
            for r in range(4):
                allowed = set(torch.nonzero(kept[r]).flatten().tolist())
                if r == 2:  # exact ties: the tokens tied with the last kept one may be kept instead
                    edge = logits[r][kept[r]].min()
                    assert len(drawn[r]) <= len(allowed)
                    allowed |= set(torch.nonzero(logits[r] == edge).flatten().tolist())
                assert drawn[r] <= allowed, f"case {(temp, top_k, top_p, min_p)} row {r}: a filtered token drawn"
                if r != 2:  # ties at the cut may be broken differently by torch's topk
                    heavy = {t for t in allowed if float(torch.softmax(logits[r] / temp, -1)[t]) > 2e-3}
                    assert heavy <= drawn[r], f"case {(temp, top_k, top_p, min_p)} row {r}: a kept token never drawn"
            assert agree >= 0.97 * total, (temp, top_k, top_p, min_p, agree, total)
            if 0.99 < top_p < 1:
                assert len(drawn[3]) > 3  # the spiked row drew from its tail


@kernels_or_skip
def test_sampler_routes_filtered_rows_to_the_kernel_and_stays_batch_invariant():
    """A seeded top-p row draws the same tokens alone and beside greedy, plain and top-k rows."""
    logits = rand_logits(4, seed=12, vocab=3000) / 2
    seeded = [req(SamplingParams(temperature=0.9, top_p=0.8, seed=5), "a", n_out=n) for n in range(30)]
    alone = [Sampler()(logits[:1], [r]).token_ids[0] for r in seeded]
    beside = [Sampler()(logits, [r, req(SamplingParams(temperature=0.0), "g"),
                                 req(SamplingParams(temperature=1.0, seed=1), "p"),
                                 req(SamplingParams(temperature=0.7, top_k=5, seed=2), "k")]).token_ids[0]
              for r in seeded]
    assert alone == beside and len(set(alone)) > 3


@pytest.fixture(params=["kernel", "torch"])
def sampling_path(request, monkeypatch):
    """Each random row drawn by the CPU sampling kernel, then by the torch ops (as on a GPU)."""
    import cadence.model.sampler as sampler_module

    if request.param == "kernel":
        if sampler_module.cpu_kernels() is None:
            pytest.skip("the CPU kernels are not built on this machine")
    else:
        monkeypatch.setattr(sampler_module, "cpu_kernels", lambda: None)
    return request.param


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_a_temperature_below_the_epsilon_is_greedy(sampling_path, temperature):
    # 1e-300 is 0.0 in float32: dividing the logits by it gave token 0 (kernel) or the last token (torch).
    logits = rand_logits(4, seed=5)
    reqs = [req(SamplingParams(temperature=temperature)), req(SamplingParams(temperature=1.0, seed=1))] * 2
    out = Sampler()(logits, reqs).token_ids
    assert [out[0], out[2]] == logits[[0, 2]].argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(sampling_path, top_p):
    # The torch path dropped every token (all -inf) and drew the vocabulary's last.
    logits = rand_logits(3, seed=6)
    out = Sampler()(logits, [req(SamplingParams(temperature=1.0, top_p=top_p, seed=i)) for i in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_allowed_token_ids_are_the_only_tokens_drawn(sampling_path):
    logits = rand_logits(1, seed=7)[0].expand(400, V).contiguous()
    allowed = (3, 11, 42)
    params = [SamplingParams(temperature=2.0, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, top_k=2, allowed_token_ids=allowed, logit_bias={3: -100.0})]
    out = Sampler(seed=3)(logits, [req(params[i % 3]) for i in range(400)]).token_ids
    assert set(out) <= set(allowed) and len(set(out[0::3])) > 1
    assert set(out[1::3]) == {max(allowed, key=lambda t: logits[0, t].item())}  # greedy among the allowed
    assert 3 not in out[2::3]


def test_min_tokens_yields_when_only_stop_tokens_are_allowed(sampling_path):
    logits = rand_logits(2, seed=8)
    p = SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=(5,), allowed_token_ids=(5, 7))
    s = Sampler(seed=1)
    # Of the allowed tokens, min_tokens blocks the stop token 5: 7 is drawn...
    assert s(logits[:1], [req(p, eos=frozenset({9}))]).token_ids == [7]
    # ...but when 7 is the end-of-text token, every allowed token is a stop token: one of them is
    # drawn (the request ends early) rather than a token that was not allowed.
    assert s(logits[:1], [req(p, eos=frozenset({7}))]).token_ids[0] in (5, 7)
