"""The simulator: virtual time by hand, routers, prefix sharing, determinism, scale."""

from __future__ import annotations

import pytest

from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel
from cadence.sim.simulator import SimOptions, Simulator
from cadence.sim.synth import PromptSynth
from cadence.workload import Workload, WorkloadRequest, assign_arrivals, builtin_workload

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}
STEP = 0.1
CONST = StepCostModel("tokens", {"const": STEP}, META)  # every step costs 100 ms, whatever it holds


def _wr(t: float, prompt: int = 10, out: int = 3, **kw) -> WorkloadRequest:
    return WorkloadRequest(arrival_time=t, prompt_tokens=prompt, output_tokens=out, **kw)


def _sim(reqs, model: StepCostModel = CONST, block: int = 16, **opts):
    config = EngineConfig.from_options(num_kv_blocks=opts.pop("num_kv_blocks", 2048))
    sim = Simulator(config, model, SimOptions(**opts))
    return sim.run(Workload("t", tuple(reqs), prefix_block_tokens=block))


def test_latencies_match_a_hand_computation() -> None:
    # A at 0: step 1 [0, .1] prefills it (first token at .1); B arrives mid-step at .05, joins
    # step 2 [.1, .2] beside A's decode; A ends at .3 (3 tokens), B at .4. C at 10 finds the
    # engine idle: the clock jumps to 10 and C's first token comes one step later.
    res = _sim([_wr(0.0), _wr(0.05), _wr(10.0)])
    a, b, c = res.records
    assert a.token_times == pytest.approx([0.1, 0.2, 0.3])
    assert b.token_times == pytest.approx([0.2, 0.3, 0.4])
    assert (a.ttft, b.ttft, c.ttft) == pytest.approx((0.1, 0.15, 0.1))
    assert (a.e2e, b.e2e, c.e2e) == pytest.approx((0.3, 0.35, 0.3))
    assert b.itls == pytest.approx([0.1, 0.1])
    assert (a.queue_time, b.queue_time, c.queue_time) == pytest.approx((0.0, 0.05, 0.0))
    assert all(r.ok and r.output_tokens == 3 and r.finish_reason == "length" for r in res.records)
    assert res.steps == 7 and res.virtual_s == pytest.approx(10.3)


def test_chunked_prefill_costs_one_step_per_chunk() -> None:
    # 1000 prompt tokens with the default 512-token budget: two prefill steps before the first token.
    res = _sim([_wr(0.0, prompt=1000, out=2)])
    assert res.records[0].ttft == pytest.approx(2 * STEP)


def test_costs_follow_the_model() -> None:
    per_token = StepCostModel("tokens", {"const": 0.01, "num_tokens": 0.001}, META)
    res = _sim([_wr(0.0, prompt=100, out=2)], model=per_token)
    assert res.records[0].token_times == pytest.approx([0.01 + 0.1, 0.01 + 0.1 + 0.011])


def test_over_long_prompt_is_refused_like_the_server_would() -> None:
    res = _sim([_wr(0.0, prompt=5000, out=10), _wr(0.0)], max_model_len=4096)
    assert res.records[0].status == 400 and "max_model_len" in res.records[0].error
    assert res.records[1].ok


def test_refusals_carry_the_status_the_server_answers_with() -> None:
    # One map serves both: the server's error table and the simulator read cadence.errors.HTTP_STATUS.
    from cadence.errors import HTTP_STATUS, ErrorKind
    from cadence.server.errors import ERROR_TABLE

    assert {k: ERROR_TABLE[k].status for k in ErrorKind} == HTTP_STATUS
    res = _sim([_wr(0.0, prompt=5000, out=10)], max_model_len=4096)
    assert res.records[0].status == ERROR_TABLE[ErrorKind.INVALID_REQUEST].status


def test_round_robin_spreads_evenly() -> None:
    res = _sim([_wr(i * 0.01) for i in range(9)], replicas=3, router="round-robin")
    assert [r.requests for r in res.replicas] == [3, 3, 3]


def test_least_loaded_avoids_the_busy_replica() -> None:
    # A long request pins replica 0; the short ones that follow should all go elsewhere.
    reqs = [_wr(0.0, out=200)] + [_wr(0.5 + i * 0.5, out=2) for i in range(6)]
    res = _sim(reqs, replicas=2, router="least-loaded")
    assert res.replicas[0].requests == 1 and res.replicas[1].requests == 6
    rr = _sim(reqs, replicas=2, router="round-robin")
    assert rr.replicas[0].requests == 4  # round robin ignores the load


def test_prefix_affinity_keeps_groups_together_and_hits_the_cache() -> None:
    # 8 documents, each asked about 6 times; prompts of 16 shared blocks plus a short question.
    reqs = [_wr(i * 0.05, prompt=16 * 16 + 8, out=4, prefix_group=tuple(1000 * b + i % 8 for b in range(16)))
            for i in range(48)]
    aff = _sim(reqs, replicas=3, router="prefix-affinity")
    rr = _sim(reqs, replicas=3, router="round-robin")
    hits = lambda res: sum(r.prefix_cache_hits for r in res.replicas)  # noqa: E731
    assert hits(aff) > hits(rr)
    # Each document's requests all landed on its home replica.
    per_replica = [r.requests for r in aff.replicas]
    assert sum(per_replica) == 48 and all(n % 6 == 0 for n in per_replica)


