"""P/D fleets in the simulator (sim/disagg.py): the transfer's arithmetic, latencies by hand,
decode-side prefix hits, the decode KV budget under a burst, and the CLI's flags."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel
from cadence.sim.disagg import PDSimulator
from cadence.sim.pd import PDOptions, transfer_bytes, transfer_seconds
from cadence.sim.simulator import SimOptions
from cadence.workload import Workload, WorkloadRequest, assign_arrivals, builtin_workload

ROOT = Path(__file__).resolve().parents[2]
KVB = 1000  # KV bytes per token of the test profiles
META = {"kv_bytes_per_token": KVB, "max_model_len": 8192}
STEP = 0.1
CONST = StepCostModel("tokens", {"const": STEP}, META)  # every step costs 100 ms, whatever it holds


def _wr(t: float, prompt: int = 10, out: int = 3, **kw) -> WorkloadRequest:
    return WorkloadRequest(arrival_time=t, prompt_tokens=prompt, output_tokens=out, **kw)


def _pd(reqs, pd: PDOptions, model: StepCostModel = CONST, block: int = 16, num_kv_blocks: int = 2048,
        on_step=None, **opts):
    config = EngineConfig.from_options(num_kv_blocks=num_kv_blocks, prefix_caching_hash_algo="builtin")
    sim = PDSimulator(config, model, SimOptions(**opts), pd, on_step=on_step)
    return sim, sim.run(Workload("t", tuple(reqs), prefix_block_tokens=block))


def test_transfer_arithmetic() -> None:
    # 100 tokens in blocks of 16: 7 blocks, the partial last one whole.
    assert transfer_bytes(100, 0, 16, 1000) == 7 * 16 * 1000
    assert transfer_bytes(100, 3, 16, 1000) == 4 * 16 * 1000  # resident blocks do not travel
    assert transfer_bytes(96, 6, 16, 1000) == 0
    assert transfer_bytes(96, 9, 16, 1000) == 0  # never negative
    assert transfer_seconds(25 * 10**9, 25.0, 1.0) == pytest.approx(1.001)
    assert transfer_seconds(0, 25.0, 2.5) == pytest.approx(0.0025)  # latency alone
    # An 8B Llama's 128 KiB per token: a 2,000-token prompt is 262 MB, 10.5 ms at 25 GB/s.
    assert transfer_seconds(transfer_bytes(2000, 0, 16, 131072), 25.0, 0.0) == pytest.approx(0.0104858, rel=1e-4)
    with pytest.raises(ValueError, match="kv_transfer_bandwidth"):
        PDOptions(1, 1, kv_transfer_bandwidth=0).validate()
    with pytest.raises(ValueError, match="decode_replicas"):
        PDOptions(1, 0).validate()


def test_latencies_by_hand() -> None:
    # 16,000 bytes per block at 0.016 GB/s is 1 ms on the wire, + 9 ms latency: 10 ms a block.
    pd = PDOptions(1, 1, kv_transfer_bandwidth=0.016, kv_transfer_latency_ms=9.0)
    # A (10 tokens, one partial block) prefills in [0, .1]: its first token at .1, from the prefill
    # replica. Its block lands at .11; the decode replica computes its 10 tokens and the first token
    # in [.11, .21] (the partial block is not a prefix-cache block) and decodes in [.21, .31].
    # B (32 tokens: two full blocks) arrives at 10: prefill [10, 10.1], two blocks (2 ms + 9 ms) land
    # at 10.111, and the decode replica hits both, so its first step is a decode: [10.111, 10.211].
    sim, res = _pd([_wr(0.0), _wr(10.0, prompt=32)], pd)
    a, b = res.records
    assert list(a.token_times) == pytest.approx([0.1, 0.21, 0.31])
    assert list(b.token_times) == pytest.approx([10.1, 10.211, 10.311])
    assert (a.ttft, b.ttft) == pytest.approx((0.1, 0.1))
    assert all(r.ok and r.output_tokens == 3 and r.finish_reason == "length" for r in res.records)
    t = res.transfers
    assert t["transfers"] == 2 and t["bytes_total"] == (1 + 2) * 16 * KVB
    assert sorted([t["seconds_p50"], t["seconds_p99"]]) == pytest.approx([0.0105, 0.011], abs=1e-4)
    assert res.pools == ["prefill", "decode"]
    prefill, decode = res.replicas
    assert (prefill.requests, decode.requests) == (2, 2)
    # The decode replica's lookups: A found nothing, B its two blocks (the reservations' own are left out).
    assert (decode.prefix_cache_queries, decode.prefix_cache_hits) == (11 + 33, 32)


def test_ttft_is_the_prefill_sides_and_the_transfer_delays_the_second_token() -> None:
    w = assign_arrivals(builtin_workload("chat", 60, seed=3), "poisson", 2.0, 3, 1.0)
    config = EngineConfig.from_options(num_kv_blocks=4096, prefix_caching_hash_algo="builtin")
    runs = {}
    for latency in (1.0, 2000.0):
        runs[latency] = PDSimulator(config, CONST, SimOptions(), PDOptions(2, 2, kv_transfer_latency_ms=latency)).run(w)
    fast, slow = runs[1.0].records, runs[2000.0].records
    assert all(r.ok and r.output_tokens == r.output_tokens_asked for r in fast + slow)
    assert [r.ttft for r in fast] == [r.ttft for r in slow]  # the first token never waits for the transfer
    for f, s in zip(fast, slow, strict=True):
        if f.output_tokens > 1:  # the second token waits for it: 2 s more
            gap_fast, gap_slow = f.token_times[1] - f.token_times[0], s.token_times[1] - s.token_times[0]
            assert gap_slow - gap_fast >= 1.999 - STEP


def test_the_first_token_comes_from_a_prefill_replica() -> None:
    ends: dict[str, set[float]] = {"prefill": set(), "decode": set()}
    holder: list[PDSimulator] = []

    def on_step(i: int, core, t: float) -> None:
        ends[holder[0].pool_of(i)].add(t)

    w = assign_arrivals(builtin_workload("long-prompt-mix", 40, seed=1), "poisson", 4.0, 1, 1.0)
    model = StepCostModel("tokens", {"const": 0.01, "num_tokens": 0.0005}, META)
    config = EngineConfig.from_options(num_kv_blocks=8192, prefix_caching_hash_algo="builtin")
    sim = PDSimulator(config, model, SimOptions(), PDOptions(2, 1), on_step=on_step)
    holder.append(sim)
    res = sim.run(w)
    assert all(r.ok for r in res.records)
    for r in res.records:
        assert r.first_token_time in ends["prefill"] and r.first_token_time not in ends["decode"]
        assert all(t in ends["decode"] for t in r.token_times[1:])


def test_decode_side_prefix_hits_skip_transfer_bytes() -> None:
    # shared-prefix: a 1,024-token system prompt (64 blocks of 16) before each question. One decode
    # replica: after the first request, every transfer finds those blocks there.
    w = assign_arrivals(builtin_workload("shared-prefix", 30, seed=2), "poisson", 1.0, 2, 1.0)
    config = EngineConfig.from_options(num_kv_blocks=8192, prefix_caching_hash_algo="builtin")
    res = PDSimulator(config, CONST, SimOptions(), PDOptions(1, 1)).run(w)
    assert all(r.ok for r in res.records)
    t = res.transfers
    whole = sum(transfer_bytes(r.prompt_tokens, 0, 16, KVB) for r in w.requests)
    assert t["resident_blocks_skipped"] >= 29 * 64
    assert t["bytes_total"] == whole - t["resident_blocks_skipped"] * 16 * KVB
    assert t["bytes_total"] < whole / 5


def test_a_burst_of_long_prompts_never_overruns_the_decode_kv_budget() -> None:
    # 24 prompts of 1,500 tokens at once on 4 prefill replicas and one decode replica of 400 blocks
    # running 2 requests at a time: each needs 95 blocks there, so at most 4 fit (2 running, 2 landed
    # and queued); the rest wait for decode admission. A landed request's blocks stay reserved until
    # the decode replica admits it, so no later transfer takes them.
    reqs = [_wr(0.0, prompt=1500, out=100) for _ in range(24)]
    gauges: list[tuple[int, int, int]] = []  # per decode step: preemptions, free blocks, total blocks
    holder: list[PDSimulator] = []

    def on_step(i: int, core, t: float) -> None:
        if holder[0].pool_of(i) == "decode":
            s = core.stats()
            gauges.append((core.last_stats.num_preemptions, s.num_free_blocks, s.num_total_blocks))

    model = StepCostModel("tokens", {"const": 0.01, "num_tokens": 0.0002}, META)
    config = EngineConfig.from_options(num_kv_blocks=400, prefix_caching_hash_algo="builtin", max_num_seqs=2)
    sim = PDSimulator(config, model, SimOptions(), PDOptions(4, 1), on_step=on_step)
    holder.append(sim)
    res = sim.run(Workload("burst", tuple(reqs), prefix_block_tokens=16))
    assert all(r.ok and r.output_tokens == 100 for r in res.records)
    assert res.transfers["waited_for_decode_admission"] >= 18  # the budget held them back
    assert gauges and all(free >= 0 and total == 400 for _, free, total in gauges)
    assert sum(p for p, _, _ in gauges) == 0  # no running request lost its blocks to a transfer
    decode = res.replicas[4]
    assert decode.preemptions == 0
    # Every transferred block was still there at admission: the decode side computed only each
    # prompt's last partial block and its first token.
    assert decode.prefix_cache_hits == 24 * (1500 // 16) * 16
    # Every block is back: the decode replica's cache holds no reservation and no request.
    kv = sim.replicas[4].core.kv
    assert kv.num_free_blocks == 400 and not kv.block_tables


def test_priority_goes_first_into_a_full_decode_replica() -> None:
    # 16 prompts end their prefills at once; the decode replica holds 4. The first 4 hand-offs (low
    # priority, 1) find room; of those left waiting for decode admission, the 8 high-priority ones
    # (0) go before the 4 low.
    reqs = [_wr(0.0, prompt=1500, out=40, priority=1) for _ in range(8)] + \
           [_wr(0.0, prompt=1500, out=40, priority=0) for _ in range(8)]
    model = StepCostModel("tokens", {"const": 0.01, "num_tokens": 0.0002}, META)
    _, res = _pd(reqs, PDOptions(16, 1), model=model, num_kv_blocks=400)
    assert all(r.ok for r in res.records)
    low, high = res.records[:8], res.records[8:]
    assert max(r.token_times[1] for r in high) < min(r.token_times[1] for r in low[4:])
    assert max(r.token_times[1] for r in low[:4]) < min(r.token_times[1] for r in high)


def test_deadline_travels_to_the_decode_side() -> None:
    # 200 output tokens at 100 ms a step cannot finish within 3 s: the decode replica ends it.
    sim, res = _pd([_wr(0.0, prompt=40, out=200, deadline=3.0), _wr(0.0, prompt=40, out=5)], PDOptions(1, 1))
    late, ok = res.records
    assert late.status == 408 and late.finish_reason == "deadline" and 2 < late.output_tokens < 200
    assert late.end_time == pytest.approx(3.0, abs=STEP + 1e-9)
    assert ok.ok and ok.output_tokens == 5


def test_prefix_caching_off_is_refused() -> None:
    config = EngineConfig.from_options(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        PDSimulator(config, CONST, SimOptions(), PDOptions(1, 1))


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cadence.cli", "sim", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill-replicas", "2"], "--prefill-replicas: a P/D fleet needs --decode-replicas too"),
    (["--decode-replicas", "2"], "--decode-replicas: a P/D fleet needs --prefill-replicas too"),
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "--prefill-replicas: must be >= 1"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-bandwidth", "nan"],
     "--kv-transfer-bandwidth: must be > 0 GB/s"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-latency", "-1"],
     "--kv-transfer-latency: must be >= 0 ms"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"], "--replicas: give either"),
    (["--profile", "no-such-profile"], "--profile no-such-profile: no such file or shipped profile"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--no-enable-prefix-caching"],
     "enable_prefix_caching: a decode replica takes the transferred KV as prefix-cache blocks"),
    (["plan", "--slo", "ttft_p95=1", "--disaggregate", "--no-enable-prefix-caching"],
     "--disaggregate: a decode replica takes the transferred KV as prefix-cache blocks"),
    (["plan", "--slo", "ttft_p95=1", "--disaggregate", "--kv-transfer-bandwidth", "-2"],
     "--kv-transfer-bandwidth: must be > 0 GB/s"),
])
def test_cli_refuses_bad_flags(flags: list[str], message: str) -> None:
    action = flags[:1] if flags[:1] == ["plan"] else []
    proc = _cli(*action, "--workload", "chat", "--num-requests", "5", *flags[len(action):])
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_cli_reports_pools_and_transfers(tmp_path: Path) -> None:
    proc = _cli("--workload", "long-prompt-mix", "--num-requests", "30", "--rate", "2", "--prefill-replicas", "2",
                "--decode-replicas", "1", "--profile", "gpu-like-8b", "--kv-cache-memory", "4GiB",
                "--kv-transfer-bandwidth", "12.5", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "KV transfers: 30 (" in proc.stdout and "at 12.5 GB/s + 1 ms" in proc.stdout
    assert "synthetic, roofline arithmetic, not measured" in proc.stdout
    meta = json.loads((tmp_path / "summary.json").read_text())["meta"]
    assert [r["pool"] for r in meta["replica_stats"]] == ["prefill", "prefill", "decode"]
    d = meta["disaggregated"]
    assert d["prefill_replicas"] == 2 and d["decode_replicas"] == 1 and d["transfers"] == 30
    assert d["kv_transfer_bandwidth_gbps"] == 12.5 and d["bytes_total"] % (16 * 131072) == 0


def test_gpu_like_profile_is_the_rooflines_arithmetic() -> None:
    from cadence.sim.profile import shipped_profile
    from cadence.sim.roofline import H100_CLASS, LLAMA3_8B, roofline_profile

    shipped = json.loads(shipped_profile("gpu-like-8b").read_text())
    assert shipped == json.loads(json.dumps(roofline_profile()))
    assert shipped["synthetic"] is True and "not a measurement" in shipped["synthetic_note"]
    assert LLAMA3_8B.kv_bytes_per_token == 131072  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    c = shipped["cost_model"]["coefficients"]
    assert c["const"] == pytest.approx(16.06e9 / (3.35e12 * 0.8), rel=1e-3)  # ~6 ms: the weights once
    assert c["prefill_tokens"] == pytest.approx(2 * 8.03e9 / (989e12 * 0.5), rel=1e-3)  # ~32 us a token
    assert H100_CLASS.memory_efficiency == 0.8
    model = StepCostModel.load(shipped_profile("gpu-like-8b"))
    assert model.kv_bytes_per_token == 131072


def test_pd_options_are_read_from_the_flags() -> None:
    from cadence.sim.cli import pd_options

    args = argparse.Namespace(prefill_replicas=3, decode_replicas=5, kv_transfer_bandwidth=50.0,
                              kv_transfer_latency=0.2, replicas_given=False)
    assert pd_options(args) == PDOptions(3, 5, 50.0, 0.2)
    args.prefill_replicas = args.decode_replicas = None
    assert pd_options(args) is None


# -- sim plan --disaggregate ------------------------------------------------------------------------


def test_pd_splits_try_every_split_of_a_small_fleet_and_shares_of_a_large_one() -> None:
    from cadence.sim.plan import pd_splits

    assert pd_splits(1) == [] and pd_splits(2) == [1] and pd_splits(5) == [1, 2, 3, 4]
    assert pd_splits(64) == [8, 16, 21, 32, 43, 48, 56]
    assert pd_splits(9) == [1, 2, 3, 4, 6, 7, 8]


def test_plan_finds_the_cheapest_colocated_and_pd_fleets() -> None:
    from cadence.sim.plan import Objective, format_plan, plan

    # Long prompts beside steady decodes: on a colocated replica each 3,000-token prompt's chunks
    # stretch the decodes' steps, so ITL p99 needs many replicas; split, it needs few.
    rng = random.Random(0)
    reqs = [_wr(i * 0.1, prompt=3000 if rng.random() < 0.3 else 50, out=100) for i in range(120)]
    w = Workload("mix", tuple(reqs), prefix_block_tokens=16)
    model = StepCostModel("tokens", {"const": 0.005, "num_tokens": 0.00005}, META)
    config = EngineConfig.from_options(num_kv_blocks=4096, prefix_caching_hash_algo="builtin")
    objectives = [Objective.parse("ttft_p95=1.0"), Objective.parse("itl_p99=0.02")]
    result = plan(w, config, model, objectives, max_replicas=8, disaggregate=PDOptions(1, 1))
    assert result.best is not None and result.pd_best is not None and result.pd_best.split is not None
    assert result.pd_best.meets and sum(result.pd_best.split) == result.pd_best.replicas
    # Nothing cheaper meets the SLOs: every P/D trial with fewer replicas failed.
    assert all(not t.meets for t in result.trials if t.split and t.replicas < result.pd_best.replicas)
    assert all(not t.meets for t in result.trials if not t.split and t.replicas < result.best.replicas)
    text = format_plan(result)
    assert f"cheapest colocated: {result.best.replicas} replicas" in text
    p, d = result.pd_best.split
    assert f"cheapest P/D: {p} prefill + {d} decode = {p + d} replicas" in text
    assert (result.best.replicas, result.pd_best.split) == (5, (1, 1))
    assert "disaggregate: yes (2 P/D replicas against 5 colocated)" in text


def test_cli_plan_disaggregate_prints_both(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "cadence.cli", "sim", "plan", "--workload", "chat", "--num-requests",
                           "40", "--rate", "2", "--slo", "ttft_p95=5", "--max-replicas", "4", "--disaggregate"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "cheapest colocated: " in out and "cheapest P/D: " in out and "disaggregate: " in out
    assert "1P1D (engine options as given)" in out
    refused = subprocess.run([sys.executable, "-m", "cadence.cli", "sim", "plan", "--workload", "chat", "--slo",
                              "ttft_p95=5", "--prefill-replicas", "1"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "--prefill-replicas: `cadence sim plan --disaggregate` searches" in refused.stderr


# -- the docs' figure ---------------------------------------------------------------------------------


def test_sim_pd_figure_runs_and_makes_the_docs_table(tmp_path: Path) -> None:
    fig = load_benchmark("figures", "figures_for_pd")
    out = tmp_path / "sim_pd"
    proc = subprocess.run([sys.executable, "benchmarks/sim_pd.py", "--out", str(out), "--sizes", "2",
                           "--requests-per-replica", "10", "--trace-requests", "20"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "rows.json").read_text())
    # Two workloads, each colocated (two chunk sizes) and 1P1D (the only split of 2).
    fleets = ["colocated", "colocated, 512-token chunks", "1P1D"]
    assert [(r["workload"], r["fleet"]) for r in rows] == [(w, f) for w in ("long-prompt-mix", "azure code") for f in fleets]
    assert all(r["completed"] == r["requests"] for r in rows)
    assert rows[0]["transfer_bytes_mean"] is None and rows[2]["transfer_bytes_mean"] > 0
    table = fig.BY_NAME["sim-pd"].format(out)
    doc = (ROOT / "docs" / "fleet.md").read_text()
    start = doc.index("<!-- figure: sim-pd -->")
    block = doc[start:doc.index("<!-- /figure -->", start)].splitlines()[1:3]
    assert table.splitlines()[:2] == block  # the doc's table has the formatter's columns
    assert "| long-prompt-mix | 2 | 1P1D |" in table


def test_a_full_decode_queue_refuses_like_the_server_and_frees_the_reservation() -> None:
    # 8 prefills end at once; the decode replica admits 2 at a time and queues at most 1 more: the
    # others are refused with the 429 a server's full queue answers, and their blocks come back.
    reqs = [_wr(0.0, prompt=40, out=50) for _ in range(8)]
    config = EngineConfig.from_options(num_kv_blocks=2048, prefix_caching_hash_algo="builtin", max_num_seqs=2,
                                       max_queue_len=1)
    sim = PDSimulator(config, CONST, SimOptions(), PDOptions(8, 1))
    res = sim.run(Workload("full", tuple(reqs), prefix_block_tokens=16))
    ok = [r for r in res.records if r.ok]
    refused = [r for r in res.records if not r.ok]
    assert ok and refused and len(ok) + len(refused) == 8
    assert all(r.status == 429 and r.error.startswith("queue_full") and r.output_tokens == 1 for r in refused)
    assert res.transfers["refused_by_decode"] == len(refused)
    kv = sim.replicas[8].core.kv
    assert kv.num_free_blocks == 2048 and not kv.block_tables
