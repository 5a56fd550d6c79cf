"""The dashboard's recorder (metrics/dashboard.py): its ring buffers, census and JSON, on a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cadence.boundary import FinishedRequestStats, IterationStats, QueueCensus, RequestMetrics, SchedulerStats
from cadence.config import EngineConfig, ServerConfig
from cadence.kv.block_pool import BlockPool
from cadence.metrics.dashboard import (
    CENSUS_EVERY_S,
    MAX_LATENCY_SAMPLES,
    STEP_HISTORY,
    WATCHED_FOR_S,
    WINDOW_S,
    DashboardRecorder,
    Limits,
)
from cadence.server.dashboard import make_recorder


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def finished(tenant: str, tokens: int, reason: str = "stop") -> FinishedRequestStats:
    return FinishedRequestStats(f"r-{tenant}-{tokens}", tenant, 0, reason, 5, tokens, 0,
                                RequestMetrics(0.0, 0.1, 0.2, 1.0))


def gauges(running: int = 0, waiting: int = 0, free: int = 100, total: int = 100) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, kv_usage=1 - free / total,
                          num_free_blocks=free, num_total_blocks=total)


class CensusSource:
    """Counts its calls; returns what the test set."""

    def __init__(self, census: QueueCensus) -> None:
        self.census, self.calls = census, 0

    def __call__(self) -> QueueCensus:
        self.calls += 1
        return self.census


def test_steps_keep_the_last_ones_and_skip_records_of_no_work():
    clock = FakeClock()
    rec = DashboardRecorder(limits=Limits(256, 8), clock=clock)
    for i in range(STEP_HISTORY + 10):
        clock.t += 0.01
        rec.record_step(IterationStats(step=i, num_prompt_tokens=i % 7, num_generation_tokens=3,
                                       token_latencies=[("a", 0.01)] * 3, step_time=0.005), gauges(3, 2))
    rec.record_step(IterationStats(step=999, finished=[finished("a", 4)]), gauges())  # an idle flush: no step
    steps = rec.snapshot()["steps"]
    assert len(steps) == STEP_HISTORY
    assert [s["step"] for s in steps] == list(range(10, STEP_HISTORY + 10))
    last = steps[-1]
    assert last["decode_rows"] == 3 and last["prefill_tokens"] == (STEP_HISTORY + 9) % 7
    assert last["running"] == 3 and last["waiting"] == 2 and last["duration_s"] == 0.005
    assert last["age_s"] == pytest.approx(0.0)
    assert steps[0]["age_s"] == pytest.approx((STEP_HISTORY - 1) * 0.01)
    assert rec.snapshot()["limits"] == {"max_num_batched_tokens": 256, "max_num_seqs": 8, "kv_blocks": 100}


def test_latency_percentiles_cover_the_last_minute_only():
    clock = FakeClock()
    rec = DashboardRecorder(clock=clock)
    rec.record_step(IterationStats(num_generation_tokens=1, first_token_latencies=[("a", 9.0)],
                                   token_latencies=[("a", 5.0)]), None)
    clock.t += WINDOW_S / 2
    ttfts = [("a", x / 100) for x in range(1, 101)]  # 0.01 .. 1.00
    rec.record_step(IterationStats(num_generation_tokens=100, first_token_latencies=ttfts,
                                   token_latencies=[("b", 0.002)] * 10), None)
    lat = rec.snapshot()["latency"]
    assert lat["ttft"]["count"] == 101 and lat["ttft"]["p99"] == 1.0
    clock.t += WINDOW_S / 2 + 0.001  # the first step is now older than the window
    lat = rec.snapshot()["latency"]
    assert lat["ttft"] == {"count": 100, "p50": 0.5, "p90": 0.9, "p99": 0.99}
    assert lat["itl"] == {"count": 10, "p50": 0.002, "p90": 0.002, "p99": 0.002}
    clock.t += WINDOW_S
    assert rec.snapshot()["latency"]["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}


def test_percentiles_over_many_samples_use_an_even_subset():
    rec = DashboardRecorder(clock=FakeClock())
    n = 3 * MAX_LATENCY_SAMPLES
    samples = [("a", i / n) for i in range(n)]
    for i in range(0, n, 13):  # steps of 13 tokens: the subset is taken across the steps' lists
        rec.record_step(IterationStats(num_generation_tokens=13, token_latencies=samples[i:i + 13]), None)
    itl = rec.snapshot()["latency"]["itl"]
    assert itl["count"] == n  # every sample counted, percentiles within one stride of exact
    assert itl["p50"] == pytest.approx(0.5, abs=3 / n + 1e-9)
    assert itl["p99"] == pytest.approx(0.99, abs=3 / n + 1e-9)


def test_service_share_preemptions_and_refusals_over_the_window():
    clock = FakeClock()
    rec = DashboardRecorder(clock=clock)
    rec.record_step(IterationStats(num_generation_tokens=1, num_preemptions=2,
                                   finished=[finished("a", 30), finished("b", 10, "length")]), None)
    rec.record_rejection("queue_full", 3)
    clock.t += 10
    rec.record_step(IterationStats(num_generation_tokens=1, finished=[finished("a", 60, "abort")]), None)
    rec.record_rejection("tenant_quota")
    snap = rec.snapshot()
    assert snap["service"] == {"output_tokens": 100, "finished": 3, "by_tenant": {"a": 90, "b": 10},
                               "by_reason": {"stop": 1, "length": 1, "abort": 1}}
    assert snap["preemptions"] == {"total": 2, "window": 2, "per_s": 0.2}  # 2 over the 10 s seen so far
    assert snap["refusals"] == {"total": 4, "window": 4, "per_s": 0.4,
                                "by_reason": {"queue_full": 3, "tenant_quota": 1}}
    clock.t += WINDOW_S - 5  # the first step and refusal leave the window; the totals stay
    snap = rec.snapshot()
    assert snap["service"]["by_tenant"] == {"a": 60}
    assert snap["preemptions"] == {"total": 2, "window": 0, "per_s": 0.0}
    assert snap["refusals"]["window"] == 1 and snap["refusals"]["total"] == 4
    assert snap["refusals"]["per_s"] == pytest.approx(1 / WINDOW_S, abs=1e-3)


def test_rings_are_bounded_whatever_the_rate():
    clock = FakeClock()
    rec = DashboardRecorder(clock=clock)
    for _ in range(20_000):  # all within one second: only the size bound applies
        rec.record_step(IterationStats(num_generation_tokens=1, token_latencies=[("a", 0.01)],
                                       finished=[finished("a", 1)]), None)
        rec.record_rejection("queue_full")
    assert all(len(ring) <= ring.maxlen for ring in (rec._itl, rec._finishes, rec._refusals, rec._steps))
    snap = rec.snapshot()
    assert snap["refusals"]["total"] == 20_000  # the totals are counters, not ring lengths


def test_census_is_taken_only_while_watched_and_at_most_every_interval():
    clock = FakeClock()
    source = CensusSource(QueueCensus({"a": 2, "b": 1}, {0: 2, 5: 1}, {"a": 1}, num_cached_free_blocks=30))
    rec = DashboardRecorder(census=source, clock=clock)
    step = IterationStats(num_generation_tokens=1)
    rec.record_step(step, gauges(1, 3, free=60))
    assert source.calls == 0  # nobody has looked: the queues are not walked
    assert rec.snapshot()["queue"]["by_tenant"] is None
    assert CENSUS_EVERY_S == 0.5
    for _ in range(10):  # watched now: one census per interval (at 0.1 s and 0.6 s), however many steps
        clock.t += 0.1
        rec.record_step(step, gauges(1, 3, free=60))
    assert source.calls == 2
    snap = rec.snapshot()
    assert snap["queue"] == {"waiting": 3, "counted": 3, "by_tenant": {"a": 2, "b": 1}, "other_tenants": 0,
                             "by_priority": {"0": 2, "5": 1}, "running_by_tenant": {"a": 1},
                             "age_s": pytest.approx(0.4)}  # taken at 0.6 s, read at 1.0 s
    assert snap["kv"] == {"total": 100, "used": 40, "cached": 30, "free": 30}
    clock.t += WATCHED_FOR_S + 1  # no reader for a while: no more census
    calls = source.calls
    for _ in range(5):
        clock.t += CENSUS_EVERY_S
        rec.record_step(step, gauges(1, 3, free=60))
    assert source.calls == calls


def test_an_engine_that_empties_is_counted_at_once():
    clock = FakeClock()
    source = CensusSource(QueueCensus({"a": 1}, {0: 1}, {}, 0))
    rec = DashboardRecorder(census=source, clock=clock)
    rec.snapshot()
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(1, 1))
    source.census = QueueCensus({}, {}, {}, num_cached_free_blocks=7)
    clock.t += CENSUS_EVERY_S / 10  # within the interval, but the engine has nothing left: it goes idle
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(0, 0))
    snap = rec.snapshot()
    assert source.calls == 2
    assert snap["queue"]["by_tenant"] == {} and snap["kv"]["cached"] == 7


def test_gauges_given_at_read_time_win_over_the_last_step():
    rec = DashboardRecorder(clock=FakeClock())
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(2, 5, free=10))
    snap = rec.snapshot(gauges=gauges(0, 0, free=100))
    assert snap["requests"] == {"running": 0, "waiting": 0}
    assert snap["kv"]["used"] == 0


def test_a_tenant_sees_its_own_rows_and_whole_totals_only():
    clock = FakeClock()
    census = QueueCensus({"acme": 2, "globex": 3}, {0: 5}, {"acme": 1, "globex": 1}, 0)
    rec = DashboardRecorder(census=CensusSource(census), known_tenants=["acme", "globex"], clock=clock)
    rec.snapshot()
    rec.record_step(IterationStats(num_generation_tokens=1, finished=[finished("acme", 10), finished("globex", 30)]),
                    gauges(2, 5))
    mine = rec.snapshot(tenant="acme")
    assert mine["tenant"] == "acme"
    assert mine["queue"]["by_tenant"] == {"acme": 2} and mine["queue"]["waiting"] == 5
    assert mine["queue"]["running_by_tenant"] == {"acme": 1}
    assert mine["queue"]["by_priority"] == {"0": 5}  # priorities name no tenant
    assert mine["service"]["by_tenant"] == {"acme": 10} and mine["service"]["output_tokens"] == 40
    assert "globex" not in repr(mine)
    everyone = rec.snapshot()
    assert everyone["queue"]["by_tenant"] == {"acme": 2, "globex": 3}


def test_a_tenants_queue_rows_all_come_from_the_same_census():
    """The census counted 6 waiting (alice 3, bob 3; all priority 0); a step later the live gauge
    says 7. Alice's rows must add up with the priority rows: other tenants 3, not 7 - 3 = 4."""
    clock = FakeClock()
    census = QueueCensus({"alice": 3, "bob": 3}, {0: 6}, {}, 0)
    rec = DashboardRecorder(census=CensusSource(census), known_tenants=["alice", "bob"], clock=clock)
    rec.snapshot()
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(1, 6))  # the census is taken here
    clock.t += CENSUS_EVERY_S / 10
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(1, 7))  # one more arrived since
    q = rec.snapshot(tenant="alice")["queue"]
    assert q["waiting"] == 7  # the live gauge
    assert q["by_tenant"] == {"alice": 3} and q["other_tenants"] == 3 and q["by_priority"] == {"0": 6}
    assert q["counted"] == sum(q["by_tenant"].values()) + q["other_tenants"] == sum(q["by_priority"].values())
    everyone = rec.snapshot()["queue"]
    assert everyone["other_tenants"] == 0 and everyone["counted"] == 6


