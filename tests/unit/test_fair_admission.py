"""Fair share at the queue door, and refusals that can never succeed, without a model.

Under `--policy fair` a full queue refuses the tenant over its share (by weight) of the queue, and
makes room for a tenant within its share by dropping the over-share tenant's newest queued request.
The pure queue (`FairQueue.overflow`), the scheduler's admission, and an engine core on the fake
executor and a virtual clock, driven by a flooding and a trickling tenant.
"""

from __future__ import annotations

from collections import Counter

import pytest
from fakes import FakeExecutor, make_engine, make_request

from cadence.config import CacheConfig, SchedulerConfig
from cadence.errors import AdmissionError, ErrorKind
from cadence.kv.manager import KVCacheManager
from cadence.request import FinishReason, Request, RequestStatus, SamplingParams
from cadence.sched.queue import FairQueue, FCFSQueue, QueueBound
from cadence.sched.scheduler import Scheduler

REQUESTS = lambda limit: QueueBound(limit, "requests", lambda r: 1)  # noqa: E731
TOKENS = lambda limit: QueueBound(limit, "prompt tokens", lambda r: r.num_prompt_tokens)  # noqa: E731


def req(rid: str, tenant: str, prompt_len: int = 4, **kw) -> Request:
    return make_request(rid=rid, tenant=tenant, prompt_len=prompt_len, **kw)


def scheduler(**opts) -> Scheduler:
    kv = KVCacheManager(256, 4, True)
    return Scheduler(SchedulerConfig(**opts), CacheConfig(block_size=4, num_kv_blocks=256), kv, 1024)


# -- the queue's verdict ----------------------------------------------------------------------------


def test_a_full_fair_queue_takes_room_from_the_tenant_over_its_share() -> None:
    q = FairQueue()
    for i in range(3):
        q.add(req(f"f{i}", "flood"))
    q.add(req("t0", "trickle"))
    # Four of four: the trickler, holding one, brings a second; the flood holds three of an even split.
    verdict = q.overflow([req("t1", "trickle")], [REQUESTS(4)])
    assert verdict.over_share is None
    [(victim, use)] = verdict.evict
    assert victim.request_id == "f2"  # the flood's newest
    assert (use.tenant, use.held, use.share) == ("flood", 3, 2.0)
    # The flood bringing a fourth is the one over its share: refused, naming what it holds.
    verdict = q.overflow([req("f3", "flood")], [REQUESTS(4)])
    assert not verdict.evict and verdict.over_share is not None
    assert (verdict.over_share.tenant, verdict.over_share.held, verdict.over_share.share) == ("flood", 4, 2.0)
    assert len(q) == 4  # a verdict changes nothing


def test_ties_and_weights_decide_who_is_over() -> None:
    q = FairQueue({"gold": 3.0})
    for i in range(2):
        q.add(req(f"g{i}", "gold"))
        q.add(req(f"s{i}", "silver"))
    # gold (weight 3) holds 2 of 4, its share is 3: silver, holding 2 against a share of 1, gives way.
    [(victim, _)] = q.overflow([req("g2", "gold")], [REQUESTS(4)]).evict
    assert victim.request_id == "s1"
    # silver bringing a third would hold 3 per weight, gold 2/3: silver is refused.
    assert q.overflow([req("s2", "silver")], [REQUESTS(4)]).over_share.tenant == "silver"
    # Even weights and an even split: the arrival is refused, the queued requests keep their place.
    even = FairQueue()
    for i in range(2):
        even.add(req(f"a{i}", "a"))
        even.add(req(f"b{i}", "b"))
    verdict = even.overflow([req("a2", "a")], [REQUESTS(4)])
    assert verdict.over_share.tenant == "a" and not verdict.evict


def test_a_request_that_has_started_is_never_dropped() -> None:
    q = FairQueue()
    started = req("f0", "flood")
    started.first_scheduled_time = 1.0  # preempted after streaming: back in the queue, keeps its place
    q.push_front(started)
    q.add(req("f1", "flood"))
    q.add(req("f2", "flood"))
    [(victim, _)] = q.overflow([req("t", "trickle")], [REQUESTS(3)]).evict
    assert victim.request_id == "f2"
    only_started = FairQueue()
    for i in range(3):
        r = req(f"p{i}", "flood")
        r.first_scheduled_time = 1.0
        only_started.push_front(r)
    # The room is held by requests that cannot be dropped: the trickler, within its share (1 of 1.5),
    # is refused for the queue alone, not for its tenant.
    verdict = only_started.overflow([req("t", "trickle")], [REQUESTS(3)])
    assert verdict.over_share is None and not verdict.evict


