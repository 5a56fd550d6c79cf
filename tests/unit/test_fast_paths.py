"""The scheduler's per-request, per-step shortcuts give what the plain code would.

Each shortcut is checked against a reference computed the slow, obvious way: records built by
filling their dict against the dataclass constructor; block-id tables kept incrementally against
the blocks themselves; blocks published only on steps that fill one against publishing every
step; the live-token count against a sum; the skipped `account` call against the policies that
implement it. `test_decisions_match_the_recorded_fingerprints` pins every scheduling decision of
a few varied runs to what the code produced before these shortcuts existed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from array import array

import pytest
from fakes import FakeExecutor, make_engine, make_request, run_until_done

from cadence.boundary import RequestDelta, ScheduledRequest, SchedulerOutput
from cadence.errors import AdmissionError
from cadence.kv.hashing import hash_block, hash_full_blocks
from cadence.kv.manager import KVCacheManager
from cadence.request import SamplingParams
from cadence.sched import queue as queues
from cadence.sched.records import scheduled_request, scheduled_request_reference, token_delta
from cadence.sched.scheduler import Scheduler

BS = 4


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


reference_record = scheduled_request_reference  # the plain constructor, beside the fast builder


# ----------------------------------------------------------------------------- records
@pytest.mark.parametrize(
    ("computed", "n", "penalty"),
    [(0, 5, 1.0), (2, 3, 1.0), (5, 2, 1.0), (6, 1, 1.0), (7, 1, 1.3), (3, 1, 1.0), (0, 8, 1.3)],
)
def test_scheduled_request_equals_the_constructor(computed: int, n: int, penalty: float) -> None:
    # prompt 5 tokens + 3 outputs: chunks inside the prompt, across it, a decode, a recompute token
    req = make_request(prompt_len=5, params=SamplingParams(max_tokens=9, repetition_penalty=penalty),
                       eos_token_ids=frozenset({7}))
    req.output_token_ids.extend([11, 12, 13])
    req.num_computed_tokens = computed
    built = scheduled_request(req, n, (4, 9))
    ref = reference_record(req, n, (4, 9))
    assert built == ref and type(built) is ScheduledRequest
    assert set(vars(built)) == field_names(ScheduledRequest)  # no field missing, none extra
    assert hash(built.token_ids) == hash(ref.token_ids) and repr(built) == repr(ref)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.start_pos = 0  # type: ignore[misc]


def test_token_delta_equals_the_constructor() -> None:
    req = make_request(prompt_len=6)
    req.num_cached_tokens = 4
    built = token_delta(req, 42, ())
    ref = RequestDelta(req.request_id, (42,), (), None, None, 6, 4)
    assert built == ref and type(built) is RequestDelta and not built.finished
    assert set(vars(built)) == field_names(RequestDelta)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.new_token_ids = ()  # type: ignore[misc]


def test_only_policies_that_account_for_service_are_called() -> None:
    """update() skips `account` unless `tracks_service`: every policy overriding it must say so."""
    policies = [queues.FCFSQueue, queues.PriorityQueue, queues.DeadlineQueue, queues.FairQueue]
    for cls in policies:
        assert cls.tracks_service == (cls.account is not queues.RequestQueue.account), cls.__name__
    assert queues.FairQueue.tracks_service


# ----------------------------------------------------------------------------- KV manager
def reference_block_hash(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """The block hash as first written: one SHA-256 update per part."""
    h = hashlib.sha256()
    h.update(b"cadence-kv-root" if parent is None else parent)
    h.update(b"\x00" if salt is None else b"\x01" + len(salt.encode()).to_bytes(4, "little") + salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def test_block_hashes_equal_the_reference() -> None:
    """hash_full_blocks encodes a prompt once; the digests stay those of one hash per block."""
    rng = random.Random(5)
    for _ in range(100):
        bs = rng.choice((1, 2, 4, 16))
        tokens = [rng.randrange(0, 2**40) for _ in range(rng.randint(0, 70))]
        salt = rng.choice((None, "", "tenant-é"))
        want, parent = [], None
        for i in range(len(tokens) // bs):
            parent = reference_block_hash(parent, tokens[i * bs : (i + 1) * bs], salt)
            want.append(parent)
        parents = [None, *want[:-1]]
        assert [hash_block(parents[i], tokens[i * bs : (i + 1) * bs], salt) for i in range(len(want))] == want
        known = rng.randint(0, len(want))
        assert hash_full_blocks(tokens, bs, salt, want[:known]) == want


def test_block_id_table_follows_growth_hits_and_free() -> None:
    kv = KVCacheManager(32, BS)
    a = make_request(prompt=list(range(1, 11)))
    assert kv.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    assert kv.block_table(a.request_id) == tuple(b.block_id for b in kv._tables[a.request_id])
    for tok in range(7):  # decodes: the table grows by one block every BS tokens
        a.output_token_ids.append(100 + tok)
        new = kv.allocate_slots(a, 1)
        assert new is not None
        a.num_computed_tokens += 1
        kv.cache_computed_blocks(a)
        assert kv.block_table(a.request_id)[-len(new):] == new.block_ids or not new
        kv.check_integrity([a], published=True)
    b = make_request(prompt=list(range(1, 11)) + [50, 51])  # shares a's first two blocks
    hit, cached = kv.get_computed_blocks(b)
    assert cached == 8
    new = kv.allocate_slots(b, 4, computed_blocks=hit)
    assert new is not None
    assert kv.block_table(b.request_id) == hit.block_ids + new.block_ids
    assert kv.block_table(b.request_id)[:2] == kv.block_table(a.request_id)[:2]
    kv.free(a)
    assert kv.block_table(a.request_id) == ()
    kv.check_integrity([b])


def test_integrity_catches_a_filled_block_that_was_not_published() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request(prompt_len=6)
    assert kv.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6  # one block full, cache_computed_blocks not called yet
    kv.check_integrity([a])  # a plain check does not look at publication
    with pytest.raises(AssertionError, match="published"):
        kv.check_integrity([a], published=True)
    kv.cache_computed_blocks(a)
    kv.check_integrity([a], published=True)
    kv._table_ids[a.request_id] = (0,)  # a stale id table is caught too
    with pytest.raises(AssertionError, match="out of step"):
        kv.check_integrity([a])


# ----------------------------------------------------------------------------- whole runs
def _drive(seed: int, decode_ids: bool = False, **options) -> tuple[list[SchedulerOutput], list[RequestDelta], Scheduler]:
    """A random stream of adds, steps and aborts; every step's records checked against the reference.

    With `decode_ids`, the plain decodes that go on come back as ids (the simulator's mode); the
    deltas come back with one per plain decode, in the order the plain mode gives them, so both
    modes compare (and fingerprint) alike."""
    rng = random.Random(seed)
    engine, ex, clock = make_engine(executor=FakeExecutor(), decode_ids=decode_ids, **options)
    sched = engine.scheduler
    plain_schedule = sched.schedule

    def checked_schedule(now: float) -> SchedulerOutput:
        out = plain_schedule(now)
        for sr in out.scheduled:
            req = sched.requests[sr.request_id]
            assert sr == reference_record(req, sr.num_tokens, engine.kv.block_table(sr.request_id))
        return out

    sched.schedule = checked_schedule  # type: ignore[method-assign]
    shared = [rng.randrange(1, 999) for _ in range(12)]
    deltas: list[RequestDelta] = []

    def step() -> list[RequestDelta]:
        got = engine.step()
        return _with_plain_decodes(got, ex.outputs[-1] if ex.outputs else None, engine) if decode_ids else got

    live: list[str] = []
    for i in range(60):
        if rng.random() < 0.5:
            prompt = (shared if rng.random() < 0.4 else []) + [rng.randrange(1, 999) for _ in range(rng.randint(1, 20))]
            req = make_request(rid=f"s{seed}-{i}", prompt=prompt, max_tokens=rng.randint(1, 14),
                               priority=rng.randint(0, 2), tenant=rng.choice("ab"))
            try:
                engine.add_request(req)
                live.append(req.request_id)
            except AdmissionError:
                pass
        if live and rng.random() < 0.05:
            deltas += engine.abort_requests([live.pop(rng.randrange(len(live)))])
        for _ in range(rng.randint(0, 3)):
            deltas += step()
            assert sched.stats().num_live_tokens == sum(r.num_computed_tokens for r in sched.running)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        deltas += step()
    assert not engine.has_unfinished_requests() and not ex.violations
    return ex.outputs, deltas, sched


def _with_plain_decodes(got: list[RequestDelta], out: SchedulerOutput | None, engine) -> list[RequestDelta]:
    """Decode ids: the step's deltas plus the plain decodes that went on (as the deltas the plain
    mode makes for them), in the plain mode's order: deltas decided inside schedule first, then
    one per row in scheduling order."""
    if not engine.last_decoded:
        return got
    assert out is not None
    order = {sr.request_id: i for i, sr in enumerate(out.scheduled)}
    reqs = engine.scheduler.requests
    plain = [token_delta(reqs[rid], reqs[rid].output_token_ids[-1], ()) for rid in engine.last_decoded]
    early = [d for d in got if d.request_id not in order]
    assert got[: len(early)] == early
    return early + sorted(got[len(early):] + plain, key=lambda d: order[d.request_id])


RUNS = {
    "fcfs-tight": dict(num_kv_blocks=14, max_num_seqs=4, max_num_batched_tokens=16),
    "priority-threshold": dict(policy="priority", num_kv_blocks=30, max_num_batched_tokens=24,
                               long_prefill_token_threshold=5, max_num_partial_prefills=2),
    "fair-isolated": dict(policy="fair", tenant_isolation=True, num_kv_blocks=40, max_num_seqs=3),
    "static": dict(scheduler="static", num_kv_blocks=48, max_num_seqs=3),
    "unchunked-noprefix": dict(enable_chunked_prefill=False, enable_prefix_caching=False, num_kv_blocks=28,
                               max_num_batched_tokens=40, block_size=2),
}


def fingerprint(outputs: list[SchedulerOutput], deltas: list[RequestDelta]) -> str:
    h = hashlib.sha256()
    for o in outputs:
        rows = [(r.request_id, r.start_pos, r.token_ids, r.sample, r.block_table, r.num_output_tokens) for r in o.scheduled]
        h.update(repr((o.step, rows, o.preempted_ids, o.finished_ids, o.num_prefill_tokens, o.num_decode_tokens)).encode())
    for d in deltas:
        m = d.metrics
        times = None if m is None else (m.first_scheduled_time, m.first_token_time, m.finished_time, m.num_preemptions)
        h.update(repr((d.request_id, d.new_token_ids, d.finish_reason, d.num_cached_tokens, times)).encode())
    return h.hexdigest()[:16]


# Produced by the code before the hot-path shortcuts (commit d37cc53). A change that alters
# scheduling on purpose must update these, and say so.
EXPECTED = {
    "fcfs-tight": "f2b151ada1bc5cfb",
    "priority-threshold": "eac72a102b2163c5",
    "fair-isolated": "d37e3308f5d3b4f9",
    "static": "1c14f8a461907233",
    "unchunked-noprefix": "29c3028a6be3163b",
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_decisions_match_the_recorded_fingerprints(name: str) -> None:
    outputs, deltas, sched = _drive(7, **RUNS[name])
    assert sum(o.num_batched_tokens for o in outputs) > 0
    assert fingerprint(outputs, deltas) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_builtin_block_hashes_give_the_same_decisions(name: str) -> None:
    """Python's hash() keys the prefix cache as SHA-256 does: the same hits, so the same runs."""
    outputs, deltas, _ = _drive(7, prefix_caching_hash_algo="builtin", **RUNS[name])
    assert fingerprint(outputs, deltas) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_decode_ids_give_the_same_decisions_and_deltas(name: str) -> None:
    """Decode ids (the simulator's mode) against deltas: the same steps, block tables and
    deltas, and so the fingerprint recorded for the plain mode."""
    plain_outputs, plain_deltas, _ = _drive(7, **RUNS[name])
    outputs, deltas, _ = _drive(7, decode_ids=True, **RUNS[name])
    assert outputs == plain_outputs
    assert deltas == plain_deltas
    assert fingerprint(outputs, deltas) == EXPECTED[name]


