"""Speculative decoding (n-gram drafts, greedy verification) on the fake executor: the proposer,
the configuration, and the scheduler's verification rows (budget, KV rollback, stops mid-draft,
preemption), each against the same run without speculation."""

from __future__ import annotations

import itertools
import json

import pytest
from fakes import FakeExecutor, generate_alone, make_engine, make_request, run_until_done, tokens_of
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.config import EngineConfig, SpeculativeConfig, option_flags
from cadence.request import SamplingParams
from cadence.sched.ngram import PackedTokens, propose

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PERIOD = [11, 12, 13, 14, 15, 16, 17]


# ---------------------------------------------------------------- the proposer
def test_propose_takes_what_followed_the_latest_occurrence_of_the_longest_suffix() -> None:
    # The 2-gram (7, 8) occurs at 0 (then 9) and the 1-gram 8 later at 5 (then 4): the longer wins.
    assert propose([7, 8, 9, 9, 9, 8, 4, 7, 8], 2, 1, 3) == (9, 9)
    # Two occurrences of the same n-gram: the latest one's continuation.
    assert propose([1, 2, 3, 1, 2, 5, 6, 1, 2], 2, 2, 2) == (5, 6)
    # Only what is known follows: fewer than k drafts near the end.
    assert propose([1, 2, 3, 1, 2], 5, 2, 2) == (3, 1, 2)


def test_propose_finds_nothing_below_min_n_or_without_a_match() -> None:
    assert propose([1, 2, 3, 4], 3, 1, 3) == ()
    assert propose([1, 2, 9, 1, 3], 3, 1, 3) == ()  # 3 never occurred before
    assert propose([5, 1, 2, 5], 3, 2, 2) == ()  # the 1-gram 5 occurs, but min_n is 2
    assert propose([5, 1, 2, 5], 3, 1, 2) == (1, 2, 5)
    assert propose([5], 3, 1, 1) == () and propose([1, 1], 0, 1, 1) == ()


def test_propose_matches_whole_tokens_not_bytes() -> None:
    # Packed as 32-bit little-endian, a, b are the bytes 11 22 33 44 55 66 77 88: x's bytes
    # (33 44 55 66) occur inside them, straddling two tokens, but x itself never occurred.
    a, b, x = 0x44332211, 0x88776655, 0x66554433
    assert propose([a, b, x], 2, 1, 1) == ()
    # Past such a straddling byte match, the real (earlier) occurrence of x is found.
    assert propose([x, 9, a, b, x], 2, 1, 1) == (9, a)


