"""Step-cost model: features, fitting, profile files, and the simulator's executors."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.clock import VirtualClock
from cadence.executor.cost_model import (
    BASES,
    FEATURE_SETS,
    RecordedStep,
    ReplayDivergence,
    ReplayExecutor,
    SimExecutor,
    StepCostModel,
    StepFeatures,
)
from cadence.request import SamplingParams

SP = SamplingParams(max_tokens=8)


def _sr(rid: str, n: int, start: int, sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(rid, tuple(range(1, n + 1)), start, (0,), sample, SP)


def _out(*rows: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(step=1, scheduled=rows)


TRUE = {"const": 0.004, "prefill_tokens": 3e-5, "decode_seqs": 4e-4, "sampled": 2e-4,
        "decode_context": 2e-7, "prefill_attention": 1e-9}


def _synthetic(n: int, seed: int, noise: float) -> list[tuple[StepFeatures, float]]:
    """Random step shapes priced by TRUE (the 'phases' feature set) with multiplicative noise."""
    rng = random.Random(seed)
    truth = StepCostModel("phases", TRUE)
    out = []
    for _ in range(n):
        rows = []
        for i in range(rng.randint(0, 24)):
            rows.append(_sr(f"d{i}", 1, rng.randint(16, 2048)))
        if rng.random() < 0.6 or not rows:
            chunk = rng.choice((16, 64, 128, 256, 512))
            rows.append(_sr("p", chunk, rng.choice((0, 256, 1024)), sample=rng.random() < 0.5))
        f = StepFeatures.from_output(_out(*rows))
        out.append((f, truth.predict(f) * (1 + rng.uniform(-noise, noise))))
    return out


def test_features_count_each_phase_by_hand() -> None:
    f = StepFeatures.from_output(_out(_sr("a", 1, 9), _sr("b", 1, 99), _sr("c", 4, 10, sample=False)))
    assert (f.decode_seqs, f.prefill_seqs, f.prefill_tokens) == (2, 1, 4)
    assert f.sampled == 2
    assert f.decode_context == 10 + 100  # keys attended: context after each decode token
    assert f.decode_padded == 2 * 100  # a rectangular decode batch reads the longest context per row
    assert f.prefill_attention == 4 * 10 + 4 * 5 // 2  # 4 queries see 10 old keys + a causal 4x4 half
    assert (f.num_tokens, f.num_seqs) == (6, 3)


def test_fit_recovers_known_coefficients() -> None:
    model = StepCostModel.fit(_synthetic(300, seed=1, noise=0.0), seed=0)
    assert model.feature_set in ("phases", "padded+context")  # the sets that contain the truth
    for name, want in TRUE.items():
        assert model.coefficients[name] == pytest.approx(want, rel=1e-6), name
    extra = set(model.coefficients) - set(TRUE)
    assert all(model.coefficients[k] == pytest.approx(0.0, abs=1e-12) for k in extra)
    assert model.fit_report["heldout_mape"] < 1e-6


def test_fit_with_noise_stays_close_and_reports_heldout_error() -> None:
    model = StepCostModel.fit(_synthetic(400, seed=2, noise=0.05), seed=0)
    assert model.fit_report["heldout_mape"] < 0.05
    # A decode row always samples, so only the sum of those two weights is identifiable.
    c = model.coefficients
    assert c["decode_seqs"] + c["sampled"] == pytest.approx(TRUE["decode_seqs"] + TRUE["sampled"], rel=0.05)
    assert c["prefill_tokens"] == pytest.approx(TRUE["prefill_tokens"], rel=0.1)
    fresh = _synthetic(200, seed=9, noise=0.0)
    errs = [abs(model.predict(f) - y) / y for f, y in fresh]
    assert sum(errs) / len(errs) < 0.02
    # The token-count-only model cannot see attention, so it must lose on held-out steps.
    cands = model.fit_report["candidates"]
    assert cands["tokens"]["heldout_mape"] > cands[model.feature_set]["heldout_mape"]


def test_fit_prefers_padded_attention_when_that_is_what_the_kernel_pays() -> None:
    truth = StepCostModel("padded", {"const": 0.01, "decode_seqs": 1e-3, "decode_padded": 5e-7})
    rng = random.Random(5)
    samples = []
    for _ in range(120):
        rows = [_sr(f"d{i}", 1, rng.randint(16, 4096)) for i in range(rng.randint(1, 32))]
        f = StepFeatures.from_output(_out(*rows))
        samples.append((f, truth.predict(f)))
    model = StepCostModel.fit(samples)
    assert model.feature_set in ("padded", "padded+context")
    assert model.fit_report["candidates"]["phases"]["heldout_mape"] > 10 * model.fit_report["heldout_mape"]


def test_fit_never_returns_negative_weights() -> None:
    # Times that fall with prefill size would need a negative weight: the fit drops the feature instead.
    samples = [(StepFeatures(prefill_tokens=p, prefill_seqs=1), 0.1 - p * 1e-4) for p in range(16, 800, 16)]
    model = StepCostModel.fit(samples)
    assert all(v >= 0 for v in model.coefficients.values())


def test_fit_rejects_too_few_or_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least 8"):
        StepCostModel.fit(_synthetic(5, seed=0, noise=0.0))
    bad = _synthetic(20, seed=0, noise=0.0)
    bad[3] = (bad[3][0], 0.0)
    with pytest.raises(ValueError, match="> 0"):
        StepCostModel.fit(bad)


def test_profile_json_round_trip(tmp_path) -> None:
    meta = {"model": "m", "dtype": "bfloat16", "device": "cpu", "machine": {"cpu": "x"}, "kv_bytes_per_token": 100}
    model = StepCostModel.fit(_synthetic(60, seed=3, noise=0.02), metadata=meta)
    path = model.save(tmp_path / "p.json")
    back = StepCostModel.load(path)
    assert back.feature_set == model.feature_set and back.coefficients == model.coefficients
    assert back.metadata == meta and back.fit_report["heldout_mape"] == model.fit_report["heldout_mape"]
    f = StepFeatures(prefill_tokens=100, prefill_seqs=1, decode_seqs=7, sampled=8, decode_context=900)
    assert back.predict(f) == model.predict(f)
    assert json.loads(path.read_text())["model"] == "m"


def test_load_rejects_what_is_not_a_profile(tmp_path) -> None:
    (tmp_path / "a.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="not a cadence profile"):
        StepCostModel.load(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        StepCostModel.load(tmp_path / "b.json")
    with pytest.raises(ValueError, match="feature_set"):
        StepCostModel("nope", {})


def test_sim_executor_scripts_tokens_and_advances_the_clock() -> None:
    model = StepCostModel("phases", TRUE, {"kv_bytes_per_token": 10})
    clock = VirtualClock(5.0)
    ex = SimExecutor(model, clock=clock)
    assert ex.kv_bytes_per_block(16) == 160
    out = _out(_sr("a", 1, 30), _sr("b", 8, 0, sample=False), _sr("c", 3, 8))
    res = ex.execute(out)
    assert res.sampled_token_ids == {"a": ex.token_id, "c": ex.token_id}  # only rows that sample
    assert ex.last_step_cost == pytest.approx(model.cost(out))
    assert clock.now() == pytest.approx(5.0 + model.cost(out))
    ex.execute(SchedulerOutput(step=2))  # nothing scheduled: free, and time stands still
    assert ex.last_step_cost == 0.0 and clock.now() == pytest.approx(5.0 + model.cost(out))


@pytest.mark.parametrize("knee", ["16k", "32k", "64k"])
def test_sim_executor_cost_equals_the_model_past_every_knee(knee: str) -> None:
    """SimExecutor evaluates the cost inline for speed: it must agree with StepCostModel, hinges included."""
    names = FEATURE_SETS[f"padded+knee{knee}"]
    model = StepCostModel(f"padded+knee{knee}", {n: 1e-6 * (i + 1) for i, n in enumerate(names)})
    ex = SimExecutor(model)
    for ctx in (100, 20_000, 40_000, 70_000):  # pads below and past each knee (two decode rows)
        out = _out(_sr("p", 9, 0), _sr("a", 1, ctx), _sr("b", 1, ctx // 2))
        ex.execute(out)
        assert ex.last_step_cost == pytest.approx(model.cost(out), rel=1e-12)


def test_paths_features_and_their_inline_cost() -> None:
    """"paths" prices a step with a prompt chunk on its own path: one constant more, and its decode
    rows at the chunk's per-token price, not at the one-call decode path's; SimExecutor's inline
    sum agrees (a folded weight may be negative here: the columns are not)."""
    rows = [_sr(f"d{i}", 1, 40 + i) for i in range(5)]
    mixed = StepFeatures.from_output(_out(_sr("p", 9, 0), *rows))
    assert mixed.bases()[BASES.index("prefill_step")] == 1.0
    assert mixed.bases()[BASES.index("decode_seqs_beside_prefill")] == 5
    alone = StepFeatures.from_output(_out(*rows))
    assert alone.bases()[BASES.index("prefill_step")] == 0.0 and alone.bases()[BASES.index("decode_seqs_beside_prefill")] == 0
    model = StepCostModel("paths", {"const": 0.004, "prefill_step": 0.003, "tokens_of_prefill_steps": 2e-5,
                                    "decode_seqs_alone": 6e-4, "sampled": 2e-4, "decode_context": 1e-7,
                                    "prefill_attention": 1e-9})
    ex = SimExecutor(model)
    for out in (_out(_sr("p", 9, 0), *rows), _out(*rows), _out(_sr("p", 30, 8))):
        ex.execute(out)
        assert ex.last_step_cost == pytest.approx(model.cost(out), rel=1e-12)
    sixth = _sr("d5", 1, 45)  # context 46
    assert model.cost(_out(*rows, sixth)) - model.cost(_out(*rows)) == pytest.approx(6e-4 + 2e-4 + 46e-7)
    chunk = _sr("p", 9, 0)
    assert model.cost(_out(chunk, *rows, sixth)) - model.cost(_out(chunk, *rows)) == pytest.approx(2e-5 + 2e-4 + 46e-7)
    assert model.cost(_out(chunk)) == pytest.approx(0.004 + 0.003 + 9 * 2e-5 + 2e-4 + 45e-9)


def test_prefill_context_sums_each_chunks_start_and_tokens() -> None:
    """A chunk's context is the keys its attention reads: the cached ones before it and its own."""
    idx = BASES.index("prefill_context")
    decodes = [_sr(f"d{i}", 1, 300 + i) for i in range(3)]
    assert StepFeatures.from_output(_out(_sr("p", 25, 1024), *decodes)).bases()[idx] == 1024 + 25
    assert StepFeatures.from_output(_out(_sr("p", 40, 0))).bases()[idx] == 40  # a fresh prompt: its own keys
    two = StepFeatures.from_output(_out(_sr("p", 8, 16), _sr("q", 8, 40)))  # chunks of one length: exact
    assert two.bases()[idx] == (16 + 8) + (40 + 8)
    assert StepFeatures.from_output(_out(*decodes)).bases()[idx] == 0.0  # decode rows read no chunk context


