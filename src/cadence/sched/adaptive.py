"""Adaptive k for speculative decoding: how many drafts each request verifies this step.

A verification row of 1 + k tokens yields, when each draft is accepted with probability a given
the drafts before it were, (1 - a^(k+1)) / (1 - a) tokens on average instead of one; it costs
what the step-cost model says the step costs with those k tokens more. A request speculates only
where its row's extra tokens beat, by a margin, what the time the row adds would make at the rate
the step's decodes make tokens without drafts; each draft after the first is worth verifying while
it about pays for its time at that rate (`choose_ks`): at low load (a memory-bound step, where k more tokens add little time) and high acceptance
k rises to its cap; in a large batch (compute-bound: k more tokens cost as much as k more
requests' decodes) or with drafts that are rarely accepted, k is 0.

Each request's acceptance rate is measured: an exponentially weighted count of its accepted and
rejected drafts, started from an optimistic prior so that a new request tries its drafts once
(a request never tried would never be measured). While a request verifies no drafts its evidence
fades slowly back towards the prior, so a low estimate is tested again now and then.

Pure Python: the cost is any callable from a step's `StepFeatures` to seconds (or any unit);
the engine builds it from the calibrated profile, else `analytic_step_cost`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cadence.sched.features import StepFeatures, verification_shared_keys

StepCost = Callable[[StepFeatures], float]

PRIOR_RATE = 0.8  # acceptance assumed before a request has verified anything
PRIOR_WEIGHT = 2.0  # worth that many observed drafts
DECAY = 0.95  # per verification row: older rows' weight in the estimate
# Per step in which a request had drafts but verified none: its evidence fades towards the prior,
# so that a request whose estimate fell (a bad stretch, or text that starts repeating only later)
# is tried again: from the lowest estimate, after one to two hundred such steps.
IDLE_DECAY = 0.98
# A test row adds about one rejected draft to the evidence, which the prior's pull outweighs again
# within tens of idle steps: drafts that are never right (a draft model that is no use on the text)
# would be tested, and a draft model's passes paid for, every few dozen steps. So each row in a run
# of rows that accepted nothing doubles how long the evidence takes to fade (up to 2^this times),
# and a row that accepts a draft ends the run.
IDLE_BACKOFF_DOUBLINGS = 6
# A request speculates only where its row's expected extra tokens are this many times what the
# row's time would make at the step's own rate. The cost model predicts whole steps within about 5%,
# but what drafts add is a small difference of two predictions: verification steps measured against
# decode steps of the same batch added 0.9 to 1.6 times the predicted extra time.
DRAFT_COST_MARGIN = 1.5
# Once a request speculates, each further draft is judged at this multiple of its time: break-even.
# The margin guards the decision to add a verification row at all (at low acceptance or in a large
# batch the row's whole gain is thin); a row's later drafts, cheap beside the row at low load, were
# dropped by it at ~65% acceptance where they about pay. Replaying recorded outputs
# (benchmarks/spec_replay.py, docs/speculative.md) the two rules are level in model time (within
# 1%), and served steps carry costs the model does not see that a longer row saves (fixed k's
# measured gain on the grounded single stream was above the modelled one).
FURTHER_DRAFT_MARGIN = 1.0


def analytic_step_cost(f: StepFeatures) -> float:
    """A step's cost in units of one weight read, when no calibrated profile is given: every step
    reads the weights once; a token through the matmuls costs 1/32 of that (a batch of 32 tokens
    is where the arithmetic catches up with the memory traffic), a position's logits 1/128, a key
    attended 1/16384 (its K/V bytes against the weights')."""
    return (1.0 + (f.prefill_tokens + f.decode_seqs) / 32 + f.sampled / 128
            + (f.decode_context + f.prefill_attention) / 16384)


def expected_tokens(k: int, a: float) -> float:
    """Tokens a row of k drafts yields on average: the accepted drafts and the token after them."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(slots=True)
class Acceptance:
    """A request's measured acceptance: decayed counts of accepted drafts and of drafts judged
    (accepted ones, plus the one rejection that ends a row short of its k)."""

    accepted: float = 0.0
    judged: float = 0.0
    misses: int = 0  # verification rows since the last one that accepted a draft

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.judged + PRIOR_WEIGHT)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted = self.accepted * DECAY + num_accepted
        self.judged = self.judged * DECAY + num_accepted + (num_accepted < num_drafts)
        self.misses = 0 if num_accepted else self.misses + 1

    def idle(self) -> None:
        """A step where the request had drafts and verified none of them."""
        fade = IDLE_DECAY ** (0.5 ** min(max(self.misses - 1, 0), IDLE_BACKOFF_DOUBLINGS))
        self.accepted *= fade
        self.judged *= fade


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request planned as a plain decode at `start` that could verify up to `max_k` drafts."""

    request_id: str
    start: int
    max_k: int
    rate: float
    # Its row's keys in blocks an earlier decode row of the step read (`shared_keys_by_row`): they
    # leave the step's `decode_context_shared` with the row. (Where the row is the first reader of
    # blocks later rows share, those rows' keys are left as shared: one reader of them remains.)
    shared: int = 0


@dataclass(frozen=True, slots=True)
class DraftModelCost:
    """What drafting costs with a draft model: after each step it runs `num_tokens` decode passes
    over the requests it drafts for, each pass `ratio` (`cadence serve`: its weight bytes over the served model's) of
    what a served decode step of those requests costs."""

    ratio: float
    num_tokens: int

    def total(self, cost: StepCost, rows: int, context: int, longest: int) -> float:
        """The drafting time after a step for `rows` requests of `context` keys in all, the longest
        `longest`: `num_tokens` passes, each `ratio` of a served decode step of those rows. The
        scheduler weighs drafts with it (`time`) and the simulator charges it (`SimExecutor`)."""
        if rows == 0:
            return 0.0
        step = cost(StepFeatures(decode_seqs=rows, sampled=rows, decode_context=context, decode_padded=rows * longest))
        return self.ratio * self.num_tokens * step

    def time(self, cost: StepCost, rows: int, context: int, longest: int, row_context: int) -> float:
        """The drafting time one more request of context `row_context` adds to `rows` others of
        `context` keys, the longest `longest` (the first request drafted pays the passes' weight reads)."""
        return (self.total(cost, rows + 1, context + row_context, max(longest, row_context))
                - self.total(cost, rows, context, longest))


def choose_ks(base: StepFeatures, candidates: Sequence[Candidate], cost: StepCost, budget: int,
              block_size: int = 0, drafting: DraftModelCost | None = None) -> dict[str, int]:
    """k for each candidate that should speculate (the others: 0), given the planned step `base`
    (every candidate in it as a plain decode) and at most `budget` draft tokens in all.

    A second of step time is worth what the step's decodes alone make of it: their tokens over
    the cost of a step of just them (a prompt chunk in the step is work that time would do anyway;
    counting it in would make any drafts look cheap beside it). Drafts are worth their expected
    extra tokens less the time they add at that rate. Candidates are taken best acceptance first;
    each gets the k of the largest net gain at break-even (`FURTHER_DRAFT_MARGIN`), and its row
    counts for the gain of its best k with its time priced `DRAFT_COST_MARGIN` times over: a row
    that gains nothing so priced is not verified. The first row of drafts may put the step on a dearer
    path (a CPU step with a chunk runs differently) and lose on its own while later rows gain: it is
    kept tentatively, and the set kept in the end is the leading run of candidates with the largest
    total gain. Once the step has a chunk, a candidate that gains nothing ends the search (those
    after it accept less).

    In a step without a prompt chunk a row of k drafts is k more decode rows beside the
    candidate's (the runner runs the step on its all-decode path, `scan_rows`); in one with a
    chunk it is a chunk of 1 + k tokens in place of the candidate's decode. `block_size`: the
    cost prices keys re-read from shared blocks (the draft rows re-read the candidate's context);
    0: it does not. `drafting`: with a draft model, a candidate that speculates is also drafted for
    after the step, and that time counts against its gain (a candidate turned down is not drafted
    for: `Speculation.adapt`)."""
    pt, ps, ds, sm = base.prefill_tokens, base.prefill_seqs, base.decode_seqs, base.sampled
    dc, pa, sh = base.decode_context, base.prefill_attention, base.decode_context_shared
    if ds == 0:
        return {}
    dmax = base.decode_padded // ds
    per_second = ds / cost(StepFeatures(decode_seqs=ds, sampled=ds, decode_context=dc, decode_padded=base.decode_padded,
                                        decode_context_shared=sh))
    t = cost(base)
    gain, best_gain, best_len = 0.0, 0.0, 0
    chosen: list[tuple[str, int]] = []
    drafted = drafted_ctx = drafted_top = 0  # the requests drafted for so far: rows, keys, longest
    for c in sorted(candidates, key=lambda c: -c.rate):
        if budget <= 0:
            break
        draft_time = 0.0 if drafting is None else drafting.time(cost, drafted, drafted_ctx, drafted_top, c.start + 1)
        pick = None
        net = -math.inf  # the row's gain at its best k, its time priced with the margin
        for k in range(1, min(c.max_k, budget) + 1):
            f = _with_drafts(pt, ps, ds, sm, dc, dmax, pa, sh, c, k, block_size)
            ct = cost(f)
            extra, added = expected_tokens(k, c.rate) - 1, per_second * (ct - t + draft_time)
            net = max(net, extra - DRAFT_COST_MARGIN * added)
            marginal = extra - FURTHER_DRAFT_MARGIN * added
            if pick is not None and marginal <= pick[1]:
                break  # past the best k: the gain falls from here on
            pick = (k, marginal, ct, f)
        if pick is None:
            continue
        k, _, ct, f = pick
        if net <= 0 and pt > 0:
            break
        chosen.append((c.request_id, k))
        drafted, drafted_ctx, drafted_top = drafted + 1, drafted_ctx + c.start + 1, max(drafted_top, c.start + 1)
        budget -= k
        gain += net
        t = ct
        pt, ps, ds, sm, dc, pa, sh = (f.prefill_tokens, f.prefill_seqs, f.decode_seqs, f.sampled, f.decode_context,
                                      f.prefill_attention, f.decode_context_shared)
        dmax = f.decode_padded // ds if ds else 0
        if gain > best_gain:
            best_gain, best_len = gain, len(chosen)
    return dict(chosen[:best_len])


def _with_drafts(pt: int, ps: int, ds: int, sm: int, dc: int, dmax: int, pa: int, sh: int, c: Candidate, k: int,
                 block_size: int) -> StepFeatures:
    """The step's features with candidate c's decode made a row of k drafts (`choose_ks`)."""
    n = 1 + k
    if pt == 0:  # k more decode rows at contexts start + 2 .. start + 1 + k
        ds1, dmax1 = ds + k, max(dmax, c.start + n)
        return StepFeatures(0, ps, ds1, sm + k, dc + k * (c.start + 1) + k * (k + 1) // 2, ds1 * dmax1, pa,
                            sh + verification_shared_keys(c.start, k, block_size))
    # The candidate's decode row leaves; a chunk of 1 + k at the same position takes its place.
    ds1 = ds - 1
    return StepFeatures(pt + n, ps + 1, ds1, sm + k, dc - (c.start + 1), ds1 * dmax, pa + n * c.start + n * (n + 1) // 2,
                        sh - c.shared)
