"""Property tests: random interleavings of add / step / abort / finish / forced preemption.

After every step: the KV integrity check passes (the engine runs it), budgets hold, no finished
request is scheduled. At the end: no block leaks, every request ended exactly once with one
final delta, and every request that ran to its length produced exactly the tokens it would
have produced alone (the fake's tokens depend on the whole context read back from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fakes import make_engine, make_request, next_token
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cadence.boundary import RequestDelta
from cadence.engine.core import EngineCore
from cadence.errors import AdmissionError
from cadence.request import FinishReason, Request, RequestStatus

SHARED_PREFIX = list(range(500, 540))


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(context))
        context.append(out[-1])
    return out


@st.composite
def configs(draw: st.DrawFn) -> dict:
    options = draw(_options)
    # Capacity in tokens, not blocks: small enough that requests compete, large enough to admit them.
    options["num_kv_blocks"] = draw(st.integers(36, 96)) // options["block_size"]
    return options


_options = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(["fcfs", "priority", "fair", "deadline"]),
        "scheduler": st.sampled_from(["continuous", "continuous", "static"]),
        "block_size": st.sampled_from([1, 2, 4]),
        "max_num_seqs": st.integers(1, 5),
        "max_num_batched_tokens": st.integers(4, 48),
        "enable_chunked_prefill": st.booleans(),
        "long_prefill_token_threshold": st.sampled_from([0, 0, 3, 8]),
        "max_num_partial_prefills": st.integers(1, 2),
        "enable_prefix_caching": st.booleans(),
        "tenant_isolation": st.booleans(),
        "tenant_max_running": st.sampled_from([None, None, 1, 2]),
        "max_queue_len": st.sampled_from([4, 100]),
    }
)

add_op = st.tuples(
    st.just("add"),
    st.integers(1, 24),  # prompt length
    st.integers(1, 12),  # max tokens
    st.integers(0, 3),  # priority
    st.sampled_from(["a", "b", "c"]),  # tenant
    st.one_of(st.none(), st.floats(0.01, 0.6)),  # deadline, seconds from now
    st.booleans(),  # starts with a shared prefix
)
step_op = st.tuples(st.just("step"), st.integers(1, 4))
end_op = st.tuples(st.sampled_from(["abort", "finish", "preempt", "preempt"]), st.integers(0, 1000))
# Adds weigh most: interesting states need several requests competing for a small cache.
ops = st.lists(st.one_of(add_op, add_op, add_op, step_op, step_op, end_op), min_size=4, max_size=40)


@dataclass
class Tracker:
    engine: EngineCore
    requests: dict[str, Request] = field(default_factory=dict)
    finals: dict[str, RequestDelta] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    def take(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            assert d.request_id not in self.finals, f"{d.request_id}: delta after its final one"
            self.tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                self.finals[d.request_id] = d

    def step(self) -> None:
        engine = self.engine
        cfg = engine.config.scheduler
        executed = len(engine.executor.outputs)
        finished_before = set(self.finals)
        self.take(engine.step())
        for out in engine.executor.outputs[executed:]:
            assert 0 < out.num_batched_tokens <= cfg.max_num_batched_tokens
            assert len(out.scheduled) <= cfg.max_num_seqs
            assert all(sr.num_tokens >= 1 for sr in out.scheduled)
            assert sum(sr.num_tokens for sr in out.scheduled) == out.num_batched_tokens
            assert not {sr.request_id for sr in out.scheduled} & finished_before
        assert engine.scheduler.num_running <= cfg.max_num_seqs
        if cfg.tenant_max_running is not None:
            per_tenant: dict[str, int] = {}
            for r in engine.scheduler.running:
                per_tenant[r.tenant] = per_tenant.get(r.tenant, 0) + 1
            assert max(per_tenant.values(), default=0) <= cfg.tenant_max_running

    def pick(self, i: int) -> str | None:
        ids = list(self.requests)
        return ids[i % len(ids)] if ids else None


def apply(t: Tracker, op: tuple, clock_now: float) -> None:
    kind = op[0]
    if kind == "add":
        _, plen, max_tokens, priority, tenant, deadline, shared = op
        prompt = (SHARED_PREFIX[:plen] if shared else None)
        req = make_request(plen, max_tokens, prompt=prompt, priority=priority, tenant=tenant,
                           deadline=None if deadline is None else clock_now + deadline)
        try:
            t.engine.add_request(req)
        except AdmissionError:
            return
        t.requests[req.request_id] = req
    elif kind == "step":
        for _ in range(op[1]):
            t.step()
    elif (rid := t.pick(op[1])) is not None:
        if kind == "abort":
            t.take(t.engine.abort_requests([rid]))
        elif kind == "finish":
            t.take(t.engine.finish_requests([rid], stop_reason="STOP"))
        else:
            t.engine.scheduler.force_preempt(rid)
            t.engine.scheduler.check_integrity()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), script=ops)
def test_random_interleavings_keep_every_invariant(config: dict, script: list[tuple]) -> None:
    engine, ex, clock = make_engine(max_model_len=64, **config)
    t = Tracker(engine)
    for op in script:
        apply(t, op, clock.now())
    for _ in range(3000):  # drain
        if not engine.has_unfinished_requests():
            break
        t.step()
    assert not engine.has_unfinished_requests()
    # No leaks: every block is free again, and the pool agrees with itself.
    assert engine.kv.num_free_blocks == engine.num_blocks and engine.kv.usage == 0
    engine.scheduler.check_integrity()
    assert ex.violations == []
    event(f"preempted: {any(r.num_preemptions for r in t.requests.values())}")
    event(f"prefix hit: {any(r.num_cached_tokens for r in t.requests.values())}")
    event(f"reasons: {sorted({str(r.finish_reason.value) for r in t.requests.values()})}")
    # Each request ended exactly once, with one final delta matching its status.
    assert set(t.finals) == set(t.requests)
    for rid, req in t.requests.items():
        assert req.status.is_finished and t.finals[rid].finish_reason == req.finish_reason
        assert t.tokens[rid] == req.output_token_ids
        assert t.finals[rid].metrics is not None
        if req.finish_reason == FinishReason.LENGTH:
            assert req.output_token_ids == reference_tokens(req.prompt_token_ids, req.sampling_params.max_tokens)
        elif req.status == RequestStatus.FINISHED_ERROR:
            raise AssertionError(f"{rid}: {req.error}")
