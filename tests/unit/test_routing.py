"""The fleet's routing function (cadence.routing), shared by `cadence sim` and the Ray Serve fleet."""

from __future__ import annotations

from collections import Counter

import pytest

from cadence.config import EngineConfig
from cadence.kv.hashing import hash_full_blocks
from cadence.kv.manager import KVCacheManager
from cadence.request import Request, SamplingParams
from cadence.routing import (
    ReplicaStats,
    Router,
    RoutingConfig,
    choose,
    decide,
    fingerprint,
    fingerprints,
    matched_blocks,
    prefix_affinity,
    unbalanced,
)
from cadence.sim.profile import default_profile_path
from cadence.sim.simulator import SimOptions, Simulator
from cadence.workload import assign_arrivals, builtin_workload


def _stats(*loads: int, digests: tuple[frozenset[int], ...] = ()) -> list[ReplicaStats]:
    digests = digests or tuple(frozenset() for _ in loads)
    return [ReplicaStats(running=n, waiting=0, free_blocks=100, digest=d) for n, d in zip(loads, digests, strict=True)]


def test_round_robin_and_least_loaded() -> None:
    rr = Router("round-robin")
    assert [rr.route((), _stats(5, 0, 0)) for _ in range(4)] == [0, 1, 2, 0]
    assert choose("least-loaded", (), _stats(3, 1, 2)) == 1
    ll = Router("least-loaded")  # ties rotate: an idle fleet spreads
    assert [ll.route((), _stats(0, 0, 0)) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="router"):
        Router("random")
    # The loads-only path chooses as `route` does.
    for policy in ("round-robin", "least-loaded"):
        a, b = Router(policy), Router(policy)
        for loads in ([0, 0, 0], [2, 1, 1], [1, 1, 1], [0, 3, 0], [5, 5, 4]):
            assert a.route((), _stats(*loads)) == b.route_by_load(loads)
    with pytest.raises(ValueError, match="prefix-affinity"):
        Router("prefix-affinity").route_by_load([0, 0])


def test_match_is_the_longest_cached_prefix_never_a_later_block_alone() -> None:
    chain = (1, 2, 3, 4)
    assert matched_blocks(chain, {1, 2, 3, 4}) == 4
    assert matched_blocks(chain, {1, 2, 4}) == 2
    assert matched_blocks(chain, {2, 3, 4}) == 0  # a later block is worthless without its prefix
    assert matched_blocks(chain, set(), {1: 0, 2: 0, 3: 1}, replica=0) == 2  # sent there lately


def test_affinity_follows_the_longest_prefix_among_several_families() -> None:
    # Three families share their first block (a system prompt) and differ after it; each replica
    # holds one family. A request goes where its whole family prefix is, not where the shared block is.
    system = 7
    fam = {f: (system, *(100 * f + k for k in range(10))) for f in range(3)}
    digests = tuple(frozenset(fam[f]) for f in range(3))
    for f in range(3):
        for start in range(3):
            assert prefix_affinity(fam[f] + (999,), _stats(0, 0, 0, digests=digests), start) == f
    # A request with only the system block cached anywhere: least loaded.
    assert prefix_affinity((system, 5, 6), _stats(3, 1, 2, digests=digests)) == 1


def test_load_term_and_the_guard() -> None:
    cfg = RoutingConfig(load_weight=2.0, balance_abs=10, balance_rel=1.5)
    chain = tuple(range(1, 11))  # 10 blocks, all on replica 0
    digests = (frozenset(chain), frozenset(), frozenset())
    assert prefix_affinity(chain, _stats(4, 0, 0, digests=digests), cfg=cfg) == 0  # 10 - 2*4 > 0
    assert prefix_affinity(chain, _stats(6, 0, 0, digests=digests), cfg=cfg) == 1  # 10 - 2*6 < 0
    # The guard: beyond both thresholds, least loaded whatever the hit.
    no_load = RoutingConfig(load_weight=0.0, balance_abs=10, balance_rel=1.5)
    assert prefix_affinity(chain, _stats(12, 1, 2, digests=digests), cfg=no_load) == 1
    assert prefix_affinity(chain, _stats(11, 1, 2, digests=digests), cfg=no_load) == 0  # (11 - 1 is not > 10)
    assert not unbalanced([40, 30], RoutingConfig(balance_abs=5, balance_rel=1.5))  # relative threshold holds it
    assert unbalanced([100, 30], RoutingConfig(balance_abs=64, balance_rel=1.5))