def test_synthesised_prompts_share_exactly_the_shared_blocks() -> None:
    s = PromptSynth(16, seed=0)
    a = s.prompt(0, _wr(0, prompt=40, prefix_group=(5, 6)))
    b = s.prompt(1, _wr(0, prompt=40, prefix_group=(5, 7)))
    c = s.prompt(2, _wr(0, prompt=40))
    d = s.prompt(3, _wr(0, prompt=40))
    assert len(a) == len(b) == 40
    assert a[:16] == b[:16] and a[16:32] != b[16:32]
    assert c[:3] != d[:3] and c[3:] != d[3:]  # unique tails differ from the first token on
    assert PromptSynth(16, seed=0).prompt(2, _wr(0, prompt=40)) == c  # deterministic


def test_same_seed_same_result() -> None:
    w = assign_arrivals(builtin_workload("mixed-tenants", 150, seed=4), "poisson", 30.0, seed=4)
    cm = StepCostModel("phases", {"const": 0.003, "prefill_tokens": 2e-5, "decode_seqs": 3e-4}, META)
    cfg = EngineConfig.from_options(num_kv_blocks=400, policy="priority")
    runs = [Simulator(cfg, cm, SimOptions(replicas=2, router="least-loaded")).run(w) for _ in range(2)]
    assert [r.to_dict() for r in runs[0].records] == [r.to_dict() for r in runs[1].records]
    assert len({r.tenant for r in runs[0].records}) == 4


def test_closed_loop_keeps_n_requests_in_flight() -> None:
    reqs = [_wr(None, out=5) for _ in range(10)]
    res = _sim(reqs, concurrency=2, closed_loop=True)
    assert all(r.ok for r in res.records)
    events = sorted([(r.send_time, 1) for r in res.records] + [(r.end_time, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == 2
    assert res.records[2].send_time == pytest.approx(res.records[0].end_time)  # sent when a user's last one ended


def test_open_loop_cap_delays_sends() -> None:
    res = _sim([_wr(0.0, out=5) for _ in range(4)], concurrency=1)
    sends = [r.send_time for r in res.records]
    assert sends == sorted(sends) and sends[1] == pytest.approx(res.records[0].end_time)
    assert all(r.scheduled_time == 0.0 for r in res.records)


def test_five_thousand_requests() -> None:
    w = assign_arrivals(builtin_workload("chat", 5000, seed=1), "poisson", 40.0, seed=1)
    cm = StepCostModel("phases", {"const": 0.004, "prefill_tokens": 2e-5, "decode_seqs": 2e-4}, META)
    res = Simulator(EngineConfig(), cm, SimOptions(replicas=2, router="least-loaded")).run(w)
    assert len(res.records) == 5000 and all(r.ok for r in res.records)
    assert sum(r.output_tokens for r in res.records) == sum(q.output_tokens for q in w.requests)
    assert sum(r.requests for r in res.replicas) == 5000


def test_builtin_block_hashes_simulate_the_same_run() -> None:
    """The simulator keys prefix-cache blocks by Python's hash() unless told otherwise; with shared
    prefixes, hits and preemptions in play, every record equals the SHA-256 run's."""
    from cadence.cli import build_parser
    from cadence.sim.cli import sim_engine_config

    reqs = [_wr(i * 0.02, prompt=3 * 16 + 8 + i % 5, out=4 + i % 7, prefix_group=(100 + i % 4, 200 + i % 4, 300 + i % 3))
            for i in range(120)]
    runs = {}
    for algo in ("sha256", "builtin"):
        config = EngineConfig.from_options(num_kv_blocks=16, max_num_seqs=8, prefix_caching_hash_algo=algo)
        runs[algo] = Simulator(config, CONST, SimOptions(replicas=2)).run(Workload("t", tuple(reqs), prefix_block_tokens=16))
    assert [r.to_dict() for r in runs["builtin"].records] == [r.to_dict() for r in runs["sha256"].records]
    assert sum(r.prefix_cache_hits for r in runs["builtin"].replicas) > 0
    assert sum(r.preemptions for r in runs["builtin"].replicas) > 0

    parser = build_parser()
    args = parser.parse_args(["sim", "--workload", "chat"])
    assert sim_engine_config(args).cache.prefix_caching_hash_algo == "builtin"
    args = parser.parse_args(["sim", "--workload", "chat", "--prefix-caching-hash-algo", "sha256"])
    assert sim_engine_config(args).cache.prefix_caching_hash_algo == "sha256"
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineConfig.from_options(prefix_caching_hash_algo="md5")