def test_tenant_names_are_bounded_and_key_tenants_keep_theirs():
    clock = FakeClock()
    invented = {f"t{i}": 1 for i in range(50)}
    rec = DashboardRecorder(census=CensusSource(QueueCensus({**invented, "acme": 1}, {0: 51}, {}, 0)),
                            max_tenant_labels=3, known_tenants=["acme"], clock=clock)
    rec.snapshot()
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(0, 51))
    rows = rec.snapshot()["queue"]["by_tenant"]
    assert len(rows) == 5 and rows["other"] == 47 and rows["acme"] == 1 and sum(rows.values()) == 51
    # a tenant folded into "other" is shown no row: "other" holds other tenants' requests too
    assert rec.snapshot(tenant="t40")["queue"]["by_tenant"] == {}


def test_a_recorder_without_an_engine_says_so():
    rec = DashboardRecorder(clock=FakeClock())
    rec.record_rejection("unavailable")
    snap = rec.snapshot()
    assert snap["source"] == "ingress" and snap["queue"]["by_tenant"] is None
    assert snap["kv"] == {"total": None, "used": None, "cached": None, "free": None}
    assert snap["refusals"]["by_reason"] == {"unavailable": 1}


def test_queue_census_counts_tenants_and_priorities():
    waiting = [SimpleNamespace(tenant=t, priority=p) for t, p in (("a", 0), ("a", 1), ("b", 1))]
    running = [SimpleNamespace(tenant="b", priority=0)]
    assert QueueCensus.of(waiting, running, 4) == QueueCensus({"a": 2, "b": 1}, {0: 1, 1: 2}, {"b": 1}, 4)