def test_each_decision_says_what_decided_it() -> None:
    cfg = RoutingConfig(load_weight=2.0, balance_abs=10, balance_rel=1.5)
    chain = tuple(range(1, 11))  # 10 blocks, all on replica 0
    digests = (frozenset(chain), frozenset(chain[:4]), frozenset())

    def why(*loads: int, policy: str = "prefix-affinity", c: tuple[int, ...] = chain) -> tuple[int, str, tuple]:
        d = decide(policy, c, _stats(*loads, digests=digests), cfg=cfg)
        return d.replica, d.outcome, d.hits

    assert why(0, 0, 0) == (0, "prefix", (10, 4, 0))
    assert why(2, 0, 0) == (0, "prefix", (10, 4, 0))  # 10 - 2*2 = 6 > 4 - 0
    assert why(4, 0, 0) == (1, "diverted", (10, 4, 0))  # 10 - 2*4 = 2 < 4 - 0: the load term sends it on
    assert why(12, 1, 2)[:2] == (1, "unbalanced")  # the guard, whatever the hit
    assert why(0, 0, 0, c=(900, 901)) == (0, "no-prefix", (0, 0, 0))
    assert why(0, 0, 0, c=()) == (0, "no-prefix", ())
    assert why(0, 0, 0, policy="round-robin")[1] == why(3, 0, 0, policy="least-loaded")[1] == "load"
    assert choose("prefix-affinity", chain, _stats(6, 0, 0, digests=digests), cfg=cfg) == 1


def test_router_counts_and_logs_its_decisions(caplog: pytest.LogCaptureFixture) -> None:
    router = Router("prefix-affinity")
    chain = tuple(range(1, 11))
    digests = (frozenset(chain), frozenset())
    with caplog.at_level("DEBUG", logger="cadence.routing"):
        assert router.route(chain, _stats(0, 0, digests=digests), ids=["r-a", "r-b"]) == 0
        assert router.route((50, 51), _stats(0, 1, digests=digests), ids=["r-a", "r-b"]) == 0
    assert router.decisions == Counter({"prefix": 1, "no-prefix": 1})
    assert caplog.messages[0] == "route 10 blocks -> r-a (prefix); loads {'r-a': 0, 'r-b': 0}, cached blocks {'r-a': 10, 'r-b': 0}"
    assert caplog.messages[1].startswith("route 2 blocks -> r-a (no-prefix)")
    rr = Router("round-robin")
    rr.route_by_load([0, 0])
    rr.route((), _stats(0, 0))
    assert rr.decisions == Counter({"load": 2})


def test_one_hot_prefix_spreads_over_the_fleet() -> None:
    # Every request opens with the same 64-block system prompt; each replica's load is what the
    # router sent it (nothing finishes). The old first-block affinity sent all of them to one replica.
    router = Router("prefix-affinity")
    system = tuple(range(64))
    loads = [0] * 32
    for i in range(320):
        chain = system + (10_000 + i,)
        held = frozenset(system) if i >= 32 else frozenset()  # (the digests of replicas that served it)
        r = router.route(chain, [ReplicaStats(n, 0, 100, held if n else frozenset()) for n in loads])
        loads[r] += 1
    assert max(loads) - min(loads) <= 64 / RoutingConfig().load_weight + 1
    assert min(loads) > 0


def test_router_remembers_where_it_sent_a_chain() -> None:
    # No digest has been published yet: the second request of a family still follows the first.
    router = Router("prefix-affinity")
    fam_a, fam_b = tuple(range(1, 20)), tuple(range(100, 120))
    first_a = router.route(fam_a + (500,), _stats(0, 0))
    first_b = router.route(fam_b + (501,), _stats(*[1 if i == first_a else 0 for i in range(2)]))
    assert first_a != first_b
    for k in range(5):
        assert router.route(fam_a + (600 + k,), _stats(1, 1)) == first_a
        assert router.route(fam_b + (700 + k,), _stats(1, 1)) == first_b
    router.forget_replica(first_a)
    assert router.route(fam_a + (800,), _stats(1, 0)) == 1


