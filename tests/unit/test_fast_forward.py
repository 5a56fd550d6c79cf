"""The simulator's fast-forward over decode stretches gives exactly what single steps give.

Two levels. The engine: a random stream of requests through two engine cores on the simulator's
executor, one stepping alone, the other applying planned stretches (a random leading part of each,
as an early arrival cuts them), compared after every move on everything a step changes: requests,
block tables, the pool's free queue and hash index, fair-share counters, clock, costs. The
simulator: whole runs with `fast_forward` on and off, compared record by record (every token
time) and replica by replica, over workloads and options that reach every bound of a stretch.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter

import pytest
from fakes import FakeExecutor

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.clock import VirtualClock
from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.errors import AdmissionError
from cadence.executor.cost_model import _FEW_STEPS, DecodeRun, SimExecutor, StepCostModel
from cadence.request import Request, SamplingParams
from cadence.sched.queue import FairQueue, FCFSQueue
from cadence.sim import fast_forward
from cadence.sim.bulk_steps import account_decodes, peek_is_stable
from cadence.sim.fast_forward import FastForward, blocks_allocated, first_allocations, steps_within
from cadence.sim.simulator import SimOptions, SimResult, Simulator
from cadence.workload import Workload, WorkloadRequest, assign_arrivals, builtin_workload

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}
# Every feature priced, so a step's cost depends on its whole shape; the context term crosses the
# first hinge (16k keys) in the bigger batches.
MODEL = StepCostModel("padded+knee16k", {"const": 0.004, "prefill_tokens": 2e-5, "decode_seqs": 3e-4,
                                         "sampled": 1e-4, "decode_padded": 1e-7, "decode_over_16k": 3e-7,
                                         "prefill_attention": 1e-9}, META)

# Decode keys in blocks an earlier row of the step read priced apart (prompts sharing a prefix).
SHARED_MODEL = StepCostModel("padded+context+shared", {
    "const": 0.004, "prefill_tokens": 2e-5, "prefill_seqs": 1e-4, "decode_seqs": 3e-4, "sampled": 1e-4,
    "decode_context_own": 3e-6, "decode_context_shared": 1e-6, "decode_padded": 1e-7, "prefill_attention": 1e-9}, META)


# ----------------------------------------------------------------------------- the engine
def _engine(model: StepCostModel = MODEL, **options) -> EngineCore:
    clock = VirtualClock()
    config = EngineConfig.from_options(**options)
    return EngineCore(config, SimExecutor(model, clock=clock), clock=clock, max_model_len=256, decode_ids=True)


_FAST_FORWARDS: dict[int, FastForward] = {}


def _ff(engine: EngineCore) -> FastForward:
    """The one fast-forward of `engine` (it remembers the stretch it planned last)."""
    ff = _FAST_FORWARDS.get(id(engine))
    if ff is None or ff.core is not engine:
        ff = FastForward.of(engine)
        assert ff is not None
        _FAST_FORWARDS[id(engine)] = ff
    return ff


def _state(engine: EngineCore) -> tuple:
    """Everything a step can change, as plain values."""
    sched, kv = engine.scheduler, engine.kv
    pool = kv.pool
    reqs = [(r.request_id, r.status, r.num_computed_tokens, tuple(r.output_token_ids), r.last_token_time,
             r.first_token_time, r.first_scheduled_time, r.finished_time, r.num_preemptions)
            for r in sorted(sched.requests.values(), key=lambda r: r.request_id)]
    counters = dict(sched.waiting.counters) if isinstance(sched.waiting, FairQueue) else None
    ex = engine.executor
    return (sched._step, sched._num_live_tokens, [r.request_id for r in sched.running], reqs,
            list(sched._finished_ids), list(sched._preempted_ids),  # what the next step's output carries
            [r.request_id for r in sched.waiting], counters, dict(kv._table_ids), dict(kv._num_cached),
            # (Of running requests only: a waiting one's hash memo is a cache that planning may fill first.)
            {r.request_id: tuple(kv._hashes.get(r.request_id, ())) for r in sched.running}, pool.free_block_ids(),
            {h: b.block_id for h, b in pool._by_hash.items()}, [b.ref_cnt for b in pool.blocks],
            engine.clock.now(), ex.total_cost, ex.num_steps, ex.last_step_cost)


def _request(rng: random.Random, i: int, shared: list[int], deadlines: bool = True) -> Request:
    prompt = (shared[: rng.choice((0, 8, 16, 24))] if rng.random() < 0.5 else []) + [
        rng.randrange(1, 999) for _ in range(rng.randint(1, 40))]
    params = SamplingParams(max_tokens=rng.randint(1, 90), ignore_eos=True, temperature=0.0)
    return Request(f"r{i}", prompt, params, priority=rng.randint(0, 2), tenant=rng.choice("ab"),
                   deadline=rng.uniform(0.5, 4.0) if rng.random() < 0.2 and deadlines else None)


ENGINES = {
    "fcfs": dict(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32),
    "fcfs-tight": dict(num_kv_blocks=30, block_size=4, max_num_seqs=6, max_num_batched_tokens=24),
    # A budget a few decodes leave little of: prompts take several chunks beside them.
    "fcfs-chunked": dict(num_kv_blocks=48, block_size=4, max_num_seqs=5, max_num_batched_tokens=10),
    "priority": dict(policy="priority", num_kv_blocks=40, block_size=4, max_num_batched_tokens=24),
    "fair": dict(policy="fair", num_kv_blocks=48, block_size=4, max_num_seqs=5, tenant_weights=(("a", 3.0),)),
    "fair-capped": dict(policy="fair", tenant_max_running=2, num_kv_blocks=48, block_size=4),
    "deadline": dict(policy="deadline", num_kv_blocks=40, block_size=8, max_num_batched_tokens=16),
    "static": dict(scheduler="static", num_kv_blocks=64, block_size=4, max_num_seqs=4),
    "unchunked-noprefix": dict(enable_chunked_prefill=False, enable_prefix_caching=False, num_kv_blocks=40,
                               block_size=2, max_num_batched_tokens=48),
    # Arrivals rare enough that the queue is often empty at a prompt's last chunk: prompts join stretches.
    "fcfs-joins": dict(num_kv_blocks=60, block_size=4, max_num_seqs=5, max_num_batched_tokens=9),
}
ARRIVALS = {"fcfs-joins": 0.08}  # a request's chance of arriving before each move (default 0.15)
MOVES = {"fcfs-joins": 1000}
NO_DEADLINES = {"fcfs-joins"}  # (a pending deadline ends a stretch before a prompt's last chunk)


@pytest.mark.parametrize("name", sorted(ENGINES))
@pytest.mark.parametrize("seed", [1, 2])
def test_applied_stretches_equal_single_steps(name: str, seed: int) -> None:
    _compare_stretches_with_single_steps(name, seed, MODEL)


@pytest.mark.parametrize("name", ["fcfs", "fcfs-chunked", "fcfs-joins", "priority"])
def test_applied_stretches_price_shared_keys_as_single_steps(name: str) -> None:
    """With a model pricing shared decode keys, the stretches' costs (in `_state`: the clock and
    the executor's totals) are what single steps charge, prompts sharing a prefix among them."""
    _compare_stretches_with_single_steps(name, 3, SHARED_MODEL)