def test_cached_free_blocks_are_the_free_ones_still_findable_by_hash():
    pool = BlockPool(8)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.cache(blocks[0], 111)
    pool.cache(blocks[1], 222)
    assert pool.count_cached_free_blocks() == 0  # cached, but in use
    pool.free([blocks[1], blocks[2]])
    assert pool.count_cached_free_blocks() == 1
    assert pool.allocate(6) is not None  # takes every free block, the cached one included
    assert pool.count_cached_free_blocks() == 0


def test_a_server_over_a_local_engine_counts_its_queues_and_a_fleet_ingress_does_not():
    config = EngineConfig.from_options(max_num_seqs=7, max_num_batched_tokens=300)
    census = CensusSource(QueueCensus())
    local = make_recorder(SimpleNamespace(engine=SimpleNamespace(config=config), census=census), ServerConfig())
    ingress = make_recorder(SimpleNamespace(engine=SimpleNamespace(config=config)), ServerConfig())
    for rec in (local, ingress):
        assert rec.limits == Limits(300, 7)
    assert local.snapshot()["source"] == "engine" and ingress.snapshot()["source"] == "ingress"


def test_a_census_from_before_an_unwatched_spell_is_not_shown_as_now():
    clock = FakeClock()
    source = CensusSource(QueueCensus({"a": 2}, {0: 2}, {"a": 1}, num_cached_free_blocks=30))
    rec = DashboardRecorder(census=source, clock=clock)
    rec.snapshot()
    clock.t += 0.1
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(1, 2, free=60))
    assert rec.snapshot()["queue"]["by_tenant"] == {"a": 2}
    clock.t += WATCHED_FOR_S + 1  # nobody watches while the queue drains and the engine goes idle
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(1, 0, free=90))
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(0, 0, free=100))
    clock.t += 30  # a reader opens the dashboard of the idle server: no step follows to count again
    snap = rec.snapshot()
    # Nothing waits or runs (the gauges say so): no rows, rather than the 2 requests of long ago.
    assert snap["queue"] == {"waiting": 0, "counted": 0, "by_tenant": {}, "other_tenants": 0, "by_priority": {},
                             "running_by_tenant": {}, "age_s": None}
    assert snap["kv"] == {"total": 100, "used": 0, "cached": None, "free": 100}  # not counted since