def test_stats_round_trip_and_fingerprints() -> None:
    s = ReplicaStats(3, 2, 17, frozenset({1, 2**63 + 5}))
    assert ReplicaStats.from_dict(s.to_dict()) == s and s.load == 5
    assert ReplicaStats.from_dict({}) == ReplicaStats()
    digest = hash_full_blocks(list(range(64)), 16)
    assert fingerprint(digest[0]) == int.from_bytes(digest[0][:8], "little")
    assert fingerprint(-12345) == -12345 and fingerprints([-1, 2]) == (-1, 2)  # builtin hashes as they are


def test_a_replicas_digest_matches_a_request_chain_hashed_at_the_ingress() -> None:
    # The KV manager publishes its cached hashes; a chain hashed elsewhere with the same function
    # and salt matches them block for block.
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(100, 118))  # 4 full blocks
    req = Request("a", prompt, SamplingParams(max_tokens=1), cache_salt="t1")
    assert kv.allocate_slots(req, len(prompt)) is not None
    req.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(req)
    digest = frozenset(fingerprints(kv.cached_hashes(1000)))
    same = fingerprints(hash_full_blocks(prompt[:12] + [1, 2, 3, 4, 5], 4, "t1"))
    other_tenant = fingerprints(hash_full_blocks(prompt, 4, "t2"))
    assert matched_blocks(same, digest) == 3
    assert matched_blocks(other_tenant, digest) == 0
    assert len(kv.cached_hashes(2)) == 2


def test_simulated_hot_system_prompt_is_not_piled_onto_one_replica() -> None:
    # Every request opens with the same 1024-token system prompt, 32 replicas with small queues:
    # first-block affinity sent everything to one replica and refused most requests.
    from cadence.executor.cost_model import StepCostModel

    model = StepCostModel.load(default_profile_path())
    w = assign_arrivals(builtin_workload("shared-prefix", 600, 0), "poisson", 40.0, 0)
    cfg = EngineConfig.from_options(max_num_seqs=32, max_queue_len=64, prefix_caching_hash_algo="builtin")
    aff = Simulator(cfg, model, SimOptions(replicas=32, router="prefix-affinity")).run(w)
    ll = Simulator(cfg, model, SimOptions(replicas=32, router="least-loaded")).run(w)
    assert all(r.ok for r in aff.records)
    used = Counter(r.index for r in aff.replicas if r.requests)
    assert len(used) >= 8 and max(r.requests for r in aff.replicas) < 0.1 * len(w.requests)

    def hit_rate(res) -> float:
        return sum(r.prefix_cache_hits for r in res.replicas) / sum(r.prefix_cache_queries for r in res.replicas)

    assert hit_rate(aff) >= hit_rate(ll)
    # What decided each choice: the hot prefix is everywhere, so the load term sends requests on.
    assert sum(aff.routing.values()) == len(w.requests) and aff.routing["diverted"] > 0, aff.routing
    assert ll.routing == {"load": len(w.requests)}
    assert set(aff.routing) == {"prefix", "diverted", "unbalanced", "no-prefix"}  # (0 where none came)


def test_sim_reports_its_routing_decisions(tmp_path, capsys) -> None:
    import json

    from cadence.cli import main

    argv = ["sim", "--workload", "shared-prefix", "--num-requests", "24", "--rate", "8", "--replicas", "2",
            "--router", "prefix-affinity", "--seed", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    decided = json.loads((tmp_path / "summary.json").read_text())["meta"]["routing_decisions"]
    assert sum(decided.values()) == 24 and set(decided) == {"prefix", "diverted", "unbalanced", "no-prefix"}
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("routing (prefix-affinity): "))
    assert f"{decided.get('prefix', 0)} to a replica with the longest cached prefix" in line
    assert f"{decided.get('diverted', 0)} diverted by load" in line


def test_serve_log_level_reaches_cadences_own_loggers() -> None:
    """`cadence serve --log-level debug` shows the routing decisions (`cadence.routing`), not only
    uvicorn's lines: the level is set on the `cadence` loggers before the command runs."""
    import logging

    from cadence.cli import main

    logger = logging.getLogger("cadence")
    was = logger.level
    try:
        assert main(["serve", "--log-level", "debug", "--max-num-seqs", "0"]) == 2  # (stops at the bad value)
        assert logging.getLogger("cadence.routing").isEnabledFor(logging.DEBUG)
        assert main(["serve", "--log-level", "warning", "--max-num-seqs", "0"]) == 2
        assert not logging.getLogger("cadence.routing").isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(was)
