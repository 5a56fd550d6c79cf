"""Adaptive k (sched/adaptive.py) on the pure scheduler, a fake executor and a fake step cost: k
rises with acceptance, falls to 0 as the batch grows or for drafts that are never accepted, and
the tokens stay those of plain decoding."""

from __future__ import annotations

import itertools

import pytest
from fakes import FakeExecutor, make_engine, make_request, tokens_of

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.request import SamplingParams
from cadence.sched.adaptive import Acceptance, Candidate, choose_ks, expected_tokens
from cadence.sched.features import StepFeatures
from cadence.sched.ngram import propose

PERIOD = [11, 12, 13, 14, 15, 16, 17]
ADAPTIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
FIXED = {**ADAPTIVE, "adaptive": False}


def fake_cost(f: StepFeatures) -> float:
    """A step of n tokens: 10 units of weight reads, or its arithmetic where that is more (half a
    unit a token: from 20 tokens on the step is compute-bound), plus 3 a token of work per row (as
    on the shipped CPU profile, a decode row costs about a third of a one-row step), and 3 more per
    prompt chunk. A verification row is decode rows beside decodes, a chunk beside a prompt chunk
    (`scan_rows`)."""
    n = f.prefill_tokens + f.decode_seqs
    return max(10.0, 0.5 * n) + 3.0 * n + 3.0 * f.prefill_seqs


def _contrary(prompt: list[int], n: int) -> list[int]:
    """n outputs, each a token of PERIOD other than the first draft the n-gram lookup proposes
    for it: drafts are always there, and always rejected."""
    context = list(prompt)
    for _ in range(n):
        guess = propose(context, 1, ADAPTIVE["prompt_lookup_min"], ADAPTIVE["prompt_lookup_max"])
        context.append(next(t for t in PERIOD if (t,) != guess))
    return context[len(prompt):]


def _prompt(i: int) -> list[int]:
    return PERIOD * 3 + [PERIOD[i % len(PERIOD)]]


def _run(n: int, spec: dict | None, *, repeat: bool = True, max_tokens: int = 40, chosen: list | None = None):
    """n greedy requests at once; outputs repeat PERIOD (drafts from the context are right) or,
    without `repeat`, contradict every draft. Returns the tokens per request and the step outputs;
    each step's `chosen_draft_tokens` stats go into `chosen`, if given."""
    script = {f"r{i}": list(itertools.islice(itertools.cycle(PERIOD), 64)) if repeat else _contrary(_prompt(i), 64)
              for i in range(n)}
    engine, executor, _ = make_engine(executor=FakeExecutor(script=script), speculative_config=spec,
                                      num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=512)
    engine.scheduler.step_cost = fake_cost
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request(make_request(rid=f"r{i}", prompt=_prompt(i), params=params))
    deltas: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
        if chosen is not None:
            chosen.append(list(engine.last_stats.chosen_draft_tokens))
    assert not executor.violations, executor.violations
    return {rid: tokens_of(ds) for rid, ds in deltas.items()}, executor.outputs


def _draft_counts(outputs) -> list[int]:
    """Drafts per decode row over the steps where every row decodes."""
    return [sr.num_draft_tokens for out in outputs if all(sr.start_pos >= 21 for sr in out.scheduled)
            for sr in out.scheduled]


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0, 0.5) == 1.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(4, 1.0) == 5.0 and expected_tokens(4, 0.0) == 1.0