def _reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """The definition, by brute force."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5) | st.sampled_from([0x44332211, 0x88776655, 0x66554433]), max_size=40),
       st.integers(1, 5), st.integers(1, 3), st.integers(0, 3), st.integers(0, 40))
def test_propose_equals_the_brute_force_definition_also_when_packed_incrementally(
        tokens: list[int], k: int, min_n: int, extra: int, cut: int) -> None:
    max_n = min_n + extra
    want = _reference_propose(tokens, k, min_n, max_n)
    assert propose(tokens, k, min_n, max_n) == want
    grown = PackedTokens(tokens[:cut])
    grown.extend(tokens[cut:])
    follow = grown.continuation(min_n, max_n)
    assert (() if follow is None else tuple(tokens[follow : follow + k])) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=60), st.integers(1, 4), st.integers(0, 70))
def test_propose_equals_the_brute_force_definition_with_wide_lookup_bounds(
        tokens: list[int], min_n: int, extra: int) -> None:
    # A small alphabet repeats long n-grams, so the longest match lies anywhere in the bounds.
    assert propose(tokens, 4, min_n, min_n + extra) == _reference_propose(tokens, 4, min_n, min_n + extra)


def test_a_huge_prompt_lookup_max_costs_a_few_searches_not_one_per_length(monkeypatch: pytest.MonkeyPatch) -> None:
    # Distinct tokens but for the last, which repeats the first: only the 1-gram occurs earlier.
    tokens = [*range(4000), 0]
    calls = []
    search = PackedTokens._latest_match

    def counted(self: PackedTokens, n: int) -> int | None:
        calls.append(n)
        return search(self, n)

    monkeypatch.setattr(PackedTokens, "_latest_match", counted)
    assert propose(tokens, 3, 1, 10**9) == (1, 2, 3)
    assert len(calls) <= 2 + len(tokens).bit_length()


# ---------------------------------------------------------------- configuration
def test_config_takes_vllm_json_and_fills_lookup_bounds_like_vllm() -> None:
    cfg = EngineConfig.from_options(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 5, 5)
    one = EngineConfig.from_options(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (one.speculative_config.prompt_lookup_min, one.speculative_config.prompt_lookup_max) == (4, 4)
    assert EngineConfig.from_options().speculative_config is None
    flags = option_flags("speculative_config", cfg.speculative_config)
    assert flags[0] == "--speculative-config" and json.loads(flags[1])["num_speculative_tokens"] == 3
    assert cfg.replace(max_num_seqs=3).speculative_config == cfg.speculative_config


def test_draft_model_config_has_no_lookup_bounds_and_survives_a_round_trip() -> None:
    cfg = EngineConfig.from_options(speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 3})
    spec = cfg.speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (None, None)
    assert cfg.replace(max_num_seqs=3).speculative_config == spec
    flags = option_flags("speculative_config", spec)
    assert EngineConfig.from_options(speculative_config=flags[1]).speculative_config == spec


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens: required"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 99}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    # A bound given alone also stands for the other: the error names the key that was given.
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max: must be >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": "3"}, "speculative_config.prompt_lookup_max: must be an integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 2.5}, "speculative_config.prompt_lookup_min: must be an integer"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_max: only with method ngram"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
     "speculative_config.prompt_lookup_min: only with method ngram"),
    ({"num_speculative_tokens": 2, "draft": 1}, "unknown key(s) ['draft']"),
    ("{not json", "speculative_config: not JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_speculative_config_is_refused_naming_the_field(value, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineConfig.from_options(speculative_config=value)


# ---------------------------------------------------------------- the scheduler and the engine
def _repetitive(rid: str, n: int = 64) -> list[int]:
    return list(itertools.islice(itertools.cycle(PERIOD), n))


def _run(requests_args: list[dict], spec: dict | None, **options) -> tuple[dict[str, list[int]], dict[str, int], list]:
    """Run the requests on a fake whose outputs repeat PERIOD (the scripted ones) or follow its
    context hash (the others); returns each request's tokens, the spec counters, the step outputs."""
    script = {a["rid"]: _repetitive(a["rid"]) for a in requests_args if a.pop("repeat", True)}
    executor = FakeExecutor(script=script)
    engine, executor, _ = make_engine(executor=executor, speculative_config=spec, **options)
    for a in requests_args:  # greedy unless told: only greedy requests speculate
        a.setdefault("params", SamplingParams(max_tokens=a.pop("max_tokens", 16), temperature=0.0, ignore_eos=True))
    reqs = [make_request(**a) for a in requests_args]
    for r in reqs:
        engine.add_request(r)
    deltas: dict[str, list] = {}
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": 0}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
        st = engine.last_stats
        counts["drafts"] += st.num_drafts
        counts["draft_tokens"] += st.num_draft_tokens
        counts["accepted"] += st.num_accepted_tokens
        counts["per_pos"] += sum(st.num_accepted_tokens_per_pos)
    assert not executor.violations, executor.violations
    return {r.request_id: tokens_of(deltas[r.request_id]) for r in reqs}, counts, executor.outputs


def _requests(n: int = 3, max_tokens: int = 40) -> list[dict]:
    return [{"rid": f"q{i}", "prompt": PERIOD * 2 + [i + 1], "max_tokens": max_tokens} for i in range(n)]


