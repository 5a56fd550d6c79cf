"""The scheduler driven step by step with the fake executor (no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from fakes import FakeExecutor, generate_alone, make_request

from cadence.boundary import ModelOutput, RequestDelta, SchedulerOutput, WaitReason
from cadence.config import CacheConfig, SchedulerConfig
from cadence.errors import AdmissionError, ErrorKind
from cadence.kv.manager import KVCacheManager
from cadence.request import FinishReason, Request, RequestStatus, SamplingParams
from cadence.sched.scheduler import Scheduler


@dataclass
class Harness:
    s: Scheduler
    ex: FakeExecutor
    now: float = 1.0
    deltas: dict[str, list[RequestDelta]] = field(default_factory=dict)

    def add(self, req: Request) -> Request:
        if req.arrival_time == 0.0:
            req.arrival_time = self.now
        self.s.add_request(req, self.now)
        return req

    def step(self) -> SchedulerOutput:
        out = self.s.schedule(self.now)
        result = ModelOutput() if out.is_empty else self.ex.execute(out)
        self.now += 0.01
        for d in self.s.update(out, result, self.now):
            self.deltas.setdefault(d.request_id, []).append(d)
        self.s.check_integrity()
        return out

    def run(self, max_steps: int = 2000) -> list[SchedulerOutput]:
        outs = []
        while self.s.has_unfinished_requests():
            outs.append(self.step())
            assert len(outs) < max_steps
        return outs

    def tokens(self, req: Request) -> list[int]:
        return [t for d in self.deltas[req.request_id] for t in d.new_token_ids]

    def final(self, req: Request) -> RequestDelta:
        last = self.deltas[req.request_id][-1]
        assert last.finished
        return last


def harness(*, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 1024, prefix: bool = True, **opts) -> Harness:
    cache = CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix)
    kv = KVCacheManager(num_blocks, block_size, prefix)
    ex = FakeExecutor()
    ex.initialize_kv_cache(num_blocks, block_size)
    return Harness(Scheduler(SchedulerConfig(**opts), cache, kv, max_model_len), ex)


def chunks(outs: list[SchedulerOutput], req: Request) -> list[int]:
    return [sr.num_tokens for o in outs for sr in o.scheduled if sr.request_id == req.request_id]


# ----------------------------------------------------------------------------- budgets and chunks
def test_budgets_are_never_exceeded() -> None:
    h = harness(num_blocks=256, max_num_batched_tokens=32, max_num_seqs=3)
    for i in range(8):
        h.add(make_request(prompt_len=5 + 7 * i, max_tokens=6))
    outs = h.run()
    assert any(o.num_batched_tokens == 32 for o in outs)  # the budget was actually the limit
    for o in outs:
        assert o.num_batched_tokens <= 32
        assert len(o.scheduled) <= 3
        assert sum(sr.num_tokens for sr in o.scheduled) == o.num_batched_tokens
        assert o.num_prefill_tokens + o.num_decode_tokens == o.num_batched_tokens


def test_long_prompt_is_chunked_by_the_budget() -> None:
    h = harness(num_blocks=64, max_num_batched_tokens=16)
    r = h.add(make_request(prompt_len=50, max_tokens=2))
    outs = h.run()
    assert chunks(outs, r) == [16, 16, 16, 2, 1]
    samples = [sr.sample for o in outs for sr in o.scheduled]
    assert samples == [False, False, False, True, True]
    assert h.tokens(r) == generate_alone(r.prompt_token_ids, 2)


def test_long_prefill_threshold_caps_a_chunk_and_shares_the_budget() -> None:
    h = harness(max_num_batched_tokens=16, long_prefill_token_threshold=6, max_num_partial_prefills=2)
    a = h.add(make_request(prompt_len=20, max_tokens=1))
    b = h.add(make_request(prompt_len=20, max_tokens=1))
    out = h.step()
    assert [(sr.request_id, sr.num_tokens) for sr in out.scheduled] == [(a.request_id, 6), (b.request_id, 6)]


def test_partial_prefill_cap_holds_back_a_second_long_prompt() -> None:
    h = harness(max_num_batched_tokens=16, max_num_partial_prefills=1)
    a = h.add(make_request(prompt_len=30, max_tokens=1))
    b = h.add(make_request(prompt_len=30, max_tokens=1))
    c = h.add(make_request(prompt_len=3, max_tokens=1))
    first = h.step()
    assert [sr.request_id for sr in first.scheduled] == [a.request_id]  # b would be a 2nd partial: waits
    second = h.step()
    ids = [sr.request_id for sr in second.scheduled]
    assert ids[0] == a.request_id and b.request_id in ids  # a completes, b may start
    h.run()
    assert h.final(c).finish_reason == FinishReason.LENGTH


def test_without_chunking_a_prompt_that_does_not_fit_waits() -> None:
    h = harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a = h.add(make_request(prompt_len=10, max_tokens=3))
    b = h.add(make_request(prompt_len=10, max_tokens=3))
    out1, out2 = h.step(), h.step()
    assert [(sr.request_id, sr.num_tokens) for sr in out1.scheduled] == [(a.request_id, 10)]
    assert [(sr.request_id, sr.num_tokens) for sr in out2.scheduled] == [(a.request_id, 1), (b.request_id, 10)]
    with pytest.raises(AdmissionError) as e:
        h.add(make_request(prompt_len=17, max_tokens=1))
    assert e.value.kind == ErrorKind.INVALID_REQUEST and "17" in e.value.message


def test_scheduled_request_fields() -> None:
    h = harness(block_size=4)
    plain = h.add(make_request(prompt_len=6, max_tokens=3, eos_token_ids=frozenset({999})))
    pen = h.add(make_request(prompt_len=5, params=SamplingParams(max_tokens=3, repetition_penalty=1.2)))
    out1 = h.step()
    sr = {s.request_id: s for s in out1.scheduled}
    p = sr[plain.request_id]
    assert p.token_ids == tuple(plain.prompt_token_ids) and p.start_pos == 0 and p.sample
    assert len(p.block_table) == 2 and p.history is None and p.eos_token_ids == frozenset({999})
    assert sr[pen.request_id].history == tuple(pen.prompt_token_ids)
    out2 = h.step()
    d = {s.request_id: s for s in out2.scheduled}[plain.request_id]
    assert d.token_ids == (plain.output_token_ids[0],) and d.start_pos == 6 and d.num_output_tokens == 1
    assert d.sample
    hist = {s.request_id: s for s in out2.scheduled}[pen.request_id].history
    assert hist == tuple(pen.prompt_token_ids) + (pen.output_token_ids[0],)


# ----------------------------------------------------------------------------- admission control
def test_too_long_requests_are_refused_with_the_lengths() -> None:
    h = harness(num_blocks=8, block_size=4, max_model_len=100)
    with pytest.raises(AdmissionError) as e:
        h.add(make_request(prompt_len=90, max_tokens=20))
    assert e.value.kind == ErrorKind.INVALID_REQUEST
    assert "90" in e.value.message and "20" in e.value.message and "100" in e.value.message
    with pytest.raises(AdmissionError) as e:
        h.add(make_request(prompt_len=30, max_tokens=3))  # 33 > 8 blocks * 4 tokens
    assert e.value.kind == ErrorKind.INVALID_REQUEST and "32" in e.value.message
    assert h.s.last_iteration_stats.rejections == {}  # counted into the next step
    h.step()
    assert h.s.last_iteration_stats.rejections == {"invalid_request": 2}


def test_queue_bounds_refuse_with_retry_after() -> None:
    h = harness(max_queue_len=2, max_num_seqs=1)
    h.add(make_request())
    h.add(make_request())
    with pytest.raises(AdmissionError) as e:
        h.add(make_request())
    assert e.value.kind == ErrorKind.QUEUE_FULL and e.value.retry_after >= 1.0
    h2 = harness(max_queued_tokens=20)
    h2.add(make_request(prompt_len=15))
    with pytest.raises(AdmissionError) as e:
        h2.add(make_request(prompt_len=6))
    assert e.value.kind == ErrorKind.QUEUE_FULL and e.value.retry_after >= 1.0
    h2.add(make_request(prompt_len=5))  # exactly at the bound is fine


def test_retry_after_follows_the_drain_rate() -> None:
    h = harness(max_queue_len=1, max_num_seqs=1)
    for _ in range(4):  # one request finishing every ~5 s
        r = h.add(make_request(max_tokens=1))
        h.run()
        h.now += 5.0
    assert h.final(r).finished
    h.add(make_request(max_tokens=1))
    with pytest.raises(AdmissionError) as e:
        h.add(make_request())
    assert 5.0 <= e.value.retry_after <= 6.0


def test_duplicate_ids_and_past_deadlines_are_refused() -> None:
    h = harness()
    h.add(make_request(rid="x"))
    with pytest.raises(AdmissionError) as e:
        h.add(make_request(rid="x"))
    assert e.value.kind == ErrorKind.INVALID_REQUEST
    with pytest.raises(AdmissionError) as e:
        h.add(make_request(deadline=h.now - 1))
    assert e.value.kind == ErrorKind.DEADLINE


# ----------------------------------------------------------------------------- stopping
def test_stop_on_eos_after_min_tokens_and_on_stop_token_ids() -> None:
    h = harness()
    eos = frozenset({7})
    early = h.add(make_request(rid="early", params=SamplingParams(max_tokens=10), eos_token_ids=eos))
    mint = h.add(make_request(rid="mint", params=SamplingParams(max_tokens=10, min_tokens=3), eos_token_ids=eos))
    ign = h.add(make_request(rid="ign", params=SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=eos))
    stop = h.add(make_request(rid="stop", params=SamplingParams(max_tokens=10, stop_token_ids=[42])))
    h.ex.script = {"early": [1, 7, 2], "mint": [7, 7, 7, 3], "ign": [7, 7, 7, 7, 7], "stop": [1, 42]}
    h.run()
    assert h.tokens(early) == [1, 7] and h.final(early).finish_reason == FinishReason.STOP
    assert h.final(early).stop_reason is None
    assert h.tokens(mint) == [7, 7, 7] and h.final(mint).finish_reason == FinishReason.STOP
    assert h.tokens(ign) == [7, 7, 7, 7] and h.final(ign).finish_reason == FinishReason.LENGTH
    assert h.tokens(stop) == [1, 42] and h.final(stop).stop_reason == 42


def test_max_model_len_stops_generation() -> None:
    h = harness(max_model_len=100)
    r = h.add(make_request(prompt_len=10, max_tokens=50))
    h.s.results.max_model_len = 13  # the stop check behind admission (StepResults): exercise it directly
    h.run()
    assert h.tokens(r) == r.output_token_ids and len(r.output_token_ids) == 3
    assert h.final(r).finish_reason == FinishReason.LENGTH


def test_timings_and_metrics_on_the_final_delta() -> None:
    h = harness()
    r = h.add(make_request(prompt_len=4, max_tokens=3))
    h.run()
    m = h.final(r).metrics
    assert m is not None
    assert m.arrival_time <= m.first_scheduled_time < m.first_token_time < m.finished_time
    assert h.final(r).num_prompt_tokens == 4
    assert all(d.metrics is None for d in h.deltas[r.request_id][:-1])
    assert sum(len(d.new_token_ids) for d in h.deltas[r.request_id]) == 3


# ----------------------------------------------------------------------------- preemption
def test_preemption_by_recompute_keeps_outputs_identical() -> None:
    h = harness(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    reqs = [h.add(make_request(prompt_len=8, max_tokens=14)) for _ in range(3)]
    outs = h.run()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert any(o.preempted_ids for o in outs)
    for r in reqs:
        assert h.tokens(r) == generate_alone(r.prompt_token_ids, 14)
    assert h.ex.violations == []


def test_victim_is_the_latest_arrival_and_returns_to_the_head() -> None:
    h = harness(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a = h.add(make_request(prompt_len=7, max_tokens=8, arrival_time=1.0))
    b = h.add(make_request(prompt_len=7, max_tokens=8, arrival_time=2.0))
    h.step()
    later = h.add(make_request(prompt_len=9, max_tokens=1, arrival_time=3.0))  # 3 blocks: never fits beside a, b
    while not b.num_preemptions:
        h.step()
    assert a.num_preemptions == 0 and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert h.s.waiting.peek() is b  # ahead of `later`, which came before its preemption
    assert later in h.s.waiting
    h.run()
    assert h.tokens(b) == generate_alone(b.prompt_token_ids, 8)


# ----------------------------------------------------------------------------- ending from outside
def test_abort_waiting_and_running_frees_blocks() -> None:
    h = harness(max_num_seqs=1)
    run = h.add(make_request(prompt_len=8, max_tokens=20))
    wait = h.add(make_request(prompt_len=8, max_tokens=20))
    h.step()
    assert run.status == RequestStatus.RUNNING and h.s.kv.usage > 0
    deltas = h.s.abort([run.request_id, wait.request_id, "unknown"], h.now)
    assert [d.finish_reason for d in deltas] == [FinishReason.ABORT, FinishReason.ABORT]
    assert h.s.kv.usage == 0 and not h.s.has_unfinished_requests()
    assert h.s.abort([run.request_id], h.now) == []  # ends exactly once
    h.s.check_integrity()
    h.add(make_request(prompt_len=2, max_tokens=1))
    out = h.step()
    assert set(out.finished_ids) == {run.request_id, wait.request_id}


def test_finish_requests_for_a_stop_string() -> None:
    h = harness()
    r = h.add(make_request(max_tokens=10))
    h.step()
    (d,) = h.s.finish_requests([r.request_id], RequestStatus.FINISHED_STOPPED, h.now, stop_reason="END")
    assert d.finish_reason == FinishReason.STOP and d.stop_reason == "END" and d.metrics is not None
    assert h.s.kv.usage == 0
    with pytest.raises(ValueError):
        h.s.finish_requests([r.request_id], RequestStatus.RUNNING, h.now)


def test_deadline_expiry_finishes_waiting_and_running_and_frees_blocks() -> None:
    h = harness(max_num_seqs=1)
    run = h.add(make_request(prompt_len=8, max_tokens=100, deadline=h.now + 0.05))
    wait = h.add(make_request(prompt_len=8, max_tokens=100, deadline=h.now + 0.03))
    other = h.add(make_request(prompt_len=8, max_tokens=2))
    h.run()
    for r in (run, wait):
        assert h.final(r).finish_reason == FinishReason.DEADLINE
        assert "deadline" in (h.final(r).error or "")
        assert r.status == RequestStatus.FINISHED_DEADLINE
    assert 0 < len(run.output_token_ids) < 100 and wait.output_token_ids == []
    assert h.final(other).finish_reason == FinishReason.LENGTH
    assert h.s.kv.usage == 0


# ----------------------------------------------------------------------------- admission shape
def test_tenant_cap_skips_over_cap_tenants_without_refusing() -> None:
    h = harness(tenant_max_running=1, max_num_seqs=4)
    flood = [h.add(make_request(max_tokens=3, tenant="a")) for _ in range(3)]
    b = h.add(make_request(max_tokens=3, tenant="b"))
    outs = h.run()
    running_a = [sum(1 for sr in o.scheduled if sr.request_id in {r.request_id for r in flood}) for o in outs]
    assert max(running_a) == 1
    assert outs[0].scheduled[-1].request_id == b.request_id  # b admitted past a's queued requests
    assert all(h.final(r).finish_reason == FinishReason.LENGTH for r in [*flood, b])


def test_static_mode_holds_the_batch_until_every_member_finishes() -> None:
    h = harness(scheduler="static", max_num_seqs=4, max_num_batched_tokens=12)
    short = h.add(make_request(prompt_len=5, max_tokens=2))
    long = h.add(make_request(prompt_len=5, max_tokens=6))
    third = h.add(make_request(prompt_len=5, max_tokens=1))  # beyond the budget: admitted, fed later
    h.step()
    assert {r.status for r in (short, long, third)} == {RequestStatus.RUNNING}
    late = h.add(make_request(prompt_len=5, max_tokens=1))
    while long.status == RequestStatus.RUNNING:
        assert late.status == RequestStatus.WAITING
        h.step()
    assert short.is_finished and third.is_finished
    h.step()
    assert late.status != RequestStatus.WAITING


def test_prefix_hit_on_admission_sets_cached_tokens() -> None:
    h = harness(block_size=4)
    prompt = list(range(1, 14))
    first = h.add(make_request(prompt=prompt, max_tokens=2))
    h.run()
    second = h.add(make_request(prompt=prompt, max_tokens=2))
    out = h.step()
    assert out.scheduled[0].start_pos == 12 and out.scheduled[0].num_tokens == 1
    h.run()
    assert second.num_cached_tokens == 12 and first.num_cached_tokens == 0
    assert h.final(second).num_cached_tokens == 12
    assert h.tokens(second) == h.tokens(first)
    assert h.ex.violations == []


# ----------------------------------------------------------------------------- why a request waits
def reason(h: Harness, req: Request) -> tuple[WaitReason, str | None]:
    info = h.s.wait_info(req.request_id)
    assert info is not None, f"{req.request_id} is not waiting"
    return info.reason, info.behind


def test_wait_reason_token_budget() -> None:
    h = harness(max_num_batched_tokens=16)
    h.add(make_request(prompt_len=40))
    b = h.add(make_request(prompt_len=8))
    h.step()
    assert reason(h, b) == (WaitReason.TOKEN_BUDGET, None)


def test_wait_reason_token_budget_unchunked() -> None:
    h = harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    h.add(make_request(prompt_len=12))
    b = h.add(make_request(prompt_len=8))  # needs 8, 4 left: waits for a step with room
    h.step()
    assert reason(h, b) == (WaitReason.TOKEN_BUDGET, None)


def test_wait_reason_sequence_cap_and_behind() -> None:
    h = harness(max_num_seqs=1)
    h.add(make_request())
    b, c = h.add(make_request()), h.add(make_request())
    h.step()
    assert reason(h, b) == (WaitReason.MAX_NUM_SEQS, None)
    assert reason(h, c) == (WaitReason.BEHIND, b.request_id)
    assert h.s.wait_stop is not None and h.s.wait_stop.request_id == b.request_id


def test_wait_reason_kv_blocks() -> None:
    h = harness(num_blocks=8, block_size=4)
    h.add(make_request(prompt_len=24, max_tokens=4))  # 6 of the 8 blocks
    b = h.add(make_request(prompt_len=12, max_tokens=4))  # needs 3
    h.step()
    assert reason(h, b) == (WaitReason.KV_BLOCKS, None)


def test_wait_reason_tenant_quota() -> None:
    h = harness(max_num_seqs=2, tenant_max_running=1)
    h.add(make_request(tenant="a"))
    a2 = h.add(make_request(tenant="a"))
    h.add(make_request(tenant="b"))
    c = h.add(make_request(tenant="c"))
    h.step()
    assert reason(h, a2) == (WaitReason.TENANT_QUOTA, None)  # skipped, though ahead of c
    assert reason(h, c) == (WaitReason.MAX_NUM_SEQS, None)


def test_wait_reason_tenant_quota_only() -> None:
    h = harness(tenant_max_running=1)
    h.add(make_request(tenant="a"))
    a2 = h.add(make_request(tenant="a"))
    h.step()
    assert reason(h, a2) == (WaitReason.TENANT_QUOTA, None)
    assert h.s.wait_stop is not None and h.s.wait_stop.reason is WaitReason.TENANT_QUOTA


def test_wait_reason_behind_higher_priority() -> None:
    h = harness(max_num_seqs=1, policy="priority")
    h.add(make_request(priority=0))
    low = h.add(make_request(priority=5))
    high = h.add(make_request(priority=1))  # arrives later, ranks first
    h.step()
    assert reason(h, high) == (WaitReason.MAX_NUM_SEQS, None)
    assert reason(h, low) == (WaitReason.BEHIND, high.request_id)


def test_wait_reason_behind_earlier_deadline() -> None:
    h = harness(max_num_seqs=1, policy="deadline")
    h.add(make_request(max_tokens=20, deadline=h.now + 1.0))
    late = h.add(make_request(deadline=h.now + 50.0))
    soon = h.add(make_request(deadline=h.now + 5.0))
    h.step()
    assert reason(h, soon) == (WaitReason.MAX_NUM_SEQS, None)
    assert reason(h, late) == (WaitReason.BEHIND, soon.request_id)


def test_wait_reason_partial_prefill_cap() -> None:
    h = harness(max_num_batched_tokens=64, long_prefill_token_threshold=8, max_num_partial_prefills=1)
    h.add(make_request(prompt_len=40))
    b = h.add(make_request(prompt_len=40))  # budget left, but it would be a second partial prefill
    h.step()
    assert reason(h, b) == (WaitReason.PARTIAL_PREFILL_CAP, None)


def test_wait_reason_static_batch() -> None:
    h = harness(scheduler="static", max_num_seqs=1)
    h.add(make_request(max_tokens=8))
    b = h.add(make_request())
    h.step()
    h.step()  # the batch is running: nothing is considered
    assert reason(h, b) == (WaitReason.STATIC_BATCH, None)


def test_wait_reason_not_reached_until_a_step() -> None:
    h = harness(max_num_seqs=1)
    h.add(make_request(max_tokens=8))
    h.step()
    b = h.add(make_request())
    assert reason(h, b) == (WaitReason.NOT_REACHED, None)
    h.step()
    assert reason(h, b) == (WaitReason.MAX_NUM_SEQS, None)


def test_wait_reason_of_a_preempted_request() -> None:
    h = harness(num_blocks=8, block_size=4)
    h.add(make_request(prompt_len=12, max_tokens=20))
    b = h.add(make_request(prompt_len=12, max_tokens=20))
    for _ in range(40):
        h.step()
        if b.status is RequestStatus.PREEMPTED:
            break
    assert b.status is RequestStatus.PREEMPTED
    assert reason(h, b) == (WaitReason.KV_BLOCKS, None)  # its blocks are gone: it waits for new ones


def test_wait_reason_none_for_running_and_unknown() -> None:
    h = harness()
    a = h.add(make_request(max_tokens=8))
    h.step()
    assert h.s.wait_info(a.request_id) is None
    assert h.s.wait_info("nope") is None
    assert h.s.wait_stop is None  # nothing waits


def test_snapshot_states_and_queue_positions() -> None:
    h = harness(num_blocks=8, block_size=4, max_num_batched_tokens=8, policy="priority")
    a = h.add(make_request(prompt_len=12, max_tokens=20, priority=0))
    low = h.add(make_request(prompt_len=12, max_tokens=20, priority=5))
    high = h.add(make_request(prompt_len=12, max_tokens=20, priority=1))
    assert [h.s.snapshot(r.request_id).queue_position for r in (a, low, high)] == [0, 2, 1]  # type: ignore[union-attr]
    h.step()  # a takes the whole budget: 8 of its 12 prompt tokens
    snap = h.s.snapshot(a.request_id)
    assert snap is not None and snap.state == "prefilling" and snap.queue_position is None and snap.wait is None
    assert snap.num_computed_prompt_tokens == 8 and snap.num_output_tokens == 0
    assert h.s.snapshot(high.request_id).queue_position == 0  # type: ignore[union-attr]
    h.step()
    assert h.s.snapshot(a.request_id).state == "decoding"  # type: ignore[union-attr]
    assert h.s.force_preempt(a.request_id)
    snap = h.s.snapshot(a.request_id)
    assert snap is not None and snap.state == "preempted" and snap.num_preemptions == 1 and snap.queue_position == 0
    assert snap.num_computed_prompt_tokens == 0 and snap.num_output_tokens == 1
    assert h.s.snapshot("nope") is None


def test_fair_share_positions_count_within_the_tenant() -> None:
    h = harness(policy="fair", max_num_seqs=1)
    h.add(make_request(tenant="a", max_tokens=8))
    a2, b1, a3 = h.add(make_request(tenant="a")), h.add(make_request(tenant="b")), h.add(make_request(tenant="a"))
    assert [h.s.snapshot(r.request_id).queue_position for r in (a2, b1, a3)] == [1, 0, 2]  # type: ignore[union-attr]
