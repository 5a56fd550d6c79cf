"""Refitting a profile on served steps: the served steps pull the model toward what serving costs,
and the overhead is the engine's measured time outside the executor."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.sim.profile import default_profile_path
from cadence.sim.served_fit import engine_overhead, refit, served_samples, sweep_samples


def _decode(rng: random.Random) -> StepFeatures:
    b = rng.randint(1, 12)
    ctx = [rng.randint(50, 400) for _ in range(b)]
    return StepFeatures(decode_seqs=b, sampled=b, decode_context=sum(ctx), decode_padded=b * max(ctx))


def _run(steps: int, rows: int, per_step: float, per_seq: float, frac: float) -> dict:
    outside = steps * per_step + rows * per_seq
    return {"fraction": frac, "steps": steps, "tokens_out": rows, "steps_vs_model": {},
            "phases_s": {"idle": 1.0, "execute": 5.0, "schedule_update": outside / 2, "detokenize": outside / 4,
                         "publish": outside / 4, "inbox": 0.0}}


def test_engine_overhead_recovers_a_constant_and_a_per_row_cost():
    runs = [_run(1000, 3000, 5e-4, 2e-4, 0.3), _run(800, 6000, 5e-4, 2e-4, 0.6), _run(600, 9000, 5e-4, 2e-4, 0.85)]
    assert engine_overhead(runs) == pytest.approx({"per_step": 5e-4, "per_seq": 2e-4})
    # A negative slope is not a cost: the fit keeps the best non-negative pair.
    flat = [_run(1000, 3000, 5e-4, 0.0, 0.3), _run(1000, 6000, 4e-4, 0.0, 0.6)]
    ov = engine_overhead(flat)
    assert ov["per_step"] >= 0 and ov["per_seq"] >= 0


def test_refit_moves_decode_costs_toward_what_serving_measured(tmp_path):
    base = StepCostModel.load(default_profile_path())
    assert len(sweep_samples(base)) >= 20
    rng = random.Random(0)
    with (tmp_path / "steps_1_0.500.jsonl").open("w") as f:
        for i in range(400):
            feat = _decode(rng)
            f.write(json.dumps({"step": i, "duration": 1.3 * base.predict(feat) - 1.3 * _overhead(base, feat),
                                **feat.to_dict()}) + "\n")
    (tmp_path / "breakdown.json").write_text(json.dumps(
        {"workload": "chat", "runs": [_run(1000, 3000, 5e-4, 2e-4, 0.3), _run(800, 6000, 5e-4, 2e-4, 0.6)]}))
    new = refit(base, tmp_path)
    assert new.overhead == pytest.approx({"per_step": 5e-4, "per_seq": 2e-4})
    assert new.metadata["served_refit"]["served_steps"] == 4 * len(sweep_samples(base))
    assert "validation" not in new.metadata  # a new model is not validated by the old one's runs
    probe = [_decode(random.Random(k)) for k in range(50)]

    def bare(model: StepCostModel, f: StepFeatures) -> float:
        return model.predict(f) - _overhead(model, f)

    before = sum(bare(base, f) for f in probe)
    after = sum(bare(new, f) for f in probe)
    assert 1.15 < after / before < 1.45  # toward 1.3x, held back by the sweep's own steps


def _overhead(model: StepCostModel, f: StepFeatures) -> float:
    return model.overhead.get("per_step", 0.0) + model.overhead.get("per_seq", 0.0) * f.num_seqs


def test_refit_takes_the_request_path_from_the_runs_probes(tmp_path):
    base = dataclasses.replace(StepCostModel.load(default_profile_path()), request_path={"per_request": 0.5})
    rng = random.Random(1)
    with (tmp_path / "steps_1_0.500.jsonl").open("w") as f:
        for i in range(100):
            feat = _decode(rng)
            f.write(json.dumps({"step": i, "duration": base.predict(feat), **feat.to_dict()}) + "\n")
    runs = [_run(1000, 3000, 5e-4, 2e-4, 0.3), _run(800, 6000, 5e-4, 2e-4, 0.6)]
    (tmp_path / "breakdown.json").write_text(json.dumps({"workload": "chat", "runs": runs}))
    assert refit(base, tmp_path).request_path == {"per_request": 0.5}  # no probe: the base's is kept

    new_overhead = {"per_step": 5e-4, "per_seq": 2e-4}
    for r in runs:
        r["request_path_probe"] = [{"prompt_tokens": n, "ttft_s": 0.0} for n in (10, 11)]
    (tmp_path / "breakdown.json").write_text(json.dumps({"workload": "chat", "runs": runs}))
    first = refit(base, tmp_path)
    # Priced against the refitted model, overhead included: the same probe, the same fit.
    for r in runs:
        r["request_path_probe"] = [
            {"prompt_tokens": n, "ttft_s": 0.007 + _priced(first, n, new_overhead)} for n in (10, 11)]
    (tmp_path / "breakdown.json").write_text(json.dumps({"workload": "chat", "runs": runs}))
    new = refit(base, tmp_path)
    assert new.request_path == {"per_request": pytest.approx(0.007, abs=1e-9)}
    assert new.metadata["request_path_source"].startswith("cadence serve at idle")


def test_calibrate_from_served_keeps_the_request_paths_cost_per_prompt_token(tmp_path, capsys):
    from cadence.cli import main

    base = StepCostModel.load(default_profile_path())
    rng = random.Random(3)
    with (tmp_path / "steps_1_0.500.jsonl").open("w") as f:
        for i in range(100):
            feat = _decode(rng)
            f.write(json.dumps({"step": i, "duration": base.predict(feat), **feat.to_dict()}) + "\n")
    runs = [_run(1000, 3000, 5e-4, 2e-4, 0.3)]
    (tmp_path / "breakdown.json").write_text(json.dumps({"workload": "shared-prefix", "runs": runs}))
    first = refit(base, tmp_path)  # the probe does not move the steps' fit: price the probe with it
    probe = []
    for words, n in ((8, 10), (8, 11), (96, 140), (96, 142), (384, 560), (384, 558)):
        cached = (n - 1) // 16 * 16
        m = n - cached
        step = first.predict(StepFeatures(prefill_tokens=m, prefill_seqs=1, sampled=1,
                                          prefill_attention=m * cached + m * (m + 1) // 2))
        probe.append({"words": words, "prompt_tokens": n, "cached_tokens": cached,
                      "ttft_s": step + 0.003 + 2e-6 * n})
    runs[0]["request_path_probe"] = probe
    (tmp_path / "breakdown.json").write_text(json.dumps({"workload": "shared-prefix", "runs": runs}))
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--from-served", str(tmp_path), "--out", str(out)]) == 0
    new = StepCostModel.load(out)
    assert new.request_path == {"per_request": pytest.approx(0.003, abs=1e-7),
                                "per_prompt_token": pytest.approx(2e-6, rel=1e-3)}
    assert "3.00 ms a request + 2.00 us a prompt token" in capsys.readouterr().out


def _priced(model: StepCostModel, n: int, overhead: dict) -> float:
    f = StepFeatures(prefill_tokens=n, prefill_seqs=1, sampled=1, prefill_attention=n * (n + 1) // 2)
    return dataclasses.replace(model, overhead=overhead).predict(f)


def test_calibrate_from_served_takes_several_breakdowns(tmp_path, capsys):
    from cadence.cli import main

    base = StepCostModel.load(default_profile_path())
    rng = random.Random(2)
    dirs = []
    for name, frac in (("chat", 0.3), ("long-prompt-mix", 0.6)):
        d = tmp_path / name
        d.mkdir()
        with (d / "steps_1_0.500.jsonl").open("w") as f:
            for i in range(60):
                feat = _decode(rng)
                f.write(json.dumps({"step": i, "duration": base.predict(feat), **feat.to_dict()}) + "\n")
        run = _run(1000, 3000, 5e-4, 2e-4, frac)
        run["request_path_probe"] = [{"prompt_tokens": n, "ttft_s": 0.5} for n in (10, 12)]
        (d / "breakdown.json").write_text(json.dumps({"workload": name, "runs": [run]}))
        dirs.append(str(d))
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--from-served", ",".join(dirs), "--out", str(out)]) == 0
    new = StepCostModel.load(out)
    assert new.metadata["served_refit"]["workload"] == "chat, long-prompt-mix"
    assert new.metadata["served_refit"]["loads"] == [0.3, 0.6]
    assert 0.3 < new.request_path["per_request"] < 0.5  # half a second less the priced prefill
    assert "request path" in capsys.readouterr().out


def test_a_refit_on_served_shared_prefix_steps_learns_a_cheaper_re_read_key(tmp_path):
    """Served decode batches whose rows share a prefix, each re-read key a third cheaper than the
    base prices it: the refit takes the feature set that prices them apart, and finds them cheaper."""
    base = StepCostModel.load(default_profile_path())
    per_key = base.coefficients["decode_context"]
    rng = random.Random(2)
    with (tmp_path / "steps_1_0.850.jsonl").open("w") as f:
        for i in range(400):
            b, ctx = rng.randint(2, 24), rng.randint(200, 1500)
            shared = (b - 1) * (rng.randint(0, ctx // 16 - 1) * 16) if rng.random() < 0.7 else 0
            feat = StepFeatures(decode_seqs=b, sampled=b, decode_context=b * ctx, decode_padded=b * ctx,
                                decode_context_shared=shared)
            seconds = base.predict(feat) - _overhead(base, feat) - per_key / 3 * shared
            f.write(json.dumps({"step": i, "duration": seconds, **feat.to_dict()}) + "\n")
    (tmp_path / "breakdown.json").write_text(json.dumps(
        {"workload": "shared-prefix", "runs": [_run(1000, 3000, 5e-4, 2e-4, 0.3), _run(800, 6000, 5e-4, 2e-4, 0.85)]}))
    new = refit(base, tmp_path)
    assert new.feature_set.startswith("padded+context+shared") and new.prices_shared_context
    c = new.coefficients
    assert 0.5 < c["decode_context_shared"] / c["decode_context_own"] < 0.8  # about 2/3


def test_served_samples_draw_each_kind_of_step_evenly(tmp_path):
    """Traffic makes a prompt chunk in a few steps of a hundred: the served sample takes the same
    share of each kind of step, so the few chunk steps all reach the fit, and the decodes fill the
    rest of the share they leave."""
    rng = random.Random(5)
    log = tmp_path / "steps_1_0.300.jsonl"
    chunk = StepFeatures(prefill_tokens=24, prefill_seqs=1, sampled=1, prefill_attention=24 * 1024 + 300)
    beside = dataclasses.replace(chunk, decode_seqs=3, sampled=4, decode_context=900, decode_padded=960)
    steps = [_decode(rng) for _ in range(95)] + [chunk] * 3 + [beside] * 2
    rng.shuffle(steps)
    log.write_text("".join(json.dumps({"step": i, "duration": 0.01, **f.to_dict()}) + "\n"
                           for i, f in enumerate(steps)))
    drawn = served_samples([log], 12)
    assert (sum(f == chunk for f, _ in drawn), sum(f == beside for f, _ in drawn), len(drawn)) == (3, 2, 12)