def test_decode_ids_report_the_plain_decodes_as_ids() -> None:
    """With decode ids the plain decodes that go on get no delta (else the test above proves
    little), and requests with penalties or logprobs still do; every row is a record either way."""
    engine, ex, _ = make_engine(decode_ids=True)
    a, b = make_request(max_tokens=6), make_request(params=SamplingParams(max_tokens=6, logprobs=2))
    c = make_request(params=SamplingParams(max_tokens=6, repetition_penalty=1.2))
    for r in (a, b, c):
        engine.add_request(r)
    deltas = engine.step() + engine.step()
    last = ex.outputs[-1]
    assert engine.last_decoded == [a.request_id]
    assert [d.request_id for d in deltas[3:]] == [b.request_id, c.request_id]  # no delta for a's decode
    assert [sr.request_id for sr in last.scheduled] == [a.request_id, b.request_id, c.request_id]  # scheduling order
    assert last.scheduled[0].token_ids == (a.output_token_ids[0],) and last.num_scheduled == 3


def test_runs_exercise_preemption_and_prefix_hits() -> None:
    """The fingerprinted runs are only worth pinning if they reach the interesting paths."""
    outputs, deltas, _ = _drive(7, **RUNS["fcfs-tight"])
    assert any(o.preempted_ids for o in outputs)
    assert any(d.num_cached_tokens for d in deltas)
    assert any(sr.num_tokens > 1 and sr.start_pos > 0 for o in outputs for sr in o.scheduled)  # chunks


def test_a_preempted_request_keeps_its_block_hashes() -> None:
    """Preemption keeps the hash memo (values as a fresh hashing gives); finishing drops it."""
    engine, _, _ = make_engine(num_kv_blocks=32)
    req = make_request(prompt_len=10, max_tokens=8)
    engine.add_request(req)
    for _ in range(4):
        engine.step()
    kv = engine.kv
    assert engine.scheduler.force_preempt(req.request_id)
    kept = kv._hashes[req.request_id]
    assert kept == hash_full_blocks(req.all_token_ids, BS)[: len(kept)] and kept
    run_until_done(engine)
    assert req.request_id not in kv._hashes
