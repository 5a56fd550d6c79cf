"""The engine's stats of one leg of a request served by two engines (disaggregated prefill and
decode, `RequestPolicy.handoff`): the prefill leg ended at its first token is no finished request;
the decode leg counts no prompt tokens, its first token is an inter-token gap, and its finish
record is the whole request's."""

from __future__ import annotations

import pytest
from fakes import FakeExecutor, make_engine, make_request

from cadence.boundary import FinishedRequestStats, IterationStats
from cadence.engine.async_engine import fan_out
from cadence.metrics.prometheus import PrometheusExporter
from cadence.request import DECODE_LEG, PREFILL_LEG, HandOff, RequestPolicy, SamplingParams

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _run(engine) -> list[IterationStats]:
    stats = []
    while engine.has_unfinished_requests():
        engine.step()
        stats.append(engine.last_stats)
    return stats


def _one(stats: list[IterationStats]) -> FinishedRequestStats:
    (f,) = [f for it in stats for f in it.finished]
    return f


def test_a_prefill_leg_ended_at_its_token_limit_is_handed_off_and_not_a_finished_request() -> None:
    engine, _, _ = make_engine()
    req = make_request(prompt_len=10, max_tokens=1, handoff=HandOff(PREFILL_LEG))
    engine.add_request(req)
    stats = _run(engine)
    f = _one(stats)
    assert f.handed_off and f.finish_reason == "length"
    # Its step-level work counts: the prompt, the first token and its TTFT.
    assert sum(it.num_prompt_tokens for it in stats) == 10
    assert sum(it.num_generation_tokens for it in stats) == 1
    assert len([t for it in stats for t in it.first_token_latencies]) == 1
    exporter = PrometheusExporter()
    for it in stats:
        exporter.record_step(it, None)
    r = exporter.registry
    assert r.get_sample_value("cadence:finished_requests_total", {"reason": "length", "tenant": "default"}) is None
    assert r.get_sample_value("cadence:e2e_request_latency_seconds_count", {"tenant": "default"}) is None
    assert r.get_sample_value("cadence:request_queue_time_seconds_count", {"tenant": "default"}) is None
    assert r.get_sample_value("cadence:time_to_first_token_seconds_count", {"tenant": "default"}) == 1
    assert r.get_sample_value("cadence:prompt_tokens_total") == 10


def test_a_prefill_leg_that_ends_the_request_there_is_a_finished_request() -> None:
    engine, _, _ = make_engine(executor=FakeExecutor(script={"p": [42]}))
    req = make_request(prompt_len=10, rid="p", params=SamplingParams(max_tokens=1), handoff=HandOff(PREFILL_LEG),
                       eos_token_ids=frozenset({42}))
    engine.add_request(req)
    f = _one(_run(engine))
    assert f.finish_reason == "stop" and not f.handed_off


def test_a_decode_leg_counts_no_prompt_tokens_its_first_token_is_a_gap_and_it_finishes_as_the_request() -> None:
    engine, _, clock = make_engine()
    prompt = make_request(prompt_len=11).prompt_token_ids + [5]  # the prompt and the first token
    h = HandOff(DECODE_LEG, num_emitted=1, since_arrival=0.5, since_scheduled=0.4, since_first_token=0.2)
    now = clock.now()
    (req,) = fan_out([prompt], PARAMS, "d", now, RequestPolicy(handoff=h))
    assert req.last_token_time == pytest.approx(now - 0.2)
    engine.add_request(req)
    stats = _run(engine)
    assert sum(it.num_prompt_tokens for it in stats) == 0
    assert sum(it.num_generation_tokens for it in stats) == 5
    assert [t for it in stats for t in it.first_token_latencies] == []
    gaps = [s for it in stats for _, s in it.token_latencies]
    assert len(gaps) == 5  # the hand-off's gap (first to second token), then four more
    assert gaps[0] == pytest.approx(req.first_token_time - now + 0.2)
    f = _one(stats)
    assert not f.handed_off
    assert (f.num_prompt_tokens, f.num_output_tokens) == (11, 6)
    assert f.max_tokens == 6  # the request's: the leg's own 5, and the token emitted before it
    m = f.metrics
    assert m.queue_time == pytest.approx(0.1) and m.ttft == pytest.approx(0.3)
    assert m.e2e_latency == pytest.approx(req.finished_time - now + 0.5)
    # The gaps after the first token add up to the request's time after it.
    assert m.e2e_latency == pytest.approx(m.ttft + sum(gaps))


def test_a_hand_off_measured_later_moves_every_offset() -> None:
    h = HandOff(DECODE_LEG, 1, 0.5, 0.4, 0.2).later(0.25)
    assert (h.since_arrival, h.since_scheduled, h.since_first_token) == (0.75, 0.65, 0.45)