def test_k_rises_with_acceptance() -> None:
    base = StepFeatures(decode_seqs=1, sampled=1)
    ks = [choose_ks(base, [Candidate("a", 100, 8, rate)], fake_cost, 64).get("a", 0)
          for rate in (0.1, 0.4, 0.6, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8, ks
    assert len(set(ks)) >= 3, ks  # it rises through values between, not as a switch


def test_k_is_cut_to_the_budget_and_the_best_accepting_requests_go_first() -> None:
    base = StepFeatures(decode_seqs=3, sampled=3)
    cands = [Candidate("low", 10, 4, 0.5), Candidate("high", 10, 4, 0.99), Candidate("mid", 10, 4, 0.9)]
    got = choose_ks(base, cands, fake_cost, 5)
    assert sum(got.values()) <= 5 and got.get("high") == 4 and "low" not in got


def test_a_prompt_chunk_beside_a_large_batch_does_not_make_drafts_look_cheap() -> None:
    # 32 decodes beside a 400-token chunk: the drafts' time is what matters, not the chunk's.
    cands = [Candidate(f"c{i}", 100, 4, 0.9) for i in range(32)]
    beside = StepFeatures(prefill_tokens=400, prefill_seqs=1, decode_seqs=32, sampled=32)
    assert choose_ks(beside, cands, fake_cost, 512) == {}
    alone = StepFeatures(prefill_tokens=400, prefill_seqs=1, decode_seqs=1, sampled=1)
    assert choose_ks(alone, cands[:1], fake_cost, 512) == {"c0": 4}  # one decode: its drafts pay


def test_acceptance_falls_from_its_prior_with_rejections_and_rises_with_acceptances() -> None:
    bad, good = Acceptance(), Acceptance()
    prior = bad.rate
    for _ in range(5):
        bad.record(4, 0)
        good.record(4, 4)
    assert bad.rate < 0.3 < prior < good.rate


def _test_rows(est: Acceptance, threshold: float, steps: int, accept: bool = False) -> list[int]:
    """The steps at which a request verifies a row of one draft, verifying one whenever its
    estimate is above `threshold` (what the draft costs), its drafts never (or always) accepted."""
    tested = []
    for step in range(steps):
        if est.rate > threshold:
            est.record(1, int(accept))
            tested.append(step)
        else:
            est.idle()
    return tested


def test_drafts_never_accepted_are_tested_ever_more_rarely_and_an_acceptance_ends_the_backoff() -> None:
    est = Acceptance()
    tested = _test_rows(est, 0.3, 3000)
    gaps = [b - a for a, b in zip(tested, tested[1:], strict=False)]
    idle_gaps = [g for g in gaps if g > 1]  # the first rows run back to back, the prior still high
    assert len(idle_gaps) >= 4, gaps
    # Each row that accepted nothing doubles the wait before the next (to the cap).
    assert all(b >= 1.8 * a for a, b in zip(idle_gaps[:3], idle_gaps[1:4], strict=False)), idle_gaps
    assert len(tested) < 15, tested  # without the backoff: a test row every dozen steps
    # A row that accepts ends the run: the waits start short again.
    est.record(1, 1)
    after = _test_rows(est, 0.3, 3000)
    assert after and after[0] < idle_gaps[-1] / 8, (after, idle_gaps)


def test_k_falls_to_zero_as_running_requests_rise_and_tokens_stay_the_same() -> None:
    mean_k = {}
    for n in (1, 3, 32):
        plain, _ = _run(n, None)
        got, outputs = _run(n, ADAPTIVE)
        assert got == plain  # greedy output is that of plain decoding
        counts = _draft_counts(outputs)
        mean_k[n] = sum(counts) / len(counts)
    # Alone, with drafts that are right: k at its cap, 4, on most steps (the first rows have fewer
    # drafts: the n-gram's continuation runs into the end of the context).
    assert mean_k[1] > 2.5
    assert mean_k[1] > mean_k[3] > mean_k[32] == 0.0, mean_k


def test_the_step_stats_count_each_row_s_chosen_k_and_the_rows_turned_down() -> None:
    for n, spec in ((1, ADAPTIVE), (32, ADAPTIVE), (32, FIXED)):
        chosen: list[list[int]] = []
        _, outputs = _run(n, spec, chosen=chosen)
        # a step's stats: the drafts of each of its verification rows, and a 0 per row turned down
        for step, out in zip(chosen, outputs, strict=True):
            rows = [sr.num_draft_tokens for sr in out.scheduled if sr.num_draft_tokens]
            assert sorted(k for k in step if k) == sorted(rows)
        samples = [k for step in chosen for k in step]
        if n == 1:  # alone with drafts that are right: mostly verified, at the cap
            assert samples.count(4) > len(samples) / 2
        elif spec is ADAPTIVE:  # a busy batch: every row with drafts turned down, each counted as 0
            assert samples and set(samples) == {0} and len(samples) >= 32 * 10
        else:  # fixed k turns nothing down
            assert samples and 0 not in samples
    assert _run(1, None, chosen=(off := []))[0] and not any(off)  # no speculation, no samples


def test_fixed_k_speculates_whatever_the_load() -> None:
    got, outputs = _run(32, FIXED)
    plain, _ = _run(32, None)
    assert got == plain
    counts = _draft_counts(outputs)
    assert sum(counts) / len(counts) > 3.0


def test_a_request_whose_drafts_are_never_accepted_stops_speculating() -> None:
    plain, _ = _run(1, None, repeat=False, max_tokens=200)
    got, outputs = _run(1, ADAPTIVE, repeat=False, max_tokens=200)
    assert got == plain
    rows = [sr for out in outputs for sr in out.scheduled if sr.start_pos >= 21]
    tried = [i for i, sr in enumerate(rows) if sr.num_draft_tokens]
    assert tried[:1] == [0], "it tries its drafts at first"
    # Then k is 0 but for a rare row that tests the estimate again (its evidence fades while idle).
    assert len(tried) < len(rows) / 10, (len(tried), len(rows))
    fixed, fixed_outputs = _run(1, FIXED, repeat=False, max_tokens=200)
    assert fixed == plain
    assert sum(1 for out in fixed_outputs for sr in out.scheduled if sr.num_draft_tokens) > len(rows) / 4


def test_the_server_prices_drafts_with_its_cost_profile_and_none_leaves_the_analytic_shape() -> None:
    from types import SimpleNamespace

    from cadence.config import ServerConfig
    from cadence.sched.adaptive import analytic_step_cost
    from cadence.server.app import _attach_predictor

    f = StepFeatures(decode_seqs=3, sampled=3, decode_context=300, decode_padded=300)
    for profile in (None, "none"):
        sched = SimpleNamespace(step_cost=analytic_step_cost)
        engine = SimpleNamespace(predictor=None, core=SimpleNamespace(scheduler=sched), model_name="m")
        _attach_predictor(engine, ServerConfig(cost_profile=profile))
        if profile is None:  # the shipped profile, in seconds
            assert sched.step_cost(f) == engine.predictor.cost_model.predict(f) != analytic_step_cost(f)
            # Whether it prices shared keys is its feature set's (the shipped profile of this machine's threads).
            assert sched.step_cost_prices_shared is engine.predictor.cost_model.prices_shared_context
        else:
            assert sched.step_cost is analytic_step_cost


@pytest.mark.parametrize("prices_shared", [True, False])
def test_the_step_priced_for_drafts_counts_shared_keys_when_its_cost_does(prices_shared: bool) -> None:
    """Requests sharing a prompt prefix hold its blocks in common: the planned step handed to the
    step cost carries the keys re-read from them, where the cost prices them (else none are counted)."""
    seen: list[StepFeatures] = []

    def cost(f: StepFeatures) -> float:
        seen.append(f)
        return fake_cost(f)

    script = {f"r{i}": list(itertools.islice(itertools.cycle(PERIOD), 64)) for i in range(4)}
    engine, _, _ = make_engine(executor=FakeExecutor(script=script), speculative_config=ADAPTIVE, block_size=4,
                               num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
    engine.scheduler.step_cost = cost
    engine.scheduler.step_cost_prices_shared = prices_shared
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # The same 21 leading tokens: the first prompt's 5 whole blocks of 4, once computed, are the
    # others' prefix-cache hit.
    engine.add_request(make_request(rid="r0", prompt=_prompt(0), params=params))
    engine.step()
    for i in range(1, 4):
        engine.add_request(make_request(rid=f"r{i}", prompt=_prompt(i), params=params))
    while engine.has_unfinished_requests():
        engine.step()
    shared = [f.decode_context_shared for f in seen]
    assert seen and (max(shared) >= 3 * 20 if prices_shared else max(shared) == 0)


def _row(rid: str, n: int, start: int, drafts: int = 0) -> ScheduledRequest:
    return ScheduledRequest(rid, tuple(range(n)), start, tuple(range(start // 4 + 3)), True, SamplingParams(),
                            num_draft_tokens=drafts)


def test_a_verification_row_beside_decodes_is_priced_as_the_decode_rows_it_runs_as() -> None:
    """Beside decodes only, a row of k drafts at position p is k + 1 decode rows of contexts p + 1 ..
    p + k + 1 (the runner runs the step on its all-decode path); beside a prompt chunk it is a chunk."""
    verify, decode, prompt = _row("v", 5, 40, drafts=4), _row("d", 1, 9), _row("p", 6, 0)
    alone = StepFeatures.from_output(SchedulerOutput(0, (verify, decode)))
    assert (alone.prefill_tokens, alone.prefill_seqs, alone.decode_seqs, alone.sampled) == (0, 0, 6, 6)
    assert alone.decode_context == 41 + 42 + 43 + 44 + 45 + 10 and alone.decode_padded == 6 * 45
    chunked = StepFeatures.from_output(SchedulerOutput(0, (verify, decode, prompt)))
    assert (chunked.prefill_tokens, chunked.prefill_seqs, chunked.decode_seqs, chunked.sampled) == (11, 2, 1, 7)
    assert chunked.prefill_attention == (5 * 40 + 15) + 21 and chunked.decode_context == 10
    # choose_ks prices a candidate's drafts as the step it plans will be priced once laid out.
    seen: list[StepFeatures] = []

    def cost(f: StepFeatures) -> float:
        seen.append(f)
        return fake_cost(f)

    base = StepFeatures.from_output(SchedulerOutput(0, (_row("v", 1, 40), decode)))
    choose_ks(base, [Candidate("v", 40, 4, 0.99)], cost, 64)
    assert alone in seen


def test_a_draft_is_kept_only_where_it_beats_its_time_by_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode under fake_cost: a draft adds 3 units to a step of 13, the time of 3/13 of a token;
    it is verified where its acceptance beats DRAFT_COST_MARGIN times that, not merely that."""
    import cadence.sched.adaptive as adaptive

    base = StepFeatures(decode_seqs=1, sampled=1)
    time_in_tokens = 3 / 13
    low, high = 1.2 * time_in_tokens, 1.8 * time_in_tokens  # either side of the margin, 1.5
    assert choose_ks(base, [Candidate("a", 100, 4, low)], fake_cost, 64) == {}
    assert choose_ks(base, [Candidate("a", 100, 4, high)], fake_cost, 64) == {"a": 1}
    monkeypatch.setattr(adaptive, "DRAFT_COST_MARGIN", 1.0)  # priced at its time alone, the lower one pays too
    assert choose_ks(base, [Candidate("a", 100, 4, low)], fake_cost, 64) == {"a": 1}


def _accepting(prompt: list[int], n: int, every: int) -> list[int]:
    """n outputs where the n-gram lookup's first draft is right at every `every`-th output and wrong
    at the others: drafts are always there, and accepted that often."""
    context = list(prompt)
    for i in range(n):
        guess = propose(context, 1, ADAPTIVE["prompt_lookup_min"], ADAPTIVE["prompt_lookup_max"])
        context.append(guess[0] if i % every == 0 else next(t for t in PERIOD if (t,) != guess))
    return context[len(prompt):]


@pytest.mark.parametrize("every", [1, 10])
def test_priced_by_the_shipped_profile_k_stays_up_where_drafts_are_accepted_and_falls_where_they_are_not(
        every: int) -> None:
    """One request, the step cost the server uses at two threads: with every draft right it verifies
    k at its cap on most steps; with one first draft in ten right, after its first tries it
    verifies fewer than 0.3 drafts a step, where fixed k verifies over 3; the tokens are those of
    plain decoding either way."""
    from cadence.executor.cost_model import StepCostModel, default_profile_path

    profile = StepCostModel.load(str(default_profile_path(2)))
    prompt = PERIOD * 3 + [PERIOD[0]]
    outputs = list(itertools.islice(itertools.cycle(PERIOD[1:] + PERIOD[:1]), 160)) if every == 1 \
        else _accepting(prompt, 160, every)

    def run(spec: dict | None) -> tuple[list[int], list[int]]:
        engine, executor, _ = make_engine(executor=FakeExecutor(script={"r": outputs}), speculative_config=spec,
                                          num_kv_blocks=256, block_size=16)
        engine.scheduler.step_cost = profile.predict
        engine.scheduler.step_cost_prices_shared = profile.prices_shared_context
        engine.add_request(make_request(rid="r", prompt=prompt, params=SamplingParams(
            max_tokens=160, temperature=0.0, ignore_eos=True)))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        assert not executor.violations, executor.violations
        ks = [sr.num_draft_tokens for out in executor.outputs for sr in out.scheduled if sr.start_pos >= len(prompt)]
        return tokens_of(deltas), ks

    plain, _ = run(None)
    got, ks = run(ADAPTIVE)
    fixed, fixed_ks = run(FIXED)
    assert got == fixed == plain == outputs
    if every == 1:
        assert sum(k == 4 for k in ks) > 0.8 * len(ks), ks
    else:
        assert ks[0] > 0, "it tries its drafts at first"
        # Then a row of one draft now and then, as the estimate fades back above what a draft costs.
        assert sum(ks[10:]) < 0.3 * len(ks[10:]), ks
        assert sum(fixed_ks) > 3 * len(fixed_ks), fixed_ks  # (a continuation can be shorter than 4)


def _one_stream_k(rate: float) -> int:
    """k for one request at position 299 decoding alone, priced by the shipped two-thread profile
    (where each draft of a lone request adds about 0.17 of a one-row step)."""
    from cadence.executor.cost_model import StepCostModel, default_profile_path

    profile = StepCostModel.load(str(default_profile_path(2)))
    base = StepFeatures(decode_seqs=1, sampled=1, decode_context=300, decode_padded=300)
    return choose_ks(base, [Candidate("a", 299, 4, rate)], profile.predict, 64).get("a", 0)


def test_at_one_stream_k_stays_at_its_cap_at_65_percent_and_is_0_at_low_acceptance(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The margin decides whether a row is verified at all; its drafts after the first are judged at
    break-even: at 65% acceptance the fourth draft's 0.18 expected tokens pay for its 0.17 of a
    step, so k is 4 (3 with every draft held to the margin); at 20%, where a lone draft pays for
    its time but not 1.5 times it, and below, no drafts."""
    import cadence.sched.adaptive as adaptive

    assert _one_stream_k(0.65) == 4
    assert [_one_stream_k(a) for a in (0.05, 0.1, 0.2)] == [0, 0, 0]
    assert _one_stream_k(0.3) == 1
    monkeypatch.setattr(adaptive, "FURTHER_DRAFT_MARGIN", adaptive.DRAFT_COST_MARGIN)
    assert _one_stream_k(0.65) == 3
    monkeypatch.setattr(adaptive, "DRAFT_COST_MARGIN", 1.0)
    assert _one_stream_k(0.2) == 1  # priced at its time alone, the lone draft pays
