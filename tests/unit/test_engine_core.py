"""EngineCore: sizing, the step loop, errors in a step, aborts, stats."""

from __future__ import annotations

import logging

import pytest
from fakes import FakeExecutor, generate_alone, make_engine, make_request, run_until_done, tokens_of

from cadence.clock import VirtualClock
from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.errors import AdmissionError, ErrorKind
from cadence.request import FinishReason, RequestStatus


def test_kv_cache_is_sized_from_memory_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    ex = FakeExecutor(bytes_per_token=100)
    cfg = EngineConfig.from_options(kv_cache_memory=1_000_000, block_size=16)
    with caplog.at_level(logging.INFO, logger="cadence.engine.core"):
        engine = EngineCore(cfg, ex, clock=VirtualClock(), max_model_len=512)
    assert engine.num_blocks == 1_000_000 // (16 * 100) == 625
    assert ex.num_blocks == 625 and ex.block_size == 16  # the executor was told
    assert "625 blocks" in caplog.text and str(625 * 16) in caplog.text
    assert engine.max_model_len == 512


def test_num_kv_blocks_overrides_memory_and_too_little_memory_is_an_error() -> None:
    engine, ex, _ = make_engine(num_kv_blocks=7)
    assert engine.num_blocks == 7 == ex.num_blocks
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineCore(EngineConfig.from_options(kv_cache_memory=10), FakeExecutor(), max_model_len=64)


def test_add_request_fills_arrival_time_and_eos() -> None:
    clock = VirtualClock(5.0)
    engine = EngineCore(
        EngineConfig.from_options(num_kv_blocks=16), FakeExecutor(clock=clock), clock=clock,
        max_model_len=256, eos_token_ids=frozenset({3}),
    )
    r = make_request()
    engine.add_request(r)
    assert r.arrival_time == 5.0 and r.eos_token_ids == frozenset({3})
    kept = make_request(arrival_time=2.0, eos_token_ids=frozenset({9}))
    engine.add_request(kept)
    assert kept.arrival_time == 2.0 and kept.eos_token_ids == frozenset({9})
    with pytest.raises(AdmissionError) as e:
        engine.add_request(make_request(prompt_len=300))
    assert e.value.kind == ErrorKind.INVALID_REQUEST


def test_step_produces_deltas_stats_and_finishes() -> None:
    engine, ex, clock = make_engine()
    reqs = [make_request(prompt_len=6, max_tokens=5) for _ in range(3)]
    for r in reqs:
        engine.add_request(r)
    first = engine.step()
    assert {d.request_id for d in first} == {r.request_id for r in reqs}
    stats = engine.last_stats
    assert stats.step == 1 and stats.num_prompt_tokens == 18 and stats.num_generation_tokens == 3
    assert stats.step_time == pytest.approx(ex.step_cost)  # timed on the engine clock
    assert len(stats.first_token_latencies) == 3
    assert engine.scheduler_stats.num_running == 3 and engine.scheduler_stats.kv_usage > 0
    deltas = run_until_done(engine)
    for r in reqs:
        assert tokens_of(deltas[r.request_id])[-4:] == r.output_token_ids[1:]
        assert r.output_token_ids == generate_alone(r.prompt_token_ids, 5)
    assert engine.scheduler_stats.num_running == 0 and engine.scheduler_stats.kv_usage == 0
    assert not engine.has_unfinished_requests()


def test_an_idle_step_does_not_call_the_executor() -> None:
    engine, ex, _ = make_engine()
    assert engine.step() == []
    assert ex.outputs == []


def test_a_failing_step_errors_its_requests_and_the_engine_goes_on() -> None:
    engine, ex, _ = make_engine()
    ex.fail_steps = {2}
    early = [make_request(prompt_len=4, max_tokens=5) for _ in range(2)]
    for r in early:
        engine.add_request(r)
    engine.step()
    deltas = engine.step()  # raises inside the executor
    assert {d.request_id for d in deltas} == {r.request_id for r in early}
    assert all(d.finish_reason == FinishReason.ERROR and "scripted failure" in (d.error or "") for d in deltas)
    assert engine.kv.usage == 0  # blocks freed
    later = make_request(prompt_len=4, max_tokens=3)
    engine.add_request(later)
    out = run_until_done(engine)
    assert out[later.request_id][-1].finish_reason == FinishReason.LENGTH
    assert later.request_id not in {d.request_id for d in deltas}