def test_speculation_gives_the_tokens_of_plain_decoding_in_fewer_steps() -> None:
    plain, off, plain_steps = _run(_requests(), None)
    got, counts, steps = _run(_requests(), NGRAM)
    assert got == plain
    assert off == {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": 0}
    assert counts["accepted"] > 0 and counts["draft_tokens"] >= counts["accepted"] == counts["per_pos"]
    assert len(steps) < len(plain_steps)
    rows = [sr for out in steps for sr in out.scheduled if sr.num_draft_tokens]
    assert rows and all(len(sr.token_ids) == 1 + sr.num_draft_tokens <= 5 for sr in rows)


def test_rejected_drafts_are_verified_against_the_model_and_change_nothing() -> None:
    # Outputs from the context hash: drafts come from the repeated prompt but are mostly wrong.
    args = [{"rid": f"h{i}", "prompt": PERIOD * 3, "max_tokens": 30, "repeat": False} for i in range(2)]
    plain, _, _ = _run([dict(a) for a in args], None)
    got, counts, _ = _run([dict(a) for a in args], NGRAM)
    assert got == plain
    assert counts["draft_tokens"] > counts["accepted"]  # some were rejected, and rolled back


def test_rejected_drafts_give_their_blocks_back() -> None:
    engine, executor, _ = make_engine(speculative_config=NGRAM, block_size=2)
    req = make_request(rid="b", prompt=PERIOD * 2, params=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    executor.script["b"] = [1, 2, 3, 4, 5, 6, 7, 8] * 4  # never what the prompt suggests
    engine.add_request(req)
    saw_drafts = False
    while engine.has_unfinished_requests():
        engine.step()
        out = executor.outputs[-1]
        saw_drafts |= any(sr.num_draft_tokens for sr in out.scheduled)
        if req.is_finished:
            break
        held = len(engine.kv.block_table("b"))
        assert held == engine.kv.num_blocks_needed(req.num_computed_tokens), (held, req.num_computed_tokens)
    assert saw_drafts


def test_drafts_count_against_the_token_budget() -> None:
    _, counts, steps = _run(_requests(4), NGRAM, max_num_batched_tokens=8)
    assert counts["accepted"] > 0
    for out in steps:
        assert sum(len(sr.token_ids) for sr in out.scheduled) == out.num_batched_tokens <= 8


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens"])
def test_a_stop_inside_accepted_drafts_ends_the_request_there(stop: str) -> None:
    # The outputs repeat PERIOD; drafts start once min_tokens (8) are out, and the 14 at output 10 is the
    # third draft of the first verification row: the request ends there (or at max_tokens, 10).
    params = {"eos": SamplingParams(max_tokens=40, min_tokens=8, temperature=0.0),
              "stop_token": SamplingParams(max_tokens=40, stop_token_ids=[14], min_tokens=8, ignore_eos=True,
                                           temperature=0.0),
              "max_tokens": SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)}[stop]
    args = [{"rid": "s", "prompt": PERIOD * 2, "params": params}]
    eos = {"eos_token_ids": frozenset({14})} if stop == "eos" else {}
    outs = {}
    for spec in (None, NGRAM):
        a = [dict(args[0], **eos)]
        outs[spec is not None], counts, steps = _run(a, spec)
    assert outs[True] == outs[False]
    want_len = 10 if stop == "max_tokens" else next(i for i, t in enumerate(_repetitive("s")) if t == 14 and i >= 7) + 1
    assert len(outs[True]["s"]) == want_len
    assert counts["accepted"] > 0
    last = [sr for out in steps for sr in out.scheduled][-1]
    if stop != "max_tokens":  # the last row verified drafts past the stop, which were dropped
        assert last.num_output_tokens + last.num_draft_tokens + 1 > want_len
    else:  # drafts never reach past max_tokens
        assert last.num_output_tokens + last.num_draft_tokens + 1 <= want_len


def test_preemption_with_speculation_keeps_the_tokens() -> None:
    reqs = [{"rid": f"p{i}", "prompt": PERIOD * 2 + [i + 1], "max_tokens": 48} for i in range(6)]
    plain, _, _ = _run([dict(a) for a in reqs], None, num_kv_blocks=24)
    got, counts, steps = _run([dict(a) for a in reqs], NGRAM, num_kv_blocks=24)
    assert any(out.preempted_ids for out in steps), "the cache is meant to be too small for all of them"
    assert counts["accepted"] > 0
    assert got == plain


def test_opted_out_and_logprobs_requests_do_not_speculate_beside_ones_that_do() -> None:
    args = [
        {"rid": "g", "prompt": PERIOD * 2, "params": SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)},
        {"rid": "t", "prompt": PERIOD * 2, "params": SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)},
        {"rid": "o", "prompt": PERIOD * 2,
         "params": SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=False)},
        {"rid": "l", "prompt": PERIOD * 2,
         "params": SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)},
    ]
    plain, _, _ = _run([dict(a) for a in args], None)
    got, _, steps = _run([dict(a) for a in args], NGRAM)
    assert got == plain
    speculated = {sr.request_id for out in steps for sr in out.scheduled if sr.num_draft_tokens}
    assert speculated == {"g", "t"}  # greedy and sampling; not the opted-out one, nor the one asking logprobs