CONTEXT_TRUTH = {"const": 0.006, "prefill_tokens": 7e-4, "decode_seqs": 0.0, "sampled": 1e-3,
                 "decode_padded": 1.7e-6, "prefill_attention": 7e-7, "prefill_context": 6e-6}


def _chunk_steps(n: int, seed: int) -> list[tuple[StepFeatures, float]]:
    """Prompt chunks of 8 to 512 tokens over 0 to 2,048 cached keys, some beside decodes, priced by
    CONTEXT_TRUTH: each key of a chunk's context costs something whatever the chunk's length."""
    rng = random.Random(seed)
    truth = StepCostModel("padded+prefill_context", CONTEXT_TRUTH)
    out = []
    for _ in range(n):
        rows = [_sr(f"d{i}", 1, rng.randint(16, 1024)) for i in range(rng.choice((0, 0, 4, 16)))]
        if rng.random() < 0.8 or not rows:
            rows.append(_sr("p", rng.choice((8, 24, 40, 64, 128, 512)), rng.choice((0, 512, 1024, 2048))))
        f = StepFeatures.from_output(_out(*rows))
        out.append((f, truth.predict(f)))
    return out


def test_fit_recovers_a_cost_per_key_of_a_chunks_context() -> None:
    """Where a chunk's context costs per key beside its (query, key) pairs, the fit picks a set that
    prices it and recovers the weight; without it, a short chunk over a long cached context comes
    out underpriced."""
    samples = _chunk_steps(200, seed=3)
    model = StepCostModel.fit(samples, seed=0)
    assert "prefill_context" in model.coefficients
    assert model.coefficients["prefill_context"] == pytest.approx(CONTEXT_TRUTH["prefill_context"], rel=1e-6)
    assert model.fit_report["heldout_mape"] < 1e-6
    short = StepFeatures.from_output(_out(_sr("p", 24, 1024)))
    truth = StepCostModel("padded+prefill_context", CONTEXT_TRUTH).predict(short)
    assert model.predict(short) == pytest.approx(truth, rel=1e-6)
    blind = StepCostModel.fit(samples, seed=0, feature_sets=("padded",))
    assert truth / blind.predict(short) > 1.03  # what a model without the term charges it