def test_abort_between_steps_frees_blocks_and_reports_once() -> None:
    engine, ex, _ = make_engine()
    r = make_request(prompt_len=8, max_tokens=50)
    engine.add_request(r)
    engine.step()
    (d,) = engine.abort_requests([r.request_id])
    assert d.finish_reason == FinishReason.ABORT and d.metrics is not None
    assert engine.kv.usage == 0 and not engine.has_unfinished_requests()
    assert engine.abort_requests([r.request_id]) == []
    assert engine.step() == [] and engine.last_stats.finished[0].finish_reason == "abort"


def test_finish_requests_from_a_stop_string() -> None:
    engine, _, _ = make_engine()
    r = make_request(max_tokens=50)
    engine.add_request(r)
    engine.step()
    (d,) = engine.finish_requests([r.request_id], stop_reason="\n\n")
    assert d.finish_reason == FinishReason.STOP and d.stop_reason == "\n\n"
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_preempted_requests_resume_with_identical_outputs() -> None:
    engine, ex, _ = make_engine(num_kv_blocks=12, block_size=4, max_num_batched_tokens=32)
    reqs = [make_request(prompt_len=9, max_tokens=16) for _ in range(4)]
    for r in reqs:
        engine.add_request(r)
    run_until_done(engine)
    assert sum(r.num_preemptions for r in reqs) >= 1
    for r in reqs:
        assert r.output_token_ids == generate_alone(r.prompt_token_ids, 16)
    assert ex.violations == []


def test_shared_prefix_is_computed_once_and_outputs_match() -> None:
    engine, ex, _ = make_engine(num_kv_blocks=64, block_size=4)
    system = list(range(1, 21))  # a 20-token shared system prompt
    a = make_request(prompt=system + [30, 31], max_tokens=4)
    engine.add_request(a)
    run_until_done(engine)
    b = make_request(prompt=system + [40, 41, 42], max_tokens=4)
    engine.add_request(b)
    engine.step()
    assert b.num_cached_tokens == 20
    assert engine.last_stats.prefix_cache_hits == 20 and engine.last_stats.prefix_cache_queries == 23
    run_until_done(engine)
    assert b.output_token_ids == generate_alone(b.prompt_token_ids, 4)
    assert ex.violations == []


def test_deadline_expiry_frees_blocks_in_the_engine() -> None:
    engine, _, clock = make_engine()
    r = make_request(prompt_len=8, max_tokens=200, deadline=clock.now() + 0.1)
    engine.add_request(r)
    out = run_until_done(engine)
    assert out[r.request_id][-1].finish_reason == FinishReason.DEADLINE
    assert engine.kv.usage == 0 and 5 <= len(r.output_token_ids) <= 12


def test_flush_stats_reports_what_ended_between_steps_when_nothing_is_left() -> None:
    """An abort between steps is counted in the next step's stats; an engine with nothing left takes
    no next step, so its loop closes them with flush_stats (once: a second flush finds nothing)."""
    engine, _, _ = make_engine()
    assert engine.flush_stats() is None  # nothing pending: no empty record
    late = make_request(rid="late", max_tokens=8)
    engine.add_request(late)
    engine.step()
    engine.abort_requests(["late"])
    assert not engine.has_unfinished_requests()
    assert engine.last_stats.finished == []  # the step ran before the abort
    it = engine.flush_stats()
    assert it is not None and [f.request_id for f in it.finished] == ["late"]
    assert it.finished[0].finish_reason == FinishReason.ABORT and engine.last_stats is it
    assert engine.flush_stats() is None
