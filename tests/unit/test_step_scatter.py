"""Step-time scatter: measured on served steps (served_fit.measure_scatter), kept in the profile,
and drawn per simulated step (executor/step_scatter.py) without moving the mean."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from cadence.bench import report
from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.executor.step_scatter import KINDS, ScatterDraws, StepScatter, interpolated_mean, normalised
from cadence.sim.profile import default_profile_path
from cadence.sim.served_fit import measure_scatter, refit
from cadence.sim.simulator import SimOptions, Simulator
from cadence.workload import Workload, WorkloadRequest, assign_arrivals, builtin_workload

META = {"kv_bytes_per_token": 1000, "max_model_len": 4096}
MODEL = StepCostModel("phases", {"const": 0.003, "prefill_tokens": 2e-5, "decode_seqs": 3e-4}, META)


def _lognormal_table(sigma: float, n: int = 101) -> tuple[float, ...]:
    """Quantiles of a lognormal of log-sd `sigma` at evenly spaced probabilities (ends at 0.1% / 99.9%)."""
    nd = statistics.NormalDist(0.0, sigma)
    probs = [min(max(i / (n - 1), 0.001), 0.999) for i in range(n)]
    return normalised([math.exp(nd.inv_cdf(p)) for p in probs])


SCATTER = StepScatter({"decodes": _lognormal_table(0.25), "prompt": _lognormal_table(0.15)}, phi=0.6,
                      steps={"decodes": 5000, "prompt": 400})
SCATTERED = dataclasses.replace(MODEL, step_scatter=SCATTER)


def _burst(n: int = 300) -> Workload:
    """Every request at 0: no arrival while steps run, so the steps' shapes do not depend on their times."""
    return Workload("burst", tuple(WorkloadRequest(arrival_time=0.0, prompt_tokens=64, output_tokens=100 + i % 7 * 30)
                                   for i in range(n)), prefix_block_tokens=16)


def _run(model: StepCostModel, workload: Workload, max_num_seqs: int = 8, **opts):
    config = EngineConfig.from_options(num_kv_blocks=2048, max_num_seqs=max_num_seqs)
    sim = Simulator(config, model, SimOptions(**opts))
    return sim, sim.run(workload)


def _times(res) -> list[list[float]]:
    return [list(r.token_times) for r in res.records]


def test_draws_are_seeded_have_mean_one_and_correlate_as_measured() -> None:
    a, b, c = ScatterDraws(SCATTER, 1), ScatterDraws(SCATTER, 1), ScatterDraws(SCATTER, 2)
    fa = a.factors(0, 40_000, False, 0)
    assert fa == b.factors(0, 40_000, False, 0)
    assert fa != c.factors(0, 40_000, False, 0)
    assert statistics.fmean(fa) == pytest.approx(1.0, abs=0.02)
    logs = [math.log(f) for f in fa]
    m = statistics.fmean(logs)
    x = [v - m for v in logs]
    lag1 = sum(p * q for p, q in zip(x, x[1:], strict=False)) / sum(v * v for v in x)
    assert lag1 == pytest.approx(0.6, abs=0.05)  # the copula keeps the Gaussian's correlation, near enough
    # The kinds share the latent draw: the same rank, each kind's own spread.
    fp = a.factors(0, 1000, True, 0)
    assert statistics.pstdev(fp) < statistics.pstdev(fa[:1000])
    assert sorted(range(1000), key=fp.__getitem__) == sorted(range(1000), key=fa[:1000].__getitem__)
    # A step's factor is its index's, whichever way it is asked for.
    assert [a.factor(i, False) for i in range(40_000, 40_010)] == b.factors(40_000, 10, False, 0)
    with pytest.raises(ValueError, match="let go"):
        a.factors(0, 1, False, 40_000)


def test_independent_draws_follow_the_table() -> None:
    iid = dataclasses.replace(SCATTER, phi=0.0)
    f = ScatterDraws(iid, 3).factors(0, 200_000, False, 0)
    assert statistics.fmean(f) == pytest.approx(1.0, abs=0.005)
    q = statistics.quantiles(f, n=10)
    table = SCATTER.quantiles["decodes"]
    assert q[0] == pytest.approx(table[10], rel=0.02) and q[-1] == pytest.approx(table[90], rel=0.02)
    x = [v - 1.0 for v in f]
    assert abs(sum(p * r for p, r in zip(x, x[1:], strict=False)) / sum(v * v for v in x)) < 0.01


def test_a_profile_keeps_its_scatter(tmp_path) -> None:
    path = SCATTERED.save(tmp_path / "p.json")
    assert StepCostModel.load(path).step_scatter == SCATTER
    assert "step_scatter" not in json.loads(MODEL.save(tmp_path / "q.json").read_text())["cost_model"]
    d = json.loads(path.read_text())
    d["cost_model"]["step_scatter"]["quantiles"]["decodes"][0] = 5.0  # not increasing, not mean 1
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="step_scatter.quantiles.decodes"):
        StepCostModel.load(tmp_path / "bad.json")


