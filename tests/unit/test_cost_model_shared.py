"""Shared decode keys (`decode_context_shared`): decode rows re-reading blocks an earlier row of the
step read, counted from the tables, fitted, calibrated, priced by the simulator."""

from __future__ import annotations

import random

import pytest
from benchmark_scripts import load_benchmark

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.clock import VirtualClock
from cadence.executor.cost_model import SimExecutor, StepCostModel, StepFeatures, default_profile_path
from cadence.executor.step_log import StepLog, read_step_log
from cadence.request import SamplingParams
from cadence.sched import features
from cadence.sched.adaptive import Candidate, choose_ks
from cadence.sched.features import shared_decode_keys, shared_keys_by_row

SP = SamplingParams(max_tokens=8)
BS = 16


def _dec(rid: str, ctx: int, table: tuple[int, ...]) -> ScheduledRequest:
    """A decode row whose context (after this step) is `ctx` tokens."""
    return ScheduledRequest(rid, (5,), ctx - 1, table, True, SP)


def _out(*rows: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(step=1, scheduled=rows)


def _shared(*rows: ScheduledRequest) -> int:
    return StepFeatures.from_output(_out(*rows), BS).decode_context_shared


def test_distinct_tables_share_nothing_and_one_row_shares_nothing() -> None:
    assert _shared(_dec("a", 64, (0, 1, 2, 3)), _dec("b", 64, (4, 5, 6, 7))) == 0
    assert _shared(_dec("a", 64, (0, 1, 2, 3))) == 0
    # Without the block size nothing is counted (the tables' token spans are unknown).
    assert StepFeatures.from_output(_out(_dec("a", 64, (0, 1, 2, 3)), _dec("b", 64, (0, 1, 2, 3)))).decode_context_shared == 0


def test_rows_sharing_a_prefix_count_every_later_rows_shared_tokens() -> None:
    common = (10, 11, 12)  # 48 tokens
    rows = [_dec(f"d{i}", 60, (*common, 20 + i)) for i in range(4)]
    f = StepFeatures.from_output(_out(*rows), BS)
    assert f.decode_context_shared == 3 * 48  # the first row reads them once, the other three re-read
    assert f.decode_context == 4 * 60  # every key still counts as read
    assert shared_keys_by_row(((60, r.block_table) for r in rows), BS) == [0, 48, 48, 48]


def test_rows_sharing_partly() -> None:
    a = _dec("a", 64, (0, 1, 2, 3))
    b = _dec("b", 50, (0, 1, 9, 8))  # shares blocks 0 and 1 with a: 32 tokens
    c = _dec("c", 40, (7, 9, 2))  # shares 9 with b (16) and 2 with a (its last block: 8 of its tokens)
    d = _dec("d", 20, (5, 3, 3, 3))  # 3 covers tokens 16..19 (4 tokens); the blocks past its context do not count
    assert _shared(a, b, c, d) == 32 + 16 + 8 + 4
    # Order matters: the first reader of a block pays in full; a later one counts its own tokens
    # in it (a reads all 16 of block 2, of which c read 8).
    assert _shared(c, b, a, d) == 16 + (32 + 16) + 4


def test_blocks_past_a_rows_context_are_not_seen_and_chunks_are_not_decodes() -> None:
    a = _dec("a", 16, (0, 1))  # holds block 1 but its context lies in block 0
    b = _dec("b", 32, (2, 1))
    assert _shared(a, b) == 0
    chunk = ScheduledRequest("p", (1,) * 8, 0, (2, 1), True, SP)  # a prompt chunk over b's blocks
    assert _shared(chunk, b) == 0 and _shared(b, chunk) == 0
    assert shared_decode_keys((b, chunk, _dec("c", 32, (2, 1))), BS) == 32


TRUTH = {"const": 0.004, "prefill_tokens": 3e-5, "prefill_seqs": 1e-4, "decode_seqs": 4e-4, "sampled": 2e-4,
         "decode_context_own": 3e-7, "decode_context_shared": 1e-7, "decode_padded": 0.0, "prefill_attention": 1e-9}


def _synthetic(n: int, seed: int) -> list[tuple[StepFeatures, float]]:
    """Decode batches, half of them sharing a prefix, some with a prompt chunk, priced by TRUTH."""
    rng = random.Random(seed)
    truth = StepCostModel("padded+context+shared", TRUTH)
    out = []
    for _ in range(n):
        b = rng.randint(1, 32)
        ctx = rng.randint(64, 2048)
        common = tuple(range(10_000, 10_000 + rng.randint(0, ctx // BS - 1))) if rng.random() < 0.5 else ()
        rows = []
        for i in range(b):
            own = -(-ctx // BS) - len(common)
            rows.append(_dec(f"d{i}", ctx + rng.randint(0, 15) * (not common),
                             common + tuple(range(i * 1000, i * 1000 + own + 1))))
        if rng.random() < 0.4:
            rows.append(ScheduledRequest("p", (1,) * rng.choice((16, 128, 512)), rng.choice((0, 512)), (), True, SP))
        f = StepFeatures.from_output(_out(*rows), BS)
        out.append((f, truth.predict(f)))
    return out


def test_fit_recovers_the_shared_weight() -> None:
    samples = _synthetic(200, 3)
    assert sum(f.decode_context_shared > 0 for f, _ in samples) > 50
    model = StepCostModel.fit(samples, seed=0)
    assert model.feature_set == "padded+context+shared"
    assert model.coefficients["decode_context_shared"] == pytest.approx(TRUTH["decode_context_shared"], rel=1e-6)
    assert model.coefficients["decode_context_own"] == pytest.approx(TRUTH["decode_context_own"], rel=1e-6)
    cands = model.fit_report["candidates"]
    assert cands["padded+context"]["heldout_mape"] > 10 * max(cands["padded+context+shared"]["heldout_mape"], 1e-9)


def test_without_shared_steps_the_fit_offers_no_set_pricing_them() -> None:
    """A sweep whose rows never share a block cannot measure a re-read key: the set pricing them
    apart would tie with the one without them, and is not a candidate."""
    samples = [(f, s) for f, s in _synthetic(200, 4) if not f.decode_context_shared]
    model = StepCostModel.fit(samples, seed=0)
    assert "padded+context+shared" not in model.fit_report["candidates"]
    assert "padded+context" in model.fit_report["candidates"] and not model.prices_shared_context


def test_sim_executor_prices_shared_keys_as_the_model_does() -> None:
    model = StepCostModel("padded+context+shared", TRUTH)
    assert model.prices_shared_context
    ex = SimExecutor(model, clock=VirtualClock())
    common = tuple(range(60))
    shared = _out(*(_dec(f"d{i}", 1024, (*common, 100 + 4 * i, 101 + 4 * i, 102 + 4 * i, 103 + 4 * i))
                    for i in range(16)))
    distinct = _out(*(_dec(f"d{i}", 1024, tuple(range(1000 + 64 * i, 1064 + 64 * i))) for i in range(16)))
    with pytest.raises(RuntimeError, match="block size"):
        ex.execute(shared)
    ex.initialize_kv_cache(4096, BS)
    ex.execute(shared)
    assert ex.last_step_cost == pytest.approx(model.cost(shared, BS), rel=1e-12)
    ex.execute(distinct)
    assert ex.last_step_cost == pytest.approx(model.cost(distinct, BS), rel=1e-12)
    # 15 rows x 960 tokens re-read, each at the shared price instead of the own one.
    gap = 15 * 960 * (TRUTH["decode_context_own"] - TRUTH["decode_context_shared"])
    assert model.cost(distinct, BS) - model.cost(shared, BS) == pytest.approx(gap, rel=1e-9)


def test_the_shipped_profile_never_counts_shared_keys(monkeypatch) -> None:
    """Its feature set has no shared term: the simulator's steps skip the second pass over the
    tables, and its prices are what they were."""
    shipped = StepCostModel.load(default_profile_path())
    assert not shipped.prices_shared_context

    def refuse(*args: object) -> int:
        raise AssertionError("counted shared keys for a model that does not price them")

    monkeypatch.setattr("cadence.executor.cost_model.shared_decode_keys", refuse)
    ex = SimExecutor(shipped, clock=VirtualClock())
    ex.initialize_kv_cache(4096, BS)
    out = _out(*(_dec(f"d{i}", 64, (0, 1, 2, 3)) for i in range(4)))
    ex.execute(out)
    assert ex.last_step_cost == shipped.predict(StepFeatures.from_output(out))


def test_calibration_sweeps_decode_batches_sharing_a_prefix() -> None:
    from cadence.sim.calibrate import Shape, _output, fits, sweep_shapes

    for quick in (False, True):
        shapes = [s for s in sweep_shapes(64, 512, 4096, quick=quick) if s.shared_prefix]
        assert len(shapes) >= 2 and all(len(set(s.decode_contexts)) == 1 for s in shapes)
        assert all(0 < s.shared_prefix < s.decode_contexts[0] for s in shapes)
    full = sweep_shapes(64, 512, 4096)
    assert {(len(s.decode_contexts), s.decode_contexts[0], s.shared_prefix) for s in full if s.shared_prefix} >= {
        (16, 1024, 960), (32, 640, 512), (8, 2048, 1920)}  # the measured shapes (docs/simulator.md)
    assert not any(s.shared_prefix for s in sweep_shapes(4, 512, 4096))  # capped by max_num_seqs

    shape = Shape(decode_contexts=(100, 100, 100), shared_prefix=70)  # 4 whole blocks of 16 shared
    assert fits(shape, BS, 3 * 3 + 4) and not fits(shape, BS, 3 * 3 + 3)
    out = _output(shape, BS, 1000, 50, random.Random(0))
    tables = [r.block_table for r in out.scheduled]
    assert all(len(t) == 7 for t in tables)  # ceil(100 / 16)
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # one run of blocks at every table's head
    own = [b for t in tables for b in t[4:]]
    assert len(set(own)) == len(own) and not set(own) & set(tables[0][:4])
    assert StepFeatures.from_output(out, BS).decode_context_shared == 2 * 64


def test_step_log_records_shared_keys(tmp_path) -> None:
    log = StepLog(tmp_path / "steps.jsonl", BS)
    out = _out(*(_dec(f"d{i}", 40, (0, 1, 10 + i)) for i in range(3)))
    log(out, 0.01)
    log.close()
    [(f, seconds)] = read_step_log(tmp_path / "steps.jsonl")
    assert f.decode_context_shared == 2 * 32 and seconds == 0.01


def test_adaptive_k_prices_the_step_with_its_shared_keys() -> None:
    """Beside a prompt chunk a verification row is a chunk: it leaves the decode rows with its
    shared keys, and the step the candidate's drafts are priced against keeps the others'. Beside
    decodes only its drafts are decode rows after the candidate's, re-reading its blocks: keys
    they add to the shared ones."""
    seen: list[StepFeatures] = []

    def cost(f: StepFeatures) -> float:
        seen.append(f)
        return 0.01 + 1e-3 * (f.prefill_tokens + f.decode_seqs)

    decodes = dict(decode_seqs=3, sampled=3, decode_context=300, decode_padded=300, decode_context_shared=160)
    chunk = StepFeatures(prefill_tokens=8, prefill_seqs=1, **decodes)
    choose_ks(chunk, [Candidate("b", 99, 2, 0.9, shared=80)], cost, 8, BS)
    assert seen[0].decode_context_shared == 160 and seen[1].decode_context_shared == 160
    assert {f.decode_context_shared for f in seen[2:]} == {80}
    seen.clear()
    choose_ks(StepFeatures(**decodes), [Candidate("b", 99, 2, 0.9, shared=80)], cost, 8, BS)
    # Draft rows at contexts 101 and 102: every key of theirs is in the 7 blocks of 16 the
    # candidate's context of 100 (and the draft row before) already read.
    assert [f.decode_context_shared for f in seen[2:]] == [160 + 101, 160 + 101 + 102]
    assert [f.decode_seqs for f in seen[2:]] == [4, 5]
    assert "decode_context_shared" in features.BASES


def test_the_benchmark_times_steps_that_differ_only_in_shared_keys() -> None:
    bench = load_benchmark("shared_context")
    rng = random.Random(0)
    first = bench.blocks_needed(16, 1024, 0, BS)
    distinct = bench.decode_step(16, 1024, 0, BS, 0, rng, 100)
    shared = bench.decode_step(16, 1024, 960, BS, first, rng, 100)
    assert max(b for r in distinct.scheduled for b in r.block_table) < first  # the two steps share no block
    assert max(b for r in shared.scheduled for b in r.block_table) < first + bench.blocks_needed(16, 1024, 960, BS)
    a, b = StepFeatures.from_output(distinct, BS), StepFeatures.from_output(shared, BS)
    assert (a.decode_context_shared, b.decode_context_shared) == (0, 15 * 960)
    assert a.to_dict() | {"decode_context_shared": 0} == b.to_dict() | {"decode_context_shared": 0}