def test_replay_executor_returns_recorded_tokens_and_times() -> None:
    clock = VirtualClock(1.0)
    ex = ReplayExecutor([RecordedStep({"a": 7}, 0.5), RecordedStep({"a": 8}, 0.2, end_time=3.0)], clock=clock)
    assert ex.execute(_out(_sr("a", 4, 0))).sampled_token_ids == {"a": 7}
    assert clock.now() == pytest.approx(1.5)
    assert ex.execute(_out(_sr("a", 1, 4))).sampled_token_ids == {"a": 8}
    assert clock.now() == 3.0  # moved to the recorded end time, not by the duration
    with pytest.raises(ReplayDivergence, match="past"):
        ex.execute(_out(_sr("a", 1, 5)))


def test_replay_executor_detects_a_different_batch() -> None:
    ex = ReplayExecutor([RecordedStep({"a": 7}, 0.5)])
    with pytest.raises(ReplayDivergence, match="step 0"):
        ex.execute(_out(_sr("b", 4, 0)))


def test_calibration_sweep_shapes_respect_the_engine_limits() -> None:
    from cadence.sim.calibrate import Shape, fits, sweep_shapes

    shapes = sweep_shapes(max_seqs=16, max_tokens=256, max_len=2048)
    assert shapes and all(len(s.decode_contexts) + len(s.chunks) <= 16 for s in shapes)
    assert all(n <= 256 and n + st <= 2048 for s in shapes for n, st, _ in s.chunks)
    assert any(s.chunks and s.decode_contexts for s in shapes)  # mixed steps are swept too
    assert len(sweep_shapes(16, 256, 2048, quick=True)) < len(shapes)
    big = Shape(decode_contexts=(1024,) * 8)  # 8 x 64 blocks of 16 tokens
    assert fits(big, 16, 512) and not fits(big, 16, 511)