def test_without_scatter_steps_cost_their_mean_exactly() -> None:
    w = assign_arrivals(builtin_workload("chat", 120, seed=3), "poisson", 4.0, seed=3)
    _, plain = _run(MODEL, w)
    _, off = _run(SCATTERED, w, step_scatter=False)
    ones = dataclasses.replace(MODEL, step_scatter=StepScatter({"decodes": (1.0, 1.0), "prompt": (1.0, 1.0)}))
    _, unit = _run(ones, w)  # every factor exactly 1: the same additions as no scatter at all
    assert [r.to_dict() for r in off.records] == [r.to_dict() for r in plain.records]
    assert [r.to_dict() for r in unit.records] == [r.to_dict() for r in plain.records]
    _, scattered = _run(SCATTERED, w)
    assert _times(scattered) != _times(plain)


def test_scatter_keeps_the_mean_step_and_widens_the_gaps() -> None:
    w = _burst()
    sim_p, plain = _run(MODEL, w)
    sim_s, scattered = _run(SCATTERED, w, seed=5)
    ex_p, ex_s = sim_p.replicas[0].executor, sim_s.replicas[0].executor
    assert ex_s.num_steps == ex_p.num_steps > 5000  # the same steps: nothing arrives while they run
    assert ex_s.total_cost / ex_p.total_cost == pytest.approx(1.0, abs=0.02)
    itl_p = report.summarize(plain.records, {})["overall"]["itl"]
    itl_s = report.summarize(scattered.records, {})["overall"]["itl"]
    assert itl_s["p90"] > 1.15 * itl_p["p90"]  # the table's p90 is 1.3x its mean
    assert itl_s["mean"] == pytest.approx(itl_p["mean"], rel=0.02)


def test_same_seed_same_run_another_seed_another_and_the_fast_forward_agrees() -> None:
    w = assign_arrivals(builtin_workload("chat", 150, seed=2), "poisson", 3.0, seed=2)
    _, a = _run(SCATTERED, w, seed=7, replicas=2)
    _, b = _run(SCATTERED, w, seed=7, replicas=2)
    sim_c, c = _run(SCATTERED, w, seed=7, replicas=2, fast_forward=False)
    _, d = _run(SCATTERED, w, seed=8, replicas=2)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in c.records]
    assert sim_c.fast_forwarded_steps == 0
    assert _times(a) != _times(d)
    # Each replica draws its own stream.
    ex0, ex1 = (r.executor for r in sim_c.replicas)
    n = max(ex0.num_steps, ex1.num_steps)  # (the draws before a replica's last step may be let go)
    f0, f1 = ex0.scatter.factors(n, 50, False, n), ex1.scatter.factors(n, 50, False, n)
    assert f0 != f1
    assert f0 == ScatterDraws(SCATTER, "7/0").factors(n, 50, False, 0)