def _compare_stretches_with_single_steps(name: str, seed: int, model: StepCostModel) -> None:
    rng = random.Random(seed)
    ref, ff = _engine(model, **ENGINES[name]), _engine(model, **ENGINES[name])
    shared = [rng.randrange(1, 999) for _ in range(24)]
    applied = cut = finished = chunked = went_on = joined = 0
    for i in range(MOVES.get(name, 400)):
        if rng.random() < ARRIVALS.get(name, 0.15):
            for engine in (ref, ff):
                with contextlib.suppress(AdmissionError):  # refused by both alike
                    engine.add_request(_request(random.Random(f"{seed}:{i}"), i, shared, name not in NO_DEADLINES))
        if not ref.has_unfinished_requests():
            continue
        stretch = _ff(ff).plan(rng.choice((2, 5, 40)))
        assert _state(ff) == _state(ref)  # planning changes nothing
        if stretch is None:
            assert ff.step() == ref.step()
            assert ff.last_decoded == ref.last_decoded
        else:
            m = rng.choice((0, 1, stretch.num_steps, stretch.num_steps, rng.randint(0, stretch.num_steps)))
            deltas = [ref.step() for _ in range(m)]
            # Every step's deltas, in order: the final ones of the requests that finished (and a
            # joined request's first token).
            assert _ff(ff).apply(stretch, m) == [d for step in deltas for d in step]
            if m:
                assert ff.last_decoded == ref.last_decoded
                finished += sum(d.finish_reason is not None for step in deltas for d in step)
                # finished before the stretch's last applied step
                went_on += sum(d.finish_reason is not None for step in deltas[:-1] for d in step)
            applied += m
            cut += 0 < m < stretch.num_steps
            chunked += m if stretch.prefill is not None else 0
            joined += m > stretch.join >= 0
        assert _state(ff) == _state(ref)
        ff.scheduler.check_integrity()
    assert applied > 10 and cut and finished  # the runs are worth comparing
    # Requests finished mid-stretch and the others went on (in runs whose queue empties often
    # enough with no deadline pending; the simulations below reach it far more).
    assert went_on or (name, seed) not in {("fcfs-joins", 1), ("fcfs-joins", 2), ("static", 1), ("static", 2),
                                           ("unchunked-noprefix", 1)}
    assert chunked > 20 or name != "fcfs-chunked"  # prompt chunks rode in stretches beside decodes
    assert joined > 20 or name != "fcfs-joins"  # prompts' last chunks, and the requests decoding on after them
    assert not ref.has_unfinished_requests() or ref.scheduler._step > 100


