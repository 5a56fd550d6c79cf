"""Batched sampling: one float32 logits row per request that samples this step.

Order of operations per row (as vLLM does it): allowed_token_ids -> logit_bias and min_tokens ->
repetition, presence and frequency penalties -> greedy argmax (a temperature below SAMPLING_EPS), or
temperature -> top-k -> top-p -> min-p -> random draw. A filter always keeps the most likely token, so
a row always has a token to draw (top_p = 1e-300 is 0.0 in float32: it keeps that one token).
Logprobs are reported from the model's raw distribution (log_softmax of the unprocessed logits), so
they say what the model believed, not what the filters left.

Penalty semantics (OpenAI / vLLM): the repetition penalty covers prompt and output tokens (a
positive logit is divided by it, a negative one multiplied); presence and frequency penalties cover
output tokens only (logit -= presence * [count > 0] + frequency * count).

Random draws invert the CDF: one uniform number per row, located in the row's cumulative sum (on a
CPU with cadence's kernels by the sampling kernel: one pass for the maximum and two over the
weights, and for a top-k, top-p or min-p row a sort of only the tokens near the top; elsewhere by
the filters below, softmax, cumsum and a search). A
seeded request takes its number from a generator seeded by (seed, num_output_tokens), so its
samples depend on nothing else in the batch and no state is carried between steps.

Cost matters (the sampler runs every step over [S, vocab] floats): no full-vocabulary sort unless a
row needs it; the torch path's top-k and top-p look at the `topk` candidates only, falling back to
a sort for a row whose nucleus is wider than the candidates (at temperature 1 and top-p 0.95 on
the default model, 29% of rows: 8 ms a step at 8 rows, which the kernel does in 0.6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cadence.boundary import ScheduledRequest, TokenLogprobs
from cadence.model.cpu_kernels import cpu_kernels
from cadence.request import MAX_LOGPROBS, SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) pairs over the seed space


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: dict[int, TokenLogprobs]  # row index -> logprobs, only for rows that asked


def _is_plain_greedy(r: ScheduledRequest) -> bool:
    p = r.sampling_params
    return p.greedy and p.logprobs is None and not _needs_processing(r)


def _needs_processing(r: ScheduledRequest) -> bool:
    """Whether `Sampler._processed` changes this row's logits (allowed tokens, bias, blocked stop
    tokens, penalties)."""
    p = r.sampling_params
    return bool(p.logit_bias) or p.needs_history or _blocks_stop_tokens(r) or p.allowed_token_ids is not None


def _blocks_stop_tokens(r: ScheduledRequest) -> bool:
    return r.num_output_tokens < r.sampling_params.min_tokens and bool(
        r.eos_token_ids or r.sampling_params.stop_token_ids
    )


class Sampler:
    """Picks one token per logits row. `generator` feeds the unseeded requests (engine-level seed)."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest],
                 grammar: tuple[Sequence[int], torch.Tensor] | None = None) -> SamplerOutput:
        """logits: [S, V] float32, row i belongs to reqs[i]. `grammar`: (rows, bitmask), bitmask row
        j saying which tokens row rows[j] may sample (see `GrammarMask`); the other rows are untouched."""
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(reqs)} requests")
        if logits.dtype != torch.float32:
            raise ValueError("logits must be float32")
        if grammar is None and all(_is_plain_greedy(r) for r in reqs):
            # Fast path: the common serving case, one argmax and one host transfer for the batch.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), {})
        raw = logits
        if grammar is not None:
            # Masked first, so every later step (penalties, min_tokens, filters, the draw) sees only
            # what the grammar allows. In place unless a row's logprobs need the raw logits.
            if any(r.sampling_params.logprobs is not None for r in reqs):
                logits = logits.clone()
            apply_token_bitmask(logits, grammar[0], grammar[1])
        if any(_needs_processing(r) for r in reqs):
            logits = self._processed(logits.clone(), reqs)  # a copy: `raw` feeds the logprobs
        token_ids = self._pick(logits, reqs)  # (reads `logits`; its torch path divides a copy)
        return SamplerOutput(token_ids.tolist(), self._logprobs(raw, token_ids, reqs))

    def verify(self, logits: torch.Tensor, rows: Sequence[tuple[ScheduledRequest, int]]) -> dict[str, tuple[int, ...]]:
        """Verify speculative drafts: for each (request, first of its 1 + k logits rows), the drafts
        accepted and the token after them.

        At every position of a row the token is picked exactly as a decode step at that output
        index would pick it (the argmax, or a draw with that index's seeded or engine uniform,
        through the same filters and kernel); the drafts equal to the token picked before them are
        accepted, up to the first that is not, followed by the token picked after the last one
        accepted. Every kept token is thus the one plain decoding would have produced from the same
        logits: greedy output is unchanged, a seeded request's too, and an unseeded request's
        tokens have the target distribution. For drafts proposed without a distribution (n-gram),
        this accepts a draft d with probability p(d), as the standard rejection-sampling rule with
        a one-hot proposal does."""
        if not rows:
            return {}
        index: list[int] = []
        positions: list[ScheduledRequest] = []
        for r, first in rows:
            for j in range(r.num_draft_tokens + 1):
                index.append(first + j)
                positions.append(replace(r, num_output_tokens=r.num_output_tokens + j, num_draft_tokens=0))
        picked = self(logits.index_select(0, torch.tensor(index, dtype=torch.long, device=logits.device)),
                      positions).token_ids
        out: dict[str, tuple[int, ...]] = {}
        at = 0
        for r, _ in rows:
            k = r.num_draft_tokens
            out[r.request_id] = accept_greedy(r.draft_token_ids, picked[at : at + k + 1])
            at += k + 1
        return out

    # -- logits processing --------------------------------------------------------------------

    def _processed(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, r in enumerate(reqs):
            p = r.sampling_params
            row = logits[i]
            if p.allowed_token_ids is not None:
                _keep_only(row, p.allowed_token_ids)
            if p.logit_bias:
                toks, bias = _bias_tensors(p, vocab, logits.device)
                row.index_add_(0, toks, bias)
            if _blocks_stop_tokens(r):
                _block_stop_tokens(row, [t for t in (*r.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab])
            if p.needs_history:
                apply_penalties(row, r)
        return logits

    def _pick(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> torch.Tensor:
        flags = [r.sampling_params.greedy for r in reqs]
        if all(flags):
            return logits.argmax(dim=-1)
        temps = torch.tensor(
            [r.sampling_params.temperature or 1.0 for r in reqs], dtype=torch.float32, device=logits.device
        )
        u = self._uniforms(reqs)[:, 0]
        # Each row takes one way by its own parameters (a seeded row draws the same token whatever
        # its neighbours ask for): on a CPU with cadence's kernels every random row is drawn by
        # the sampling kernel (one pass for the maximum, two over the weights; top-k, top-p and
        # min-p rows sort only the tokens near the top: tens of microseconds a row where torch's
        # topk, logsumexp, scatter and cumsum over [S, V] took milliseconds), elsewhere by torch.
        kernels = cpu_kernels() if logits.device.type == "cpu" else None
        random_rows = [i for i, g in enumerate(flags) if not g]
        out = torch.zeros(len(reqs), dtype=torch.int64, device=logits.device)
        if len(random_rows) < len(reqs):
            rows = torch.tensor([i for i, g in enumerate(flags) if g], device=logits.device)
            out[rows] = logits[rows].argmax(dim=-1)
        sub = [reqs[i] for i in random_rows]
        if kernels is not None:
            if len(random_rows) == len(reqs):  # the common case: no index copies
                return kernels.sample(logits.contiguous(), temps, u.contiguous(), *_filter_tensors(sub))
            rows = torch.tensor(random_rows)
            out[rows] = kernels.sample(logits[rows].contiguous(), temps[rows].contiguous(), u[rows].contiguous(),
                                       *_filter_tensors(sub))
        else:
            rows = torch.tensor(random_rows, device=logits.device)
            out[rows] = self._inverse_cdf(logits[rows], temps[rows], u[rows], sub)
        return out

    @staticmethod
    def _inverse_cdf(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor,
                     reqs: Sequence[ScheduledRequest]) -> torch.Tensor:
        """The draw with torch ops: temperature, the filters, softmax, cumulative sum, search. [S]"""
        probs = torch.softmax(filter_logits(logits.div_(temps[:, None]), reqs), dim=-1)
        cdf = probs.cumsum_(dim=-1)  # [S, V], in place: probs are not needed any more
        target = u[:, None] * cdf[:, -1:]  # scaled by the total, which rounding leaves near 1
        # right=True: the first index whose cdf exceeds u. A filtered token (p = 0) never exceeds
        # the cdf of the token before it, so it can never be drawn, even for u = 0.
        return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)

    def _uniforms(self, reqs: Sequence[ScheduledRequest]) -> torch.Tensor:
        """[S, 1] uniforms in [0, 1): seeded rows from their own (seed, step) generator."""
        u = torch.rand(len(reqs), 1, device=self.device, generator=self.generator)
        for i, r in enumerate(reqs):
            seed = r.sampling_params.seed
            if seed is not None:
                g = torch.Generator(device=self.device)
                g.manual_seed(step_seed(seed, r.num_output_tokens))
                u[i] = torch.rand(1, device=self.device, generator=g)
        return u

    def _logprobs(
        self, raw: torch.Tensor, token_ids: torch.Tensor, reqs: Sequence[ScheduledRequest]
    ) -> dict[int, TokenLogprobs]:
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if not rows:
            return {}
        lp = torch.log_softmax(raw[rows], dim=-1)  # [R, V]
        n_top = max(min(reqs[i].sampling_params.logprobs or 0, MAX_LOGPROBS) for i in rows)
        top_v, top_i = lp.topk(n_top, dim=-1) if n_top else (lp[:, :0], lp[:, :0].long())
        chosen = lp.gather(1, token_ids[rows][:, None])[:, 0]
        top_vals, top_ids, chosen_l = top_v.tolist(), top_i.tolist(), chosen.tolist()
        toks = token_ids[rows].tolist()
        out: dict[int, TokenLogprobs] = {}
        for j, i in enumerate(rows):
            n = min(reqs[i].sampling_params.logprobs or 0, MAX_LOGPROBS)
            top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
            out[i] = TokenLogprobs(token_id=toks[j], logprob=chosen_l[j], top=top)
        return out


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> tuple[int, ...]:
    """`targets[i]` is the token picked after draft i (targets[0]: after the fed token): the
    longest run of drafts each equal to the target before it, then the target after that run."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return tuple(targets[: accepted + 1])


def _filter_tensors(reqs: Sequence[ScheduledRequest]) -> tuple[torch.Tensor | None, ...]:
    """The sampling kernel's per-row top_k, top_p and min_p, each None when no row sets it."""
    params = [r.sampling_params for r in reqs]
    top_k = torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64) if any(p.top_k > 0 for p in params) else None
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32) if any(p.top_p < 1.0 for p in params) else None
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32) if any(p.min_p > 0 for p in params) else None
    return top_k, top_p, min_p


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Tokens a bitmask row does not allow get -inf in logits[rows[j]], in place. [S, V], [R, W] int32
    (bit j of word w allows token 32w + j; tokens past the bitmask's width are never allowed).

    With the grammar library's own vectorised masking (0.2 ms for 32 rows of a 49k vocabulary here,
    against 3.6 ms for unpacking the bits into a bias); rows not in `rows` are not touched."""
    from llguidance.torch import apply_token_bitmask_inplace

    mask = bitmask.to(logits.device)
    if list(rows) == list(range(logits.shape[0])):
        apply_token_bitmask_inplace(logits, mask)
        return
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, idx)
    apply_token_bitmask_inplace(picked, mask)
    logits.index_copy_(0, idx, picked)


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for (request seed, output index): stateless, so a request replays identically."""
    return ((seed * _MIX) ^ (step + 1) * 0xBF58476D1CE4E5B9) % (2**63)