def _step_log(path: Path, model: StepCostModel, factors: list[float], rng: random.Random) -> None:
    """Served steps (decodes, one step in ten with a prompt chunk) that cost the model's
    prediction times `factors`, in order."""
    with path.open("w") as f:
        for i, k in enumerate(factors):
            if i % 10 == 0:
                n = rng.randint(20, 200)
                feat = StepFeatures(prefill_tokens=n, prefill_seqs=1, sampled=1, prefill_attention=n * (n + 1) // 2)
            else:
                b = rng.randint(1, 8)
                ctx = [rng.randint(50, 400) for _ in range(b)]
                feat = StepFeatures(decode_seqs=b, sampled=b, decode_context=sum(ctx), decode_padded=b * max(ctx))
            f.write(json.dumps({"step": i, "duration": model.predict(feat) * k, **feat.to_dict()}) + "\n")


def _ar_lognormal(n: int, phi: float, sigma: float, level: float, rng: random.Random) -> list[float]:
    z, out = rng.gauss(0, 1), []
    for _ in range(n):
        out.append(level * math.exp(sigma * z))
        z = phi * z + math.sqrt(1 - phi * phi) * rng.gauss(0, 1)
    return out


def test_measure_scatter_finds_the_spread_and_the_correlation(tmp_path) -> None:
    rng = random.Random(4)
    logs = []
    for i, level in enumerate((0.8, 1.3)):  # the runs' levels differ: normalised away within each
        logs.append(tmp_path / f"steps_1_{i}.jsonl")
        _step_log(logs[-1], MODEL, _ar_lognormal(3000, 0.7, 0.2, level, rng), rng)
    s = measure_scatter(MODEL, logs)
    assert s is not None
    assert s.steps == {"decodes": 5400, "prompt": 600}
    assert s.phi == pytest.approx(0.7, abs=0.05)
    for kind in ("decodes", "prompt"):
        q = s.quantiles[kind]
        assert interpolated_mean(q) == pytest.approx(1.0, abs=1e-9)
        # A lognormal of log-sd 0.2 about its mean: p90 / p10 = exp(2 x 1.2816 x 0.2) = 1.67.
        assert q[90] / q[10] == pytest.approx(1.67, rel=0.1)
    assert measure_scatter(MODEL, [tmp_path / "steps_1_0.jsonl"]) is not None
    few = tmp_path / "few.jsonl"
    _step_log(few, MODEL, [1.0] * 150, rng)
    assert measure_scatter(MODEL, [few]) is None


def test_calibrate_from_served_writes_the_scatter_and_sim_says_so(tmp_path, capsys) -> None:
    from cadence.cli import main

    base = StepCostModel.load(default_profile_path())
    rng = random.Random(6)
    d = tmp_path / "breakdown"
    d.mkdir()
    bare = dataclasses.replace(base, overhead={})  # the logs time the executor alone
    for i in range(2):
        _step_log(d / f"steps_1_0.{i}.jsonl", bare, _ar_lognormal(400, 0.5, 0.2, 1.0, rng), rng)
    runs = [{"fraction": f, "steps": 400, "tokens_out": 1000, "steps_vs_model": {},
             "phases_s": {"idle": 1.0, "execute": 5.0, "schedule_update": 0.1, "detokenize": 0.05, "publish": 0.05,
                          "inbox": 0.0}} for f in (0.3, 0.6)]
    (d / "breakdown.json").write_text(json.dumps({"workload": "chat", "runs": runs}))
    out = tmp_path / "refit.json"
    assert main(["calibrate", "--from-served", str(d), "--out", str(out)]) == 0
    assert "step scatter x mean: decodes p10" in capsys.readouterr().out
    new = StepCostModel.load(out)
    assert new.step_scatter is not None and new.step_scatter.steps == {"decodes": 720, "prompt": 80}
    assert new.step_scatter == refit(base, d).step_scatter
    assert new.metadata["step_scatter_source"].startswith("served traffic: 800 steps of 2 runs")
    assert "prompt p10" in new.step_scatter.describe() and "all kinds pooled" in new.step_scatter.describe()

    sim = ["sim", "--workload", "chat", "--num-requests", "20", "--rate", "2", "--profile", str(out)]
    assert main(sim) == 0
    assert "step scatter x mean: decodes" in capsys.readouterr().out
    assert main([*sim, "--no-step-scatter"]) == 0
    assert "step scatter: off (--no-step-scatter)" in capsys.readouterr().out
    assert main(["sim", "plan", "--workload", "chat", "--num-requests", "20", "--rate", "2", "--profile", str(out),
                 "--slo", "ttft_p95=5", "--max-replicas", "2"]) == 0
    assert "step scatter x mean: decodes" in capsys.readouterr().out
    # A refit on too few steps to say what a tail looks like leaves the scatter out.
    for i in range(2):
        _step_log(d / f"steps_1_0.{i}.jsonl", bare, [1.0] * 60, rng)
    assert refit(dataclasses.replace(base, step_scatter=SCATTER), d).step_scatter is None


def test_a_pd_fleet_scatters_its_steps_too() -> None:
    from cadence.sim.disagg import PDSimulator
    from cadence.sim.pd import PDOptions

    w = assign_arrivals(builtin_workload("chat", 80, seed=1), "poisson", 3.0, seed=1)
    config = EngineConfig.from_options(num_kv_blocks=2048, prefix_caching_hash_algo="builtin")

    def run(model: StepCostModel, **opts) -> list[dict]:
        sim = PDSimulator(config, model, SimOptions(**opts), PDOptions(1, 2))
        return [r.to_dict() for r in sim.run(w).records]

    scattered = run(SCATTERED, seed=3)
    assert scattered == run(SCATTERED, seed=3) == run(SCATTERED, seed=3, fast_forward=False)
    assert scattered != run(SCATTERED, seed=4)
    assert run(SCATTERED, seed=3, step_scatter=False) == run(MODEL, seed=3) != scattered


@pytest.mark.parametrize("field, value, message", [
    ("phi", "x", "step_scatter.phi: expected a number"),
    ("phi", True, "step_scatter.phi: expected a number"),
    ("steps", {"decodes": "many"}, "step_scatter.steps: expected whole numbers"),
])
def test_a_malformed_scatter_names_its_field(field: str, value: object, message: str) -> None:
    good = {"phi": 0.5, "quantiles": {k: [0.5, 1.0, 1.5] for k in KINDS}}
    with pytest.raises(ValueError, match=message):
        StepScatter.from_dict({**good, field: value})
