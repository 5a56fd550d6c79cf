"""Refit a cost profile on the steps a served engine really made, as they really cost when served.

`cadence calibrate` times step shapes with the engine alone on the machine. A served engine makes
other shapes in other proportions (what its traffic asks for) and pays for them while an HTTP
thread and a client share the cores. `benchmarks/serving_breakdown.py` serves real traffic at
several loads with `--record-steps` and keeps each step's shape and measured time, and the engine
thread's time outside the executor (scheduling, detokenizing, publishing). This module turns
those into a profile:

- the step cost model is fitted again on the calibration's own sweep plus a sample of the served
  steps (at most `SERVED_PER_SWEEP` times as many as the sweep has shapes, drawn evenly over the
  runs, so that the sweep's long contexts and large batches, which light traffic never makes,
  still shape the fit), in equal shares of each kind of step (`step_kind`): traffic makes a
  prompt chunk in a few steps of a hundred, and a draw blind to kind would leave the fit a
  handful of the steps that time to first token is made of;
- the serving overhead becomes what the engine thread was measured to spend outside the
  executor, fitted over the runs as a constant per step plus a cost per scheduled row;
- the request path (what a request pays outside the steps: HTTP, tokenization, hand-offs) comes
  from the served requests themselves where the runs kept their records (sim/served_path.py: each
  request's time to first token less its queue wait and its prompt step, as measured), else from
  the idle probe each served run starts with, priced against the refitted model;
- the step-time scatter (`measure_scatter`): every served step's measured time over the refitted
  model's prediction, as quantiles by kind of step and the lag-1 correlation from one step to the
  next, which the simulator draws each step's factor from (executor/step_scatter.py).

`cadence calibrate --from-served DIR --profile BASE --out NEW` does both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np

from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.executor.step_log import read_step_log
from cadence.executor.step_scatter import KINDS, MIN_SCATTER_STEPS, StepScatter, normalised
from cadence.sim.served_path import FirstToken, fit_served_path, run_first_tokens
from cadence.sim.serving import fit_request_path

SERVED_PER_SWEEP = 4
SCATTER_QUANTILES = 101  # the scatter's quantile table: every percentile, 0 to 100


def sweep_samples(model: StepCostModel) -> list[tuple[StepFeatures, float]]:
    """The calibration sweep's (shape, seconds) that a profile keeps in its fit report."""
    out = []
    for d in model.fit_report.get("samples", []):
        d = dict(d)
        seconds = float(d.pop("seconds"))
        out.append((StepFeatures(**d), seconds))
    if not out:
        raise ValueError("the profile keeps no calibration samples to refit with (calibrate it again)")
    return out


def step_kind(f: StepFeatures) -> str:
    """"decodes", "chunk" (prompt chunks alone) or "chunk + decodes": the kinds `served_samples` draws evenly."""
    if not f.prefill_tokens:
        return "decodes"
    return "chunk + decodes" if f.decode_seqs else "chunk"