def test_a_planned_stretch_applies_only_on_the_state_it_was_planned_on() -> None:
    engine = _engine(num_kv_blocks=64)
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    engine.step()
    ff = _ff(engine)
    stretch = ff.plan(10)
    assert stretch is not None and stretch.num_steps == 10
    engine.step()  # the core moved on
    with pytest.raises(RuntimeError, match="moved"):
        ff.apply(stretch, 1)
    stretch = ff.plan(10)
    assert stretch is not None
    engine.add_request(Request("b", [1], SamplingParams(max_tokens=2)))  # a request came in
    with pytest.raises(RuntimeError, match="moved"):
        ff.apply(stretch, 1)
    while "b" in engine.scheduler.requests:
        engine.step()
    stretch = ff.plan(10)
    assert stretch is not None
    done = engine.scheduler.requests["a"].num_output_tokens
    ff.apply(stretch, 3)
    with pytest.raises(RuntimeError, match="planned"):
        ff.apply(stretch, 1)
    assert engine.scheduler.requests["a"].num_output_tokens == done + 3
    stretch = ff.plan(10)
    assert stretch is not None
    engine.abort_requests(["a"])  # a request ended from outside
    with pytest.raises(RuntimeError, match="moved"):
        ff.apply(stretch, 1)


def test_only_an_executor_costing_decode_runs_on_the_core_clock_fast_forwards() -> None:
    """The simulator's executor is checked once, by its protocol; one on another clock, a plain
    executor, or a core that reports plain decodes as deltas, gets no fast-forward."""
    assert _ff(_engine()) is not None
    other = EngineCore(EngineConfig.from_options(), SimExecutor(MODEL, clock=VirtualClock()), clock=VirtualClock(),
                       max_model_len=256, decode_ids=True)
    assert FastForward.of(other) is None
    clock = VirtualClock()
    deltas = EngineCore(EngineConfig.from_options(), SimExecutor(MODEL, clock=clock), clock=clock, max_model_len=256)
    assert FastForward.of(deltas) is None
    plain = EngineCore(EngineConfig.from_options(num_kv_blocks=8), FakeExecutor(), max_model_len=64)
    assert FastForward.of(plain) is None