def test_a_token_bound_drops_as_many_requests_as_the_arrival_needs() -> None:
    q = FairQueue()
    for i in range(5):
        q.add(req(f"f{i}", "flood", prompt_len=8))
    verdict = q.overflow([req("t", "trickle", prompt_len=20)], [TOKENS(40)])
    assert [v.request_id for v, _ in verdict.evict] == ["f4", "f3", "f2"]  # newest first, until 20 fit
    # An arrival larger than its own share (20 of 40) is refused even though it holds nothing yet.
    assert q.overflow([req("t", "trickle", prompt_len=30)], [TOKENS(40)]).over_share.tenant == "trickle"


@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline"])
def test_other_policies_refuse_whoever_arrives(policy: str) -> None:
    h = scheduler(policy=policy, max_queue_len=2, max_num_seqs=1)
    h.add_request(req("f0", "flood"), 1.0)
    h.add_request(req("f1", "flood"), 1.0)
    with pytest.raises(AdmissionError) as e:
        h.add_request(req("t", "trickle"), 1.0)
    assert e.value.kind == ErrorKind.QUEUE_FULL
    assert not FCFSQueue().overflow([req("x", "a")], [REQUESTS(1)]).evict


# -- the scheduler carries the verdict out ----------------------------------------------------------


def test_the_dropped_request_ends_with_its_refusal_and_the_arrival_is_queued() -> None:
    s = scheduler(policy="fair", max_queue_len=3, max_num_seqs=1)
    executor = FakeExecutor()
    executor.initialize_kv_cache(256, 4)
    for i in range(3):
        s.add_request(req(f"f{i}", "flood"), 1.0)
    s.add_request(req("t", "trickle"), 2.0)
    assert [r.request_id for r in s.waiting] == ["f0", "f1", "t"]
    assert "f2" not in s.requests
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("f3", "flood"), 2.0)
    assert e.value.kind == ErrorKind.FAIR_SHARE and e.value.retry_after >= 1
    assert e.value.message.startswith("tenant 'flood' is over its fair share of the queue: with this request it "
                                      "would hold 3 of the 3 queued requests, over its share of 1.5")
    # The dropped request's final delta comes out with the next step, its refusal in it.
    out = s.schedule(2.0)
    deltas = {d.request_id: d for d in s.update(out, executor.execute(out), 2.0)}
    d = deltas["f2"]
    assert d.finish_reason is FinishReason.EVICTED and not d.new_token_ids and d.retry_after >= 1
    assert "tenant 'flood' is over its fair share of the queue (3 of the 3 queued requests" in d.error
    assert "dropped to admit another tenant's" in d.error and "trickle" not in d.error
    s.check_integrity()
    assert s.last_iteration_stats.rejections == {"fair_share": 1}
    assert [f.finish_reason for f in s.last_iteration_stats.finished] == ["evicted"]


def test_a_group_is_admitted_whole_or_drops_nothing() -> None:
    s = scheduler(policy="fair", max_queue_len=4, max_num_seqs=1)
    for i in range(3):
        s.add_request(req(f"f{i}", "flood"), 1.0)
    # Two choices from the trickler: one place free, the flood (3 of a share of 2) gives one more.
    s.add_requests([req("t-0", "trickle"), req("t-1", "trickle")], 2.0)
    assert Counter(r.tenant for r in s.waiting) == {"flood": 2, "trickle": 2}
    # Three more from the trickler would leave it over its share: refused whole, nothing dropped.
    with pytest.raises(AdmissionError) as e:
        s.add_requests([req(f"u-{i}", "trickle") for i in range(3)], 3.0)
    assert e.value.kind == ErrorKind.FAIR_SHARE
    assert Counter(r.tenant for r in s.waiting) == {"flood": 2, "trickle": 2} and len(s.requests) == 4


def test_the_offline_driver_is_refused_instead_of_dropping_its_own_requests() -> None:
    s = scheduler(policy="fair", max_queue_len=2, max_num_seqs=1)
    s.add_request(req("f0", "flood"), 1.0)
    s.add_request(req("f1", "flood"), 1.0)
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("t", "trickle"), 1.0, evict=False)
    assert e.value.kind == ErrorKind.QUEUE_FULL and len(s.waiting) == 2


# -- a flooding and a trickling tenant, step by step ------------------------------------------------


def run_flood(policy: str, steps: int = 1500) -> dict[str, Counter]:
    """A flood tries two requests every step (0.01 s); a trickler one every 1.5 s. Both weigh 1.
    Counts, per tenant, the requests sent, refused at the door, dropped from the queue, finished."""
    engine, _, clock = make_engine(policy=policy, max_num_seqs=2, max_queue_len=8, num_kv_blocks=256)
    counts = {k: Counter() for k in ("sent", "refused", "dropped", "served")}
    owner: dict[str, str] = {}

    def send(rid: str, tenant: str) -> None:
        owner[rid] = tenant
        counts["sent"][tenant] += 1
        try:
            engine.add_request(req(rid, tenant, prompt_len=8, max_tokens=8))
        except AdmissionError as e:
            assert e.kind in (ErrorKind.QUEUE_FULL, ErrorKind.FAIR_SHARE)
            counts["refused"][tenant] += 1

    for step in range(steps):
        send(f"f{step}a", "flood")
        send(f"f{step}b", "flood")
        if step % 150 == 75:
            send(f"t{step}", "trickle")
        for d in engine.step():
            if d.finish_reason is FinishReason.EVICTED:
                assert "tenant 'flood' is over its fair share" in d.error
                counts["dropped"][owner[d.request_id]] += 1
            elif d.finished:
                counts["served"][owner[d.request_id]] += 1
    return counts