def test_calibration_steps_give_each_request_its_own_blocks() -> None:
    from cadence.sim.calibrate import Shape, _output

    out = _output(Shape(chunks=((32, 100, False),), decode_contexts=(40, 17)), 16, 1000, 50, random.Random(0))
    tables = [r.block_table for r in out.scheduled]
    assert [len(t) for t in tables] == [9, 3, 2]  # ceil(132/16), ceil(40/16), ceil(17/16)
    flat = [b for t in tables for b in t]
    assert len(set(flat)) == len(flat) and all(0 <= b < 1000 for b in flat)
    assert [r.start_pos for r in out.scheduled] == [100, 39, 16] and not out.scheduled[0].sample
    assert StepFeatures.from_output(out).decode_padded == 2 * 40


@settings(max_examples=120, deadline=None)
@given(
    name=st.sampled_from(sorted(FEATURE_SETS)),
    rows=st.lists(st.tuples(st.one_of(st.just(1), st.integers(2, 300)), st.integers(0, 90_000), st.booleans(),
                            st.lists(st.integers(0, 40), max_size=12)), min_size=1, max_size=24),
    scale=st.floats(1e-9, 1e-3),
)
def test_sim_executor_inline_cost_equals_the_model(name: str, rows: list[tuple[int, int, bool, list[int]]],
                                                   scale: float) -> None:
    """The simulator's flat per-step sum (written inline for speed) is StepFeatures . weights for
    any batch and every feature set: the two copies of the feature arithmetic cannot drift apart.
    (The rows' tables draw from a few block ids: decode rows share blocks often.)"""
    model = StepCostModel(name, {n: scale * (i + 1) for i, n in enumerate(FEATURE_SETS[name])})
    out = _out(*(ScheduledRequest(f"r{k}", tuple(range(1, n + 1)), start, tuple(table), sample or n == 1, SP)
                 for k, (n, start, sample, table) in enumerate(rows)))
    ex = SimExecutor(model)
    ex.initialize_kv_cache(64, 16)
    ex.execute(out)
    assert ex.last_step_cost == pytest.approx(model.cost(out, 16), rel=1e-9)