def _keep_only(row: torch.Tensor, allowed: tuple[int, ...]) -> None:
    """Every token but `allowed` (those inside the vocabulary; the LLM and the server refuse the
    others) gets -inf, in place on [V]."""
    vocab = row.shape[0]
    ids = torch.tensor([t for t in allowed if t < vocab], dtype=torch.long, device=row.device)
    if not ids.numel():
        return
    keep = row[ids]
    row.fill_(float("-inf"))
    row[ids] = keep


def _block_stop_tokens(row: torch.Tensor, blocked: list[int]) -> None:
    """min_tokens: the stop tokens get -inf, unless they are all that is left to sample (every other
    token filtered by allowed_token_ids): a stop token then beats a token that was not allowed."""
    kept = row[blocked].clone()
    row[blocked] = float("-inf")
    if not bool((row > float("-inf")).any()):
        row[blocked] = kept


def _bias_tensors(p: SamplingParams, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [(t, b) for t, b in p.logit_bias if t < vocab]
    toks = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
    bias = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)
    return toks, bias


def apply_penalties(row: torch.Tensor, r: ScheduledRequest) -> None:
    """Repetition (prompt + outputs), presence and frequency (outputs) penalties, in place on [V]."""
    p = r.sampling_params
    if r.history is None:
        raise ValueError(f"request {r.request_id}: penalties need ScheduledRequest.history")
    vocab = row.shape[0]
    hist = torch.tensor([t for t in r.history if 0 <= t < vocab], dtype=torch.long, device=row.device)
    if p.repetition_penalty != 1.0 and hist.numel():
        seen = torch.unique(hist)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        n_out = min(r.num_output_tokens, len(r.history))
        outputs = r.history[len(r.history) - n_out :] if n_out else ()
        out_t = torch.tensor([t for t in outputs if 0 <= t < vocab], dtype=torch.long, device=row.device)
        counts = torch.bincount(out_t, minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


_CANDIDATES = 256  # tokens examined for top-p before falling back to a full sort of the row


def filter_logits(logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> torch.Tensor:
    """top-k, then top-p (over the top-k renormalised), then min-p; removed tokens get -inf. [S, V]"""
    vocab = logits.shape[1]
    params = [r.sampling_params for r in reqs]
    dev = logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks) or any(p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, ks, [p.top_p for p in params])
    if any(p.min_p > 0 for p in params):
        mins = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < mins[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, ks: list[int], top_ps: list[float], width: int = 0) -> torch.Tensor:
    vocab = logits.shape[1]
    dev = logits.device
    # Candidates: enough for every top-k, and _CANDIDATES for top-p rows. A row whose nucleus does
    # not fit in them (a very flat distribution) is redone with all tokens as candidates.
    if not width:
        width = min(vocab, max([k for k in ks if k < vocab] + [_CANDIDATES if min(top_ps) < 1.0 else 0]))
    vals, idx = logits.topk(width, dim=-1)  # [S, W], descending
    k_t = torch.tensor(ks, device=dev)
    p_t = torch.tensor(top_ps, dtype=torch.float32, device=dev)
    rank = torch.arange(width, device=dev)[None, :]
    # Normaliser: over the top-k when the row has one (vLLM renormalises after top-k), else over
    # the whole vocabulary, so the candidates' probabilities are exact either way.
    lse_all = torch.logsumexp(logits, dim=-1, keepdim=True)
    lse_k = torch.logsumexp(vals.masked_fill(rank >= k_t[:, None], float("-inf")), dim=-1, keepdim=True)
    lse = torch.where(k_t[:, None] < vocab, lse_k, lse_all)
    probs = (vals - lse).exp().masked_fill(rank >= k_t[:, None], 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    # The top token always stays, even for a top_p that rounds to 0 in float32.
    drop = (rank >= k_t[:, None]) | ((mass_before >= p_t[:, None]) & (rank > 0))
    out = torch.full_like(logits, float("-inf")).scatter_(1, idx, vals.masked_fill(drop, float("-inf")))
    # A top-p row (without a top-k inside the candidates) whose candidates hold less than top_p.
    short_mask = (mass_before[:, -1] + probs[:, -1] < p_t) & (k_t > width) & (p_t < 1.0)
    short = torch.nonzero(short_mask).flatten().tolist()
    if short and width < vocab:
        out[short] = _top_k_top_p(logits[short], [vocab] * len(short), [top_ps[i] for i in short], width=vocab)
    return out
