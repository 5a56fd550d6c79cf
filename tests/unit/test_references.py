"""Each speed-inlined copy in the scheduler equals its plain reference version, over generated inputs.

- `records.scheduled_request` / `token_delta` (the instance dict filled directly) against
  `scheduled_request_reference` / `token_delta_reference` (the dataclass constructors);
- `plan.split_rows` (rows told apart by `type() is`, columns mapped in C) against
  `split_rows_reference` (`isinstance`, row by row);
- `Scheduler._schedule_running` (`StepPlan.add_running` inlined, the chunk arithmetic and the
  block allocation skipped for a decode that fits) against a scheduler whose running loop is
  written plainly around `StepPlan.add_running`: every step's output and deltas are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses

from fakes import FakeExecutor, make_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.boundary import RequestDelta, ScheduledRequest
from cadence.errors import AdmissionError
from cadence.request import Request, RequestStatus, SamplingParams
from cadence.sched.plan import StepPlan, split_rows, split_rows_reference
from cadence.sched.records import (
    scheduled_request,
    scheduled_request_reference,
    token_delta,
    token_delta_reference,
)
from cadence.sched.scheduler import Scheduler

FAST = settings(max_examples=150, deadline=None)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """A request part way through: some outputs, some tokens computed, maybe penalties or logprobs."""
    prompt = draw(st.lists(st.integers(0, 500), min_size=1, max_size=24))
    params = SamplingParams(max_tokens=64, repetition_penalty=draw(st.sampled_from((1.0, 1.2))),
                            logprobs=draw(st.sampled_from((None, 2))))
    req = Request(draw(st.text("abc", min_size=1, max_size=3)), prompt, params,
                  eos_token_ids=frozenset(draw(st.sets(st.integers(0, 9), max_size=2))))
    req.output_token_ids.extend(draw(st.lists(st.integers(0, 500), max_size=10)))
    req.num_computed_tokens = draw(st.integers(0, req.num_tokens - 1))
    req.num_cached_tokens = draw(st.integers(0, len(prompt)))
    return req


@FAST
@given(requests(), st.data(), st.lists(st.integers(0, 99), max_size=6).map(tuple))
def test_scheduled_request_equals_its_reference(req: Request, data: st.DataObject, table: tuple[int, ...]) -> None:
    n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
    built, ref = scheduled_request(req, n, table), scheduled_request_reference(req, n, table)
    assert built == ref and type(built) is ScheduledRequest and repr(built) == repr(ref)
    assert vars(built) == vars(ref)  # every field, none extra, in the same order
    assert list(vars(built)) == [f.name for f in dataclasses.fields(ScheduledRequest)]


@FAST
@given(requests(), st.integers(0, 500))
def test_token_delta_equals_its_reference(req: Request, token: int) -> None:
    built, ref = token_delta(req, token, ()), token_delta_reference(req, token, ())
    assert built == ref and type(built) is RequestDelta and list(vars(built)) == list(vars(ref))


@FAST
@given(st.lists(st.tuples(requests(), st.booleans()), max_size=8), st.data())
def test_split_rows_equals_its_reference(rows: list[tuple[Request, bool]], data: st.DataObject) -> None:
    plan: dict[str, ScheduledRequest | Request] = {}
    tables: dict[str, tuple[int, ...]] = {}
    for i, (req, decode) in enumerate(rows):
        req.request_id = f"r{i}"
        tables[req.request_id] = tuple(data.draw(st.lists(st.integers(0, 99), max_size=4)))
        if decode and req.output_token_ids:
            plan[req.request_id] = req
        else:
            plan[req.request_id] = scheduled_request(req, 1, tables[req.request_id])
    assert split_rows(plan, tables) == split_rows_reference(plan, tables)


class PlainScheduler(Scheduler):
    """The running loop written plainly: a chunk computed for every request, an allocation asked
    for every step, and the row added through `StepPlan.add_running`."""

    def _schedule_running(self, plan: StepPlan) -> None:
        for req in list(self.running):
            if plan.budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            n = self.chunk(req, req.num_computed_tokens, plan.budget)
            if n == 0:
                continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self.preemption.choose_victim(self.running)
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            plan.add_running(req, n, self.kv.block_table(req.request_id), self._batch_decodes)


OPTIONS = st.fixed_dictionaries({
    "num_kv_blocks": st.integers(8, 40),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(8, 40),
    "long_prefill_token_threshold": st.sampled_from((0, 3)),
    "policy": st.sampled_from(("fcfs", "priority", "fair")),
})
ARRIVALS = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.integers(0, 4)),
                    min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(OPTIONS, ARRIVALS, st.booleans(), st.sampled_from((None, 1.3)))
def test_the_inlined_running_loop_equals_the_plain_one(options: dict, arrivals: list, batch: bool,
                                                       penalty: float | None) -> None:
    engines = []
    for _ in range(2):
        engine, ex, _ = make_engine(executor=FakeExecutor(accepts_decode_batch=batch), **options)
        engines.append((engine, ex))
    engines[1][0].scheduler.__class__ = PlainScheduler
    for k, (prompt_len, max_tokens, priority, wait) in enumerate(arrivals):
        for engine, _ in engines:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, repetition_penalty=penalty or 1.0)
            with contextlib.suppress(AdmissionError):  # refused by both alike
                engine.add_request(Request(f"q{k}", list(range(1, prompt_len + 1)), params, priority=priority,
                                           tenant="ab"[k % 2]))
        for _ in range(wait):
            steps = [engine.step() for engine, _ in engines]
            assert steps[0] == steps[1]
    for _ in range(500):
        if not engines[0][0].has_unfinished_requests():
            break
        steps = [engine.step() for engine, _ in engines]
        assert steps[0] == steps[1] and engines[0][0].last_decoded == engines[1][0].last_decoded
    (fast, fast_ex), (plain, plain_ex) = engines
    assert not fast.has_unfinished_requests() and not plain.has_unfinished_requests()
    assert [o.rows() for o in fast_ex.outputs] == [o.rows() for o in plain_ex.outputs]
    assert [(o.num_prefill_tokens, o.preempted_ids, o.finished_ids) for o in fast_ex.outputs] == \
        [(o.num_prefill_tokens, o.preempted_ids, o.finished_ids) for o in plain_ex.outputs]