def test_a_trickling_tenant_is_not_refused_for_a_flood() -> None:
    fair = run_flood("fair")
    assert fair["sent"]["trickle"] == 10 and fair["refused"]["flood"] > 2000  # heavily overloaded
    # The overload is the flood's alone: the trickler never holds more than one of the four places
    # that are its share, so its share of the refusals is none. It is never refused or dropped, room
    # is made for it by dropping the flood's newest request, and every one of its requests runs.
    assert fair["refused"]["trickle"] + fair["dropped"]["trickle"] == 0
    assert fair["dropped"]["flood"] == 10
    assert fair["served"]["trickle"] == 10
    # A tenant-blind queue refuses the trickler whenever the flood has filled it: every time.
    blind = run_flood("fcfs")
    assert blind["refused"]["trickle"] == 10


def test_weighted_tenants_hold_the_queue_in_proportion_to_their_weights() -> None:
    engine, _, _ = make_engine(policy="fair", max_num_seqs=2, max_queue_len=8, num_kv_blocks=256,
                               tenant_weights={"gold": 3.0})
    for step in range(300):
        for k in range(2):  # both flood, gold first then silver, twice a step
            for tenant in ("gold", "silver"):
                try:
                    engine.add_request(req(f"{tenant}{step}-{k}", tenant, prompt_len=8, max_tokens=8))
                except AdmissionError as e:
                    assert e.kind is ErrorKind.FAIR_SHARE, e.message  # always the tenant's own share
        if step >= 5:  # after the queue first filled, each tenant holds its share exactly
            assert Counter(r.tenant for r in engine.scheduler.waiting) == {"gold": 6, "silver": 2}
        engine.step()


def test_dropped_requests_free_what_they_held_and_leave_the_engine_consistent() -> None:
    engine, ex, _ = make_engine(policy="fair", max_num_seqs=1, max_queue_len=2, num_kv_blocks=64)
    running = req("run", "flood", max_tokens=20)
    engine.add_request(running)
    engine.step()
    engine.add_request(req("q0", "flood"))
    engine.add_request(req("q1", "flood"))
    engine.add_request(req("t", "trickle"))  # drops q1
    finals = {d.request_id: d for d in engine.step() if d.finished}
    assert finals["q1"].finish_reason is FinishReason.EVICTED
    assert engine.scheduler.requests.keys() == {"run", "q0", "t"}
    while engine.has_unfinished_requests():
        engine.step()
    assert not ex.violations and engine.kv.num_free_blocks == engine.kv.num_blocks


# -- refusals that can never succeed are 400s, not 429s ---------------------------------------------


def test_a_prompt_over_max_queued_tokens_is_invalid_not_busy() -> None:
    s = scheduler(max_queued_tokens=20)
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("big", "a", prompt_len=21), 1.0)  # on an empty queue: it never fits
    assert e.value.kind == ErrorKind.INVALID_REQUEST and e.value.param == "prompt" and e.value.retry_after is None
    assert "prompt (21 tokens) exceeds max_queued_tokens (20)" in e.value.message
    s.add_request(req("fits", "a", prompt_len=20), 1.0)
    with pytest.raises(AdmissionError) as e:
        s.add_request(req("later", "a", prompt_len=1), 1.0)
    assert e.value.kind == ErrorKind.QUEUE_FULL  # this one fits once the queue drains


def test_a_group_larger_than_the_queue_is_invalid_not_busy() -> None:
    s = scheduler(max_queue_len=2, max_queued_tokens=30)
    with pytest.raises(AdmissionError) as e:
        s.add_requests([req(f"n-{i}", "a") for i in range(3)], 1.0)
    assert e.value.kind == ErrorKind.INVALID_REQUEST and e.value.param == "n"
    assert "3 choices" in e.value.message and "more than the waiting queue holds (2, max_queue_len)" in e.value.message
    with pytest.raises(AdmissionError) as e:
        s.add_requests([req(f"m-{i}", "a", prompt_len=16) for i in range(2)], 1.0)
    assert e.value.kind == ErrorKind.INVALID_REQUEST and "32 prompt tokens" in e.value.message
    assert not s.requests


def test_a_dropped_request_status_is_terminal() -> None:
    assert RequestStatus.FINISHED_EVICTED.is_finished
    assert RequestStatus.FINISHED_EVICTED.finish_reason is FinishReason.EVICTED
    assert SamplingParams().greedy is False