def test_no_stretch_where_a_step_would_differ() -> None:
    """The planner's bounds: the finishing step (the last), a stop token, a deadline, logprobs."""
    engine = _engine(num_kv_blocks=64)
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.step()  # the first token: 5 to go, the last of which finishes
    stretch = _ff(engine).plan(100)
    assert stretch is not None and stretch.num_steps == 5 and list(stretch.finish_groups()) == [4]
    (done,) = _ff(engine).apply(stretch, 5)
    assert done.finish_reason == "length" and done.new_token_ids == (engine.executor.token_id,)
    assert not engine.has_unfinished_requests() and engine.last_decoded == []
    tok = engine.executor.token_id
    for params in (SamplingParams(max_tokens=9, stop_token_ids=(tok,)), SamplingParams(max_tokens=9, logprobs=1)):
        other = _engine(num_kv_blocks=64)
        other.add_request(Request("b", [1, 2, 3], params))
        other.step()
        assert _ff(other).plan(100) is None
    # With nothing waiting, a stretch runs past the first finish with the requests left; with a
    # request waiting, it ends there (the freed seat and blocks may admit it).
    for waiting in (False, True):
        two = _engine(num_kv_blocks=64, max_num_seqs=2)
        for rid, n in (("d", 4), ("e", 9)):
            two.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True)))
        two.step()
        if waiting:
            two.add_request(Request("f", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
        stretch = _ff(two).plan(100)
        assert stretch is not None and stretch.last_steps == (2, 7)
        assert (stretch.num_steps, list(stretch.finish_groups())) == ((3, [2]) if waiting else (8, [2, 7]))
        assert len(stretch.runs) == 1 + (not waiting) and [r.num_seqs for r in stretch.runs] == [2, 1][: len(stretch.runs)]
        deltas = _ff(two).apply(stretch, stretch.num_steps)
        assert [d.request_id for d in deltas] == (["d"] if waiting else ["d", "e"])
    late = _engine(num_kv_blocks=64)
    late.add_request(Request("c", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), deadline=0.05))
    late.step()
    stretch = _ff(late).plan(100)
    assert stretch is not None and stretch.step_ends[-2] < 0.05 <= stretch.step_ends[-1]


def test_a_prompt_joins_a_stretch_with_its_last_chunk() -> None:
    """With nothing waiting, a prompt's last chunk is a step of the stretch (it samples the first
    token) and the request decodes on in the later steps, as stepping would; a request waiting, a
    stop token or a last chunk of one token ends the stretch before that chunk instead."""
    tok = _engine().executor.token_id

    def engine(prompt_len: int = 14, waiting: bool = False, **params) -> EngineCore:
        e = _engine(num_kv_blocks=64, block_size=4, max_num_batched_tokens=10)
        e.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
        e.step()  # a's first token
        e.add_request(Request("b", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=6, ignore_eos=True, **params)))
        e.step()  # b's first chunk: the 9 tokens a's decode leaves of the budget
        if waiting:
            e.add_request(Request("c", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True)))
        return e

    ref, ff = engine(), engine()
    stretch = _ff(ff).plan(100)
    assert stretch is not None and (stretch.join, stretch.join_chunk, stretch.num_steps) == (0, 5, 28)
    assert [r.request_id for r in stretch.requests] == ["a", "b"] and stretch.last_steps == (27, 5)
    # b's first decode, at position 14 (one past its prompt), in step 1: its start is 13.
    assert stretch.starts == (4, 13)
    assert [(r.num_seqs, r.start_sum, r.start_max, r.num_steps, r.chunk, r.chunk_start, r.sampled) for r in stretch.runs] \
        == [(1, 4, 4, 1, 5, 9, 1), (2, 19, 14, 5, 0, 0, 0), (1, 10, 10, 22, 0, 0, 0)]
    steps = [ref.step() for _ in range(28)]
    deltas = _ff(ff).apply(stretch, 28)
    assert deltas == [d for step in steps for d in step]
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("b", None), ("b", "length"), ("a", "length")]
    assert _state(ff) == _state(ref) and stretch.requests[1].first_token_time == stretch.step_ends[0]
    for prompt_len, waiting, params in ((14, True, {}), (14, False, {"stop_token_ids": (tok,)}), (10, False, {})):
        assert _ff(engine(prompt_len, waiting, **params)).plan(100) is None