def test_a_census_dropped_while_unwatched_is_unknown_while_requests_remain():
    clock = FakeClock()
    source = CensusSource(QueueCensus({"a": 2}, {0: 2}, {"a": 1}, num_cached_free_blocks=30))
    rec = DashboardRecorder(census=source, clock=clock)
    rec.snapshot()
    clock.t += 0.1
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(1, 2, free=60))
    clock.t += WATCHED_FOR_S + 1
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(2, 1, free=50))
    snap = rec.snapshot()
    assert snap["queue"]["by_tenant"] is None and snap["kv"]["cached"] is None
    clock.t += 0.1  # watched again: the next step counts afresh
    source.census = QueueCensus({"b": 1}, {3: 1}, {"a": 2}, num_cached_free_blocks=4)
    rec.record_step(IterationStats(num_generation_tokens=1), gauges(2, 1, free=50))
    assert rec.snapshot()["queue"]["by_tenant"] == {"b": 1}


def test_speculation_shows_its_rates_and_nothing_when_the_server_does_not_speculate():
    clock = FakeClock()
    rec = DashboardRecorder(clock=clock)
    rec.record_step(IterationStats(step=1, num_generation_tokens=2), gauges())
    assert rec.snapshot()["speculative"] is None  # no draft yet: nothing to show
    clock.t += WINDOW_S
    rec.record_step(IterationStats(step=2, num_generation_tokens=2, num_drafts=2, num_draft_tokens=8,
                                   num_accepted_tokens=6), gauges())
    clock.t += 1.0
    rec.record_step(IterationStats(step=3, num_generation_tokens=2, num_drafts=2, num_draft_tokens=4,
                                   num_accepted_tokens=0), gauges())
    spec = rec.snapshot()["speculative"]
    assert spec["draft_tokens"] == 12 and spec["accepted_tokens"] == 6 and spec["acceptance_rate"] == 0.5
    assert spec["draft_tokens_per_s"] == pytest.approx(12 / WINDOW_S, abs=1e-3)
    assert spec["accepted_tokens_per_s"] == pytest.approx(6 / WINDOW_S, abs=1e-3)
    clock.t += WINDOW_S + 1  # the drafts leave the window; the totals stay
    spec = rec.snapshot()["speculative"]
    assert spec["draft_tokens"] == 0 and spec["acceptance_rate"] is None
    assert (spec["total_draft_tokens"], spec["total_accepted_tokens"]) == (12, 6)