def served_samples(step_logs: list[Path], limit: int, seed: int = 0) -> list[tuple[StepFeatures, float]]:
    """At most `limit` recorded steps, the same share from each log, and within a log the same
    share of each kind of step (`step_kind`); a kind with fewer steps than its share gives them
    all and leaves the rest of its share to the others."""
    rng = random.Random(seed)
    per_log = max(1, limit // max(1, len(step_logs)))
    out: list[tuple[StepFeatures, float]] = []
    for path in step_logs:
        kinds: dict[str, list[tuple[StepFeatures, float]]] = {}
        for r in read_step_log(path):
            if r[1] > 0:
                kinds.setdefault(step_kind(r[0]), []).append(r)
        left = per_log
        for i, rows in enumerate(sorted(kinds.values(), key=len)):  # the scarcest kind first
            take = min(len(rows), left // (len(kinds) - i))
            out += rng.sample(rows, take)
            left -= take
    return out


def run_speed(model: StepCostModel, step_log: str | Path) -> float:
    """How much longer than `model` predicts a recorded run's steps took: their summed measured time
    over their summed prediction, the model's step costs alone (a step log times the executor, not
    the server's overhead around it). 1.15: that run's machine computed steps 15% slower than the
    one the profile was calibrated on; `cadence sim --step-cost-scale` simulates at that speed."""
    rows = [r for r in read_step_log(step_log) if r[1] > 0]
    if not rows:
        raise ValueError(f"{step_log}: no step with a duration > 0 recorded")
    speed = sum(s for _, s in rows) / float(model.steps_only().predict_many([f for f, _ in rows]).sum())
    if not math.isfinite(speed):
        raise ValueError(f"{step_log}: the steps' durations add up to no finite time")
    return speed


def measure_scatter(model: StepCostModel, step_logs: list[Path]) -> StepScatter | None:
    """How the steps of served runs (`step_logs`, each one run's steps in order) scatter around
    `model`'s prediction: measured / predicted, normalised to mean 1 within each run and kind of
    step (a run's level is the model's business, not the scatter's), as quantiles per kind
    (`step_scatter.KINDS`: plain decodes, steps with a prompt chunk); and the lag-1
    autocorrelation of the log ratio within runs, pooled over them. None from fewer than
    `MIN_SCATTER_STEPS` steps: too few to say what a tail looks like."""
    pooled: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    lag_num = lag_den = 0.0
    for path in step_logs:
        rows = [r for r in read_step_log(path) if r[1] > 0]
        if len(rows) < 2:
            continue
        ratio = np.array([s for _, s in rows]) / model.predict_many([f for f, _ in rows])
        prompt = np.array([f.prefill_tokens > 0 for f, _ in rows])
        for kind, mask in zip(KINDS, (~prompt, prompt), strict=True):
            if mask.any():
                ratio[mask] /= ratio[mask].mean()
                pooled[kind].append(ratio[mask])
        x = np.log(ratio)
        x -= x.mean()
        lag_num += float(x[1:] @ x[:-1])
        lag_den += float(x @ x)
    every = np.concatenate([r for rs in pooled.values() for r in rs]) if any(pooled.values()) else np.array([])
    if len(every) < MIN_SCATTER_STEPS:
        return None
    probs = np.linspace(0.0, 1.0, SCATTER_QUANTILES)
    quantiles, steps = {}, {}
    for kind, rs in pooled.items():
        r = np.concatenate(rs) if rs else np.array([])
        steps[kind] = len(r)
        source = r if len(r) >= MIN_SCATTER_STEPS else every
        quantiles[kind] = normalised([float(v) for v in np.quantile(source, probs)])
    phi = min(max(lag_num / lag_den, 0.0), 0.99) if lag_den > 0 else 0.0
    return StepScatter(quantiles, phi, steps)


def scheduled_rows(run: dict[str, Any]) -> float:
    """The rows a serving-breakdown run scheduled, near enough: one per output token, and one per
    step that computed a prompt chunk."""
    kinds = run["steps_vs_model"]
    return run["tokens_out"] + sum(kinds.get(k, {}).get("steps", 0) for k in ("chunks", "chunk + decodes"))


def engine_overhead(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The engine thread's time outside the executor, fitted as per_step + per_seq x rows over the
    runs of a serving breakdown (rows as `scheduled_rows` counts them)."""
    x, y = [], []
    for r in runs:
        ph = r["phases_s"]
        outside = sum(v for k, v in ph.items() if k not in ("idle", "execute"))
        x.append([r["steps"], scheduled_rows(r)])
        y.append(outside)
    a, b = _nonneg_lstsq(np.array(x, dtype=float), np.array(y, dtype=float))
    return {"per_step": a, "per_seq": b}


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares for two non-negative coefficients: the unconstrained fit, else the best fit
    with one of them at zero."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if (coef >= 0).all():
        return float(coef[0]), float(coef[1])
    best: tuple[float, float, float] | None = None
    for keep in (0, 1):
        col = x[:, keep]
        c = max(float(col @ y / (col @ col)), 0.0) if col @ col else 0.0
        err = float(((col * c - y) ** 2).sum())
        pair = (c, 0.0) if keep == 0 else (0.0, c)
        if best is None or err < best[0]:
            best = (err, *pair)
    assert best is not None
    return best[1], best[2]


def _breakdown(d: Path) -> dict[str, Any]:
    """A breakdown directory's summary, or a ValueError naming the file."""
    path = d / "breakdown.json"
    if not path.is_file():
        raise ValueError(f"--from-served {d}: no breakdown.json (run benchmarks/serving_breakdown.py --out {d})")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("runs"), list):
        raise ValueError(f"{path}: expected an object with a list of 'runs'")
    return summary


def refit(base: StepCostModel, breakdown_dirs: str | Path | list[str | Path]) -> StepCostModel:
    """`base` refitted on its sweep plus the served steps under one or more breakdown directories
    (each a `serving_breakdown.py --out`, e.g. one per workload; module docstring)."""
    dirs = [Path(d) for d in (breakdown_dirs if isinstance(breakdown_dirs, list) else [breakdown_dirs])]
    runs: list[dict[str, Any]] = []
    logs: list[Path] = []
    workloads = []
    run_dirs: list[Path] = []
    for d in dirs:
        summary = _breakdown(d)
        found = sorted(d.glob("steps_*.jsonl"))
        if not found:
            raise ValueError(f"{d}: no steps_*.jsonl (run benchmarks/serving_breakdown.py --out {d})")
        runs += summary["runs"]
        run_dirs += [d] * len(summary["runs"])
        logs += found
        workloads.append(summary.get("workload"))
    sweep = sweep_samples(base)
    served = served_samples(logs, SERVED_PER_SWEEP * len(sweep))
    # A new model needs a new validation, and its own scatter.
    meta = {k: v for k, v in base.metadata.items() if k not in ("validation", "step_scatter_source")}
    fitted = StepCostModel.fit(sweep + served, metadata=meta)
    fitted.fit_report["samples"] = base.fit_report["samples"]
    scatter = measure_scatter(fitted, logs)  # (the fit prices the executor's time, as the logs measure it)
    overhead = engine_overhead(runs)
    tokens: list[FirstToken] = [t for d, r in zip(run_dirs, runs, strict=True) for t in run_first_tokens(d, r, overhead)]
    served_path = fit_served_path(tokens)
    probe = [p for r in runs for p in r.get("request_path_probe", ())]
    if served_path is not None:
        request_path, path_source = served_path, (f"served traffic: {len(tokens)} requests' first tokens less "
                                                  "their queue wait and prompt step")
    elif probe:  # the probe's first tokens less their prefill steps as the refitted model prices them
        request_path = fit_request_path(probe, dataclasses.replace(fitted, overhead=overhead))
        path_source = "cadence serve at idle, before each served run"
    else:
        request_path, path_source = base.request_path, base.metadata.get("request_path_source", "none")
    fitted.metadata["served_refit"] = {
        "breakdown": ", ".join(str(d) for d in dirs), "served_steps": len(served), "sweep_steps": len(sweep),
        "loads": [r.get("fraction") for r in runs], "workload": ", ".join(str(w) for w in workloads),
        "overhead": overhead}
    fitted.metadata["overhead_source"] = "served traffic: the engine thread outside the executor"
    if scatter is not None:
        fitted.metadata["step_scatter_source"] = (
            f"served traffic: {sum((scatter.steps or {}).values())} steps of {len(logs)} runs, measured / refitted "
            "model, normalised to mean 1 per run and kind of step")
    fitted.metadata["request_path_source"] = path_source
    return dataclasses.replace(fitted, overhead=overhead, request_path=request_path, step_scatter=scatter)