@pytest.mark.parametrize("max_tokens", [6, 1])  # (1: it finishes in its join step)
def test_a_joining_prompt_whose_last_block_is_cached_already(max_tokens: int, monkeypatch) -> None:
    """The block its last chunk fills has the hash of a cached-free block (the prefix lookup never
    matches a prompt's last block): the bulk path declines and the calls go one by one, chunk
    steps, join step and decodes."""
    bulk = []
    step_blocks = fast_forward.step_blocks
    monkeypatch.setattr(fast_forward, "step_blocks", lambda *a: bulk.append(step_blocks(*a)) or bulk[-1])
    prompt = list(range(101, 113))  # three blocks of 4

    def engine() -> EngineCore:
        e = _engine(num_kv_blocks=64, block_size=4, max_num_batched_tokens=3)
        e.add_request(Request("x", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        while e.has_unfinished_requests():
            e.step()  # x's blocks stay cached, free
        e.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
        e.step()
        e.add_request(Request("b", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        e.step()  # b: a hit on two blocks, then 2 of its 4 other tokens beside a's decode
        return e

    ref, ff = engine(), engine()
    stretch = _ff(ff).plan(100)
    assert stretch is not None and (stretch.join, stretch.join_chunk) == (0, 2)
    steps = [ref.step() for _ in range(stretch.num_steps)]
    assert _ff(ff).apply(stretch, stretch.num_steps) == [d for step in steps for d in step]
    assert _state(ff) == _state(ref) and bulk[-1] is False


# ----------------------------------------------------------------------------- pieces
def test_block_counts_match_stepping_by_hand() -> None:
    rng = random.Random(3)
    for _ in range(300):
        bs = rng.choice((1, 2, 4, 16))
        starts = [rng.randrange(0, 100) for _ in range(rng.randint(1, 6))]
        held = [-(-(s + rng.choice((0, 1))) // bs) + rng.choice((0, 0, 1)) for s in starts]
        steps, budget = rng.randint(1, 60), rng.randint(0, 40)
        totals, room, total = [0], [h * bs for h in held], 0  # blocks taken by the first k steps
        for j in range(steps):
            for i, s in enumerate(starts):
                if s + j + 1 > room[i]:
                    room[i] += bs
                    total += 1
            totals.append(total)
        first = first_allocations(starts, held, bs)
        assert [blocks_allocated(first, bs, k) for k in range(steps + 1)] == totals
        assert steps_within(first, bs, steps, budget) == max(k for k, t in enumerate(totals) if t <= budget)
        # Rows that leave after their last step take no more blocks.
        last = [rng.randrange(0, steps + 3) for _ in starts]
        totals, room, total = [0], [h * bs for h in held], 0
        for j in range(steps):
            for i, s in enumerate(starts):
                if j <= last[i] and s + j + 1 > room[i]:
                    room[i] += bs
                    total += 1
            totals.append(total)
        assert [blocks_allocated(first, bs, k, last) for k in range(steps + 1)] == totals
        assert steps_within(first, bs, steps, budget, None, last) == max(k for k, t in enumerate(totals) if t <= budget)


def test_decode_run_costs_are_what_execute_charges() -> None:
    """Bit for bit, past every knee, with every weight in play (randomised folded weights)."""
    rng = random.Random(4)
    widest = 0
    for _ in range(60):  # (short runs are costed step by step, longer ones with numpy)
        ex = SimExecutor(MODEL, clock=VirtualClock())
        low = rng.choice((0.0, -2e-4))  # fitted weights may be negative: zero terms then add -0.0
        ex._w = tuple(rng.uniform(low, 1e-3) for _ in ex._w)
        n = rng.randint(0, 40)
        starts = [rng.randrange(0, 4000) for _ in range(n)]
        chunk, chunk_start = rng.choice(((0, 0), (rng.randint(2, 500), rng.randrange(0, 3000))))
        if not n and not chunk:
            continue
        sampled = int(bool(chunk) and rng.random() < 0.3)  # a prompt's last chunk: one step, sampling
        steps = 1 if sampled else rng.choice((1, 3, 12, 30, 40))
        run = DecodeRun(n, sum(starts), max(starts, default=0), steps, chunk, chunk_start, sampled)
        costs = ex.decode_run_costs(run)
        for j, cost in enumerate(costs):
            decodes = tuple(ScheduledRequest(f"r{i}", (7,), s + j, (), True, SamplingParams()) for i, s in enumerate(starts))
            prompt = ScheduledRequest("p", (7,) * chunk, chunk_start + j * chunk, (), bool(sampled), SamplingParams())
            ex.execute(SchedulerOutput(step=j, scheduled=(*decodes, prompt) if chunk else decodes))
            assert ex.last_step_cost == cost
        assert len(costs) == run.num_steps
        if run.num_steps > _FEW_STEPS:  # the numpy path
            widest = max(widest, n * (max(starts, default=0) + run.num_steps))
    assert widest > 65536  # past the last knee


def test_fair_share_accounts_decodes_in_bulk_exactly() -> None:
    reqs = [Request(f"q{i}", [1], tenant=t) for i, t in enumerate("aabca")]
    bulk, single = FairQueue({"a": 3.0, "b": 0.7}), FairQueue({"a": 3.0, "b": 0.7})
    for q in (bulk, single):
        q.counters.update({"a": 0.1, "c": 1e9})
    account_decodes(bulk, reqs, 37)
    for _ in range(37):  # the definition: one account() per token
        for r in reqs:
            single.account(r, 0, 1)
    assert bulk.counters == single.counters and set(bulk.counters) == {"a", "b", "c"}


class _ServiceLog(FCFSQueue):
    """A policy the bulk forms do not know, whose order would follow service: each call logged."""

    tracks_service = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def account(self, request: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.calls.append((request.request_id, num_prompt_tokens, num_output_tokens))


def test_an_unknown_service_policy_is_accounted_call_by_call_and_never_stable() -> None:
    reqs = [Request(f"q{i}", [1]) for i in range(3)]
    log = _ServiceLog()
    account_decodes(log, reqs, 4)
    assert log.calls == [(r.request_id, 0, 1) for _ in range(4) for r in reqs]  # step by step, in order
    assert not peek_is_stable(log)


def test_the_queue_is_stable_unless_its_order_follows_service_between_tenants() -> None:
    fcfs, fair = FCFSQueue(), FairQueue()
    for i, tenant in enumerate("aab"):
        fcfs.add(Request(f"f{i}", [1], tenant=tenant))
    assert peek_is_stable(fcfs) and peek_is_stable(fair)
    fair.add(Request("a0", [1], tenant="a"))
    fair.add(Request("a1", [1], tenant="a"))
    assert fair.tenants == ("a",) and peek_is_stable(fair)  # one tenant: FCFS within it
    fair.add(Request("b0", [1], tenant="b"))
    assert fair.tenants == ("a", "b") and not peek_is_stable(fair)


# ----------------------------------------------------------------------------- the simulator
def _run(workload: Workload, fast_forward: bool, opts: dict, model: StepCostModel = MODEL,
         **engine) -> tuple[SimResult, Simulator]:
    config = EngineConfig.from_options(**{"num_kv_blocks": 2048, **engine})
    sim = Simulator(config, model, SimOptions(fast_forward=fast_forward, **opts))
    return sim.run(workload), sim


def _chat(n: int, rate: float, seed: int = 1, name: str = "chat") -> Workload:
    return assign_arrivals(builtin_workload(name, n, seed=seed), "poisson", rate, seed=seed)


SIMS = {
    "chat": (lambda: _chat(300, 6.0), {}, {}),
    "chat-preempting": (lambda: _chat(200, 20.0), {}, dict(num_kv_blocks=160, max_num_seqs=32)),
    "shared-prefix": (lambda: _chat(200, 10.0, name="shared-prefix"), {}, {}),
    "shared-prefix-tight": (lambda: _chat(200, 30.0, name="shared-prefix"), {}, dict(num_kv_blocks=300)),
    "fair-mixed-tenants": (lambda: _chat(300, 15.0, name="mixed-tenants"), {},
                           dict(policy="fair", num_kv_blocks=400, tenant_weights=(("alpha", 2.0),))),
    "priority-deadlines": (lambda: _chat(300, 25.0, name="mixed-tenants"), {}, dict(policy="priority", num_kv_blocks=300)),
    "deadline-policy": (lambda: _chat(300, 25.0, name="mixed-tenants"), {}, dict(policy="deadline", num_kv_blocks=300)),
    "round-robin": (lambda: _chat(300, 20.0), dict(replicas=3, router="round-robin"), {}),
    "least-loaded": (lambda: _chat(300, 20.0), dict(replicas=3, router="least-loaded"), dict(num_kv_blocks=300)),
    "prefix-affinity": (lambda: _chat(300, 20.0, name="shared-prefix"), dict(replicas=3, router="prefix-affinity"), {}),
    "closed-loop": (lambda: builtin_workload("chat", 200, seed=2), dict(concurrency=12, closed_loop=True, replicas=2),
                    dict(num_kv_blocks=400)),
    "open-loop-capped": (lambda: _chat(200, 40.0), dict(concurrency=10), {}),
    "static": (lambda: _chat(150, 10.0), {}, dict(scheduler="static", max_num_seqs=8)),
    "unchunked-noprefix": (lambda: _chat(200, 10.0), {}, dict(enable_chunked_prefill=False, enable_prefix_caching=False,
                                                            max_num_batched_tokens=2048)),
    # Prompts of several chunks, and often nothing waiting at their last: they join stretches.
    "chunked-joins": (lambda: _chat(200, 3.0), {}, dict(max_num_batched_tokens=48)),
    "deadlines-one-by-one": (lambda: Workload("d", tuple(
        WorkloadRequest(arrival_time=i * 0.3, prompt_tokens=30 + i, output_tokens=60 + 7 * i, deadline=0.2 + 0.05 * i)
        for i in range(40))), {}, {}),
}


@pytest.mark.parametrize("name", sorted(SIMS))
def test_simulations_match_with_and_without_fast_forward(name: str) -> None:
    make, opts, engine = SIMS[name]
    workload = make()
    single, _ = _run(workload, False, opts, **engine)
    fast, sim = _run(workload, True, opts, **engine)
    assert fast.records == single.records  # every token time, queue time, finish reason
    assert fast.replicas == single.replicas  # steps, busy time, preemptions, prefix-cache hits
    assert (fast.steps, fast.virtual_s) == (single.steps, single.virtual_s)
    assert sim.fast_forwarded_steps > fast.steps // 10  # the fast path carried a fair share


@pytest.mark.parametrize("name", ["shared-prefix", "shared-prefix-tight", "prefix-affinity", "chunked-joins"])
def test_simulations_price_shared_keys_alike_with_and_without_fast_forward(name: str) -> None:
    make, opts, engine = SIMS[name]
    workload = make()
    single, _ = _run(workload, False, opts, SHARED_MODEL, **engine)
    fast, sim = _run(workload, True, opts, SHARED_MODEL, **engine)
    assert fast.records == single.records
    assert fast.replicas == single.replicas
    assert (fast.steps, fast.virtual_s) == (single.steps, single.virtual_s)
    assert sim.fast_forwarded_steps > fast.steps // 10
    if name.startswith("shared-prefix"):  # the shared prompt's blocks were priced as shared
        own = StepCostModel("padded+context+shared", {**SHARED_MODEL.coefficients, "decode_context_shared":
                                                      SHARED_MODEL.coefficients["decode_context_own"]}, META)
        assert _run(workload, True, opts, own, **engine)[0].virtual_s > fast.virtual_s


def test_the_simulations_reach_what_they_compare() -> None:
    """Preemptions, prefix hits, deadline expiries, cut stretches, stretches going on past
    finished requests and prompts joining stretches all happen somewhere."""
    seen: Counter[str] = Counter()
    for name in ("chat-preempting", "shared-prefix", "priority-deadlines", "least-loaded", "deadlines-one-by-one",
                 "chunked-joins"):
        make, opts, engine = SIMS[name]
        res, sim = _run(make(), True, opts, **engine)
        seen["preemptions"] += sum(r.preemptions for r in res.replicas)
        seen["prefix_hits"] += sum(r.prefix_cache_hits for r in res.replicas)
        seen["deadline"] += sum(r.finish_reason == "deadline" for r in res.records)
        seen["cut"] += sim.stretches_cut
        seen["finished_mid_stretch"] += sim.finished_mid_stretch
        seen["joined"] += sim.joined_stretches
        seen["ok"] += sum(r.ok for r in res.records)
    assert all(seen[k] > 0 for k in ("preemptions", "prefix_hits", "deadline", "cut", "finished_mid_stretch", "joined",
                                     "ok")), seen


def test_a_step_hook_turns_fast_forward_off() -> None:
    seen = []
    config = EngineConfig.from_options(num_kv_blocks=512)
    sim = Simulator(config, MODEL, SimOptions(), on_step=lambda i, core, t: seen.append(t))
    res = sim.run(_chat(30, 5.0))
    assert sim.fast_forwarded_steps == 0 and len(seen) == res.steps
