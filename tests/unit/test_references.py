"""Each speed-inlined copy in the scheduler equals its plain reference version, over generated inputs.

- `records.scheduled_request` / `token_delta` (the instance dict filled directly) against
  `scheduled_request_reference` / `token_delta_reference` (the dataclass constructors);
- `Scheduler._schedule_running` (`StepPlan.add` inlined, the chunk arithmetic and the
  block allocation skipped for a decode that fits) and `StepResults.apply` (a plain decode's
  update written flat) against a scheduler whose running loop is written plainly around
  `StepPlan.add` and whose update calls `StepResults.record` for every row: every step's output
  and deltas are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses

from fakes import FakeExecutor, make_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.boundary import IterationStats, ModelOutput, RequestDelta, ScheduledRequest
from cadence.errors import AdmissionError
from cadence.request import Request, RequestStatus, SamplingParams
from cadence.sched.plan import StepPlan
from cadence.sched.records import (
    scheduled_request,
    scheduled_request_reference,
    token_delta,
    token_delta_reference,
)
from cadence.sched.results import StepResults
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


class PlainResults(StepResults):
    """Every row's update through `record` (with `decode_ids`, a plain decode's token delta then
    becomes its id)."""

    def apply(self, rows: tuple[ScheduledRequest, ...], model_output: ModelOutput, now: float,
              stats: IterationStats, deltas: list[RequestDelta], went_on: list[str] | None) -> int:
        num_computed = 0
        for sr in rows:
            req = self.requests.get(sr.request_id)
            decode = (req is not None and req.last_token_time is not None and len(sr.token_ids) == 1 and sr.sample
                      and sr.start_pos >= len(req.prompt_token_ids) and sr.sampling_params.plain_decode)
            before = len(deltas)
            num_computed += self.record(sr, model_output, now, stats, deltas)
            if went_on is not None and decode and len(deltas) == before + 1 and deltas[-1].finish_reason is None:
                went_on.append(deltas.pop().request_id)
        return num_computed


class PlainScheduler(Scheduler):
    """The running loop written plainly: a chunk computed for every request, an allocation asked
    for every step, and the row added through `StepPlan.add`; its update through `PlainResults`."""

    def _schedule_running(self, plan: StepPlan, candidates: list[Request]) -> None:
        # (`candidates` collects decodes that could verify drafts: these engines do not speculate.)
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
                self._preempt(victim, plan, "kv_blocks")
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            plan.add(req, n, self.kv.block_table(req.request_id))


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
def test_the_inlined_running_loop_equals_the_plain_one(options: dict, arrivals: list, decode_ids: bool,
                                                       penalty: float | None) -> None:
    engines = []
    for _ in range(2):
        engine, ex, _ = make_engine(executor=FakeExecutor(), decode_ids=decode_ids, **options)
        engines.append((engine, ex))
    engines[1][0].scheduler.__class__ = PlainScheduler
    engines[1][0].scheduler.results.__class__ = PlainResults
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
    assert [o.scheduled for o in fast_ex.outputs] == [o.scheduled for o in plain_ex.outputs]
    assert [(o.num_prefill_tokens, o.preempted_ids, o.finished_ids) for o in fast_ex.outputs] == \
        [(o.num_prefill_tokens, o.preempted_ids, o.finished_ids) for o in plain_ex.outputs]