def test_engine_without_speculation_schedules_no_drafts() -> None:
    engine, executor, _ = make_engine()
    engine.add_request(make_request(prompt=PERIOD * 3, max_tokens=20))
    run_until_done(engine)
    assert not any(sr.num_draft_tokens for out in executor.outputs for sr in out.scheduled)


def test_blocks_published_after_rejections_hold_only_kept_tokens() -> None:
    """A request whose drafts are often rejected publishes its full blocks; a later request whose
    prompt is its whole text hits them, and reads (through the fake's KV) exactly that text."""
    engine, executor, _ = make_engine(speculative_config=NGRAM, block_size=2, num_kv_blocks=128)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    first = make_request(rid="a", prompt=PERIOD * 2, params=greedy)
    # The period with a wrong turn every few tokens: drafts from the period, some rejected midway.
    executor.script["a"] = [t if i % 5 != 3 else 900 + i for i, t in enumerate(_repetitive("a", 30))]
    engine.add_request(first)
    out_a = tokens_of(run_until_done(engine)["a"])
    rows = [sr for out in executor.outputs for sr in out.scheduled if sr.num_draft_tokens]
    assert rows, "the request was meant to speculate"
    assert sum(sr.num_draft_tokens for sr in rows) + len(rows) > len(out_a), "some drafts were meant to be rejected"
    text = PERIOD * 2 + out_a
    second = make_request(rid="b", prompt=text, params=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.add_request(second)
    out_b = tokens_of(run_until_done(engine)["b"])
    assert second.num_cached_tokens >= len(text) - 2 * 2  # all but the last block or so came from the cache
    assert not executor.violations
    assert out_b == generate_alone(text, 5)


def test_an_executor_answer_that_does_not_match_the_drafts_ends_the_request_with_an_error() -> None:
    class Liar(FakeExecutor):
        def _verify(self, sr):  # claims drafts it was not given were accepted
            return tuple(t + 1 for t in sr.draft_token_ids) + (1,)

    engine, _, _ = make_engine(executor=Liar(), speculative_config=NGRAM)
    engine.add_request(make_request(rid="x", prompt=PERIOD * 2,
                                    params=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    engine.executor.script["x"] = _repetitive("x")
    final = run_until_done(engine)["x"][-1]
    assert final.finish_reason is not None and final.finish_reason.value == "error"
    assert final.error == "the executor's verified tokens are not the drafts"
