"""Step-cost model and the simulator's executors.

A step's cost on a given machine is, to a good approximation, linear in a handful of shape
features: tokens through the linear layers, sequences whose logits are computed, and the
(query, key) pairs attention visits, split into prefill and decode because the two have very
different arithmetic intensity. `cadence calibrate` measures real steps and fits the weights;
`SimExecutor` then charges each simulated step its predicted cost on a virtual clock.

numpy only (no torch): the simulator runs without a model.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import reduce
from operator import add
from pathlib import Path
from typing import Any

import numpy as np

from cadence.boundary import ModelOutput, SchedulerOutput
from cadence.clock import VirtualClock
from cadence.executor.step_scatter import ScatterDraws, StepScatter
from cadence.host_load import cpu_model
from cadence.sched.adaptive import DraftModelCost
from cadence.sched.features import (
    BASES,
    KNEE_1,
    KNEE_2,
    KNEE_3,
    KNEES,
    StepFeatures,
    prefill_context,
    scan_rows,
    shared_decode_keys,
)

PROFILE_FORMAT = 1
SHARED = BASES.index("decode_context_shared")  # its weight in `StepCostModel._w`
CHUNK_CONTEXT = BASES.index("prefill_context")  # likewise
REQUEST_PATH_TERMS = ("per_request", "per_prompt_token")  # a profile's `request_path` keys


def _cols(*names: str) -> dict[str, dict[str, float]]:
    return {n: {n: 1.0} for n in names}


# Candidate feature sets, as weights on the bases. The simplest ("tokens") ignores attention; the
# others separate prefill from decode and charge attention by the keys it reads: summed over the
# decode rows ("phases"), or padded to the longest row ("padded"), as a batched decode kernel over
# a rectangular batch does; "padded+context" keeps both. "padded+context+shared" prices the decode
# keys in blocks an earlier row of the step read (a shared prompt prefix) apart from the others:
# both columns non-negative, so the fit can find a re-read key cheaper without a negative weight.
# "+prefill_context" adds a cost per key of each chunk's context (start + tokens), which a short
# chunk over a long cached context pays beside its (query, key) pairs.
FEATURE_SETS: dict[str, dict[str, dict[str, float]]] = {
    "tokens": {"const": {"const": 1.0}, "num_tokens": {"prefill_tokens": 1.0, "decode_seqs": 1.0},
               "num_seqs": {"prefill_seqs": 1.0, "decode_seqs": 1.0}},
    "phases": _cols("const", "prefill_tokens", "decode_seqs", "sampled", "decode_context", "prefill_attention"),
    "padded": _cols("const", "prefill_tokens", "decode_seqs", "sampled", "decode_padded", "prefill_attention"),
    "padded+context": _cols("const", "prefill_tokens", "prefill_seqs", "decode_seqs", "sampled", "decode_context",
                            "decode_padded", "prefill_attention"),
    "padded+context+shared": {**_cols("const", "prefill_tokens", "prefill_seqs", "decode_seqs", "sampled"),
                              "decode_context_own": {"decode_context": 1.0, "decode_context_shared": -1.0},
                              **_cols("decode_context_shared", "decode_padded", "prefill_attention")},
    "padded+prefill_context": _cols("const", "prefill_tokens", "decode_seqs", "sampled", "decode_padded",
                                    "prefill_attention", "prefill_context"),
    "padded+context+shared+prefill_context": {
        **_cols("const", "prefill_tokens", "prefill_seqs", "decode_seqs", "sampled"),
        "decode_context_own": {"decode_context": 1.0, "decode_context_shared": -1.0},
        **_cols("decode_context_shared", "decode_padded", "prefill_attention", "prefill_context")},
    **{f"padded+knee{k.removeprefix('decode_over_')}": _cols(
        "const", "prefill_tokens", "decode_seqs", "sampled", "decode_padded", k, "prefill_attention") for k in KNEES},
    "paths": {**_cols("const", "prefill_step"),
              "tokens_of_prefill_steps": {"prefill_tokens": 1.0, "decode_seqs_beside_prefill": 1.0},
              "decode_seqs_alone": {"decode_seqs": 1.0, "decode_seqs_beside_prefill": -1.0},
              **_cols("sampled", "decode_context", "prefill_attention")},
}
_STEPS = np.arange(1024, dtype=np.int64)  # step indices of a decode run, sliced (read only)
_STEPS.flags.writeable = False
_FEW_STEPS = 14  # decode runs this short are costed step by step (SimExecutor.decode_run_costs): about
# 1.1 us a step in Python against 15-18 us for the numpy pass (a microbenchmark of the two)
SPEC_CYCLE = 8  # with speculation, the simulator's outputs cycle through this many token ids
DEFAULT_SIM_TOKEN = 13  # the scripted output token: any id works, the simulator has no EOS


def default_profile_path(num_threads: int | None = None) -> Path:
    """The profile shipped with cadence: the default model on this project's machine (docs/simulator.md).
    It lies in the simulator's folder, its main reader; numpy is all that reading it needs. With
    `num_threads`, the one calibrated at that many threads where one ships (`default_Nthreads.json`):
    what a step of k more rows costs beside a one-row step, and so what a draft is worth, changes
    with the threads that share the step; else the one-thread `default.json`."""
    folder = Path(__file__).resolve().parent.parent / "sim" / "profiles"
    if num_threads is not None and num_threads > 1 and (folder / f"default_{num_threads}threads.json").is_file():
        return folder / f"default_{num_threads}threads.json"
    return folder / "default.json"


def machine_info() -> dict[str, Any]:
    """What the profile was measured on: enough to tell whether it applies to another machine."""
    cpu = cpu_model() or platform.processor() or ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    # The load average at calibration: timings taken on a busy machine are slower and noisier.
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "load_average_1m": load}


def _design(feats: Sequence[StepFeatures], feature_set: str) -> np.ndarray:
    """Rows of the chosen feature set's columns."""
    spec = FEATURE_SETS[feature_set]
    base = np.array([f.bases() for f in feats], dtype=np.float64)
    mix = np.array([[spec[c].get(b, 0.0) for c in spec] for b in BASES])  # bases x columns
    return base @ mix


def _prices_shared(feature_set: str) -> bool:
    return any("decode_context_shared" in col for col in FEATURE_SETS[feature_set].values())


IRLS_ROUNDS = 30  # reweighting rounds of `_fit_nonneg` at most: on recorded steps each shrinks the change 3-50x
_SETTLED = 1e-8  # a round moving no prediction by more than this fraction ends the reweighting


def _nonneg_weighted(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Least squares with rows scaled by `w`, no weight negative: more work never makes a step
    cheaper, so a column whose weight comes out negative is dropped and the rest refitted."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        contrib = sol * x[:, active].mean(axis=0)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        del active[int(np.argmin(contrib))]
    return coef


def _fit_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error, non-negative (`_nonneg_weighted`), each row weighted by
    1/(its predicted time): step times span two orders of magnitude, so a 10 ms step must count
    as much as a 1 s one, and the simulator adds step times up, so the price must be the MEAN
    time of a shape, not below it. Weighting by the measured time (1/y) would bias it low on
    noisy samples: a sample slowed by noise gets a smaller weight than one sped up by the same
    amount, and the fit lands under the mean by about twice the noise's squared coefficient
    of variation. Weights from the prediction do not depend on a sample's own noise, so the
    estimating equation sum x (y - mu) / mu^2 = 0 holds in expectation (the quasi-likelihood of
    a noise whose spread grows with the mean). Iteratively reweighted from the 1/y fit; on
    noiseless samples both are exact, so the reweighting changes nothing there."""
    coef = _nonneg_weighted(x, y, 1.0 / y)
    # A row priced near zero would take all the weight: predictions count at least a tenth of
    # the quickest measured step.
    floor = 0.1 * float(y.min())
    mu = np.maximum(x @ coef, floor)
    for _ in range(IRLS_ROUNDS):
        coef = _nonneg_weighted(x, y, 1.0 / mu)
        new_mu = np.maximum(x @ coef, floor)
        settled = np.max(np.abs(new_mu - mu) / mu) <= _SETTLED
        mu = new_mu
        if settled:
            break
    return coef


SPLITS = 10  # random train/held-out splits a feature set is judged over
TIE = 1e-9  # held-out errors this close are a tie (a column the data never moved, or rounding)


def _simplest_best(candidates: dict[str, dict[str, float]]) -> str:
    """The candidate with the lowest held-out error; of those tied with it, the one with the fewest
    columns: a set that adds a column to another, weighted about zero, must not win on rounding."""
    low = min(c["heldout_mape"] for c in candidates.values())
    tied = [k for k, c in candidates.items() if c["heldout_mape"] <= low + TIE]
    return min(tied, key=lambda k: len(FEATURE_SETS[k]))  # (min keeps the first of equals: table order)


def mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y))


def _seconds(v: Any, name: str) -> float:
    """A profile's number of seconds, or a ValueError naming its field (JSON has no units)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name}: expected a number of seconds, got {v!r}")
    return float(v)


def _seconds_by_term(cm: dict[str, Any], section: str) -> dict[str, float]:
    terms = cm.get(section, {}) if section != "coefficients" else cm[section]
    if not isinstance(terms, dict):
        raise ValueError(f"{section}: expected an object of terms, got {terms!r}")
    return {k: _seconds(v, f"{section}.{k}") for k, v in terms.items()}


@dataclass
class StepCostModel:
    """Predicted seconds of one step: a non-negative linear model in one feature set."""

    feature_set: str
    coefficients: dict[str, float]
    metadata: dict[str, Any] = field(default_factory=dict)  # model, dtype, device, machine, kv sizes
    fit_report: dict[str, Any] = field(default_factory=dict)  # held-out error, candidates
    min_cost: float = 1e-6  # a step is never free: keeps the virtual clock moving
    # The engine's own time per step beyond the forward pass (scheduling, bookkeeping, detokenizing):
    # {"per_step": s, "per_seq": s}, measured separately by calibration and added to every prediction.
    overhead: dict[str, float] = field(default_factory=dict)
    # What a request costs before the engine sees it and after its tokens leave (HTTP parsing,
    # chat template, tokenization, the hand-offs to and from the engine thread), measured through a
    # real server at idle: {"per_request": s, "per_prompt_token": s}, either term absent meaning 0.
    # Not a step's cost: the simulator delays each request's arrival at its engine by
    # `request_delay_for(its prompt tokens)`.
    request_path: dict[str, float] = field(default_factory=dict)
    # How served steps scatter around the predicted mean (measured on served traffic by
    # `cadence calibrate --from-served`): the simulator multiplies each step's predicted time by a
    # draw from it. None: every step costs its mean.
    step_scatter: StepScatter | None = None

    def __post_init__(self) -> None:
        spec = FEATURE_SETS.get(self.feature_set)
        if spec is None:
            raise ValueError(f"feature_set: expected one of {tuple(FEATURE_SETS)}, got {self.feature_set!r}")
        unknown = set(self.coefficients) - set(spec)
        if unknown:
            raise ValueError(f"coefficients: {sorted(unknown)} are not features of {self.feature_set!r}")
        # A weight below 0 makes steps free (every latency near 0), NaN or inf fails every request:
        # the fit never writes one, so such a profile was edited or damaged.
        bad = sorted(k for k, v in self.coefficients.items() if not (math.isfinite(v) and v >= 0))
        if bad:
            raise ValueError(f"coefficients: {bad} must be finite and >= 0 seconds, got "
                             f"{[self.coefficients[k] for k in bad]}")
        if not (math.isfinite(self.min_cost) and self.min_cost > 0):
            raise ValueError(f"min_cost: must be finite and > 0 seconds, got {self.min_cost}")
        # Fold the columns into one weight per base quantity: the hot path is then 7 multiplies.
        w = [0.0] * len(BASES)
        for col, coef in self.coefficients.items():
            for base, k in spec[col].items():
                w[BASES.index(base)] += coef * k
        unknown = set(self.overhead) - {"per_step", "per_seq"}
        if unknown:
            raise ValueError(f"overhead: unknown terms {sorted(unknown)} (per_step, per_seq)")
        unknown = set(self.request_path) - set(REQUEST_PATH_TERMS)
        if unknown:
            raise ValueError(f"request_path: unknown terms {sorted(unknown)} ({', '.join(REQUEST_PATH_TERMS)})")
        if any(not (math.isfinite(v) and v >= 0) for v in (*self.overhead.values(), *self.request_path.values())):
            raise ValueError("overhead, request_path: terms must be finite and >= 0 seconds")
        w[0] += self.overhead.get("per_step", 0.0)
        w[BASES.index("prefill_seqs")] += self.overhead.get("per_seq", 0.0)
        w[BASES.index("decode_seqs")] += self.overhead.get("per_seq", 0.0)
        self._w = tuple(w)

    @property
    def request_delay(self) -> float:
        """The request path's constant part: seconds between a client sending a request and its
        engine seeing it, the way back included, before the prompt's length is counted (see
        `request_delay_for`)."""
        return self.request_path.get("per_request", 0.0)

    @property
    def request_delay_per_token(self) -> float:
        """The request path's seconds per prompt token (tokenizing, the chat template, copying)."""
        return self.request_path.get("per_prompt_token", 0.0)

    def request_delay_for(self, prompt_tokens: int) -> float:
        """The whole request path of a request with `prompt_tokens` prompt tokens (see `request_path`)."""
        per_token = self.request_delay_per_token
        # Without a per-token term the sum is the constant itself, bit for bit (older profiles).
        return self.request_delay + per_token * prompt_tokens if per_token else self.request_delay

    def predict(self, f: StepFeatures) -> float:
        return max(self.min_cost, sum(a * b for a, b in zip(self._w, f.bases(), strict=True)))

    def steps_only(self) -> StepCostModel:
        """This model without the serving overhead: a step's own time, as a step log (`--record-steps`)
        and a decode gap less the engine's overhead measure it."""
        return replace(self, overhead={})

    def with_step_scale(self, factor: float) -> StepCostModel:
        """This model on a machine `factor` times slower at computing steps (1.2: each step 20%
        longer): the coefficients scaled, the serving overhead and the request path as they were
        (they are the server's and the network's, not the step's arithmetic)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"step scale: must be a finite number > 0, got {factor}")
        if factor == 1.0:
            return self
        return replace(self, coefficients={k: v * factor for k, v in self.coefficients.items()},
                       min_cost=self.min_cost * factor, metadata={**self.metadata, "step_cost_scale": factor})

    @property
    def prices_shared_context(self) -> bool:
        """Whether a decode key re-read from a block shared with an earlier row is priced apart
        (`decode_context_shared`): only then need callers count those keys."""
        return self._w[SHARED] != 0.0

    def cost(self, out: SchedulerOutput, block_size: int = 0) -> float:
        """The step's predicted seconds; shared decode keys are counted with `block_size` only."""
        return self.predict(StepFeatures.from_output(out, block_size if self.prices_shared_context else 0))

    def predict_many(self, feats: Sequence[StepFeatures]) -> np.ndarray:
        base = np.array([f.bases() for f in feats], dtype=np.float64)
        return np.maximum(base @ np.array(self._w), self.min_cost)

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepFeatures, float]], *, holdout: float = 0.25, seed: int = 0,
            splits: int = SPLITS, feature_sets: Iterable[str] = tuple(FEATURE_SETS),
            metadata: dict[str, Any] | None = None) -> StepCostModel:
        """Fit every candidate feature set on a training split and measure its mean absolute
        percentage error on the held-out steps, over `splits` random splits; keep the set with the
        lowest mean held-out error, then refit it on all steps. One split is not enough on served
        steps, whose times scatter by about 20%: which set wins a single split turns on which few
        noisy steps it happened to hold out."""
        if len(samples) < 8:
            raise ValueError(f"samples: need at least 8 measured steps to fit and validate, got {len(samples)}")
        if any(not (math.isfinite(s) and s > 0) for _, s in samples):
            raise ValueError("samples: step times must be finite and > 0 seconds")
        if splits < 1:
            raise ValueError(f"splits: need at least 1, got {splits}")
        n_test = max(2, round(len(samples) * holdout))
        feats = [f for f, _ in samples]
        y = np.array([s for _, s in samples], dtype=np.float64)
        # Without a step whose rows shared blocks, a set pricing them is the set without them plus a
        # column of zeros: left out, so that it cannot win on rounding with a weight nothing measured.
        shared_seen = any(f.decode_context_shared for f in feats)
        sets = [fs for fs in feature_sets if shared_seen or not _prices_shared(fs)]
        designs = {fs: _design(feats, fs) for fs in sets}
        errors: dict[str, list[tuple[float, float]]] = {fs: [] for fs in sets}
        for k in range(splits):
            idx = list(range(len(samples)))
            random.Random(seed + k).shuffle(idx)
            test, train = idx[:n_test], idx[n_test:]
            for fs, x in designs.items():
                coef = _fit_nonneg(x[train], y[train])
                pred = np.maximum(x @ coef, 1e-6)
                errors[fs].append((mape(pred[train], y[train]), mape(pred[test], y[test])))
        candidates = {fs: {"train_mape": float(np.mean([e[0] for e in errs])),
                           "heldout_mape": float(np.mean([e[1] for e in errs]))} for fs, errs in errors.items()}
        best = _simplest_best(candidates)
        x = _design(feats, best)
        coef = _fit_nonneg(x, y)
        cols = list(FEATURE_SETS[best])
        report = {"chosen": best, "heldout_mape": candidates[best]["heldout_mape"],
                  "train_mape": candidates[best]["train_mape"], "num_samples": len(samples),
                  "num_heldout": n_test, "num_splits": splits, "candidates": candidates,
                  "all_mape_after_refit": mape(np.maximum(x @ coef, 1e-6), y)}
        return cls(best, {c: float(v) for c, v in zip(cols, coef, strict=True)}, dict(metadata or {}), report)

    # -- profile files --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"cadence_profile": PROFILE_FORMAT, **self.metadata,
                "cost_model": {"feature_set": self.feature_set, "coefficients": self.coefficients,
                               "overhead": self.overhead, "request_path": self.request_path,
                               "min_cost": self.min_cost, "unit": "seconds",
                               **({"step_scatter": self.step_scatter.to_dict()} if self.step_scatter else {})},
                "fit": self.fit_report}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCostModel:
        if d.get("cadence_profile") != PROFILE_FORMAT:
            raise ValueError(f"not a cadence profile (format {PROFILE_FORMAT}): missing or wrong 'cadence_profile'")
        cm = d["cost_model"]
        meta = {k: v for k, v in d.items() if k not in ("cadence_profile", "cost_model", "fit")}
        kv = meta.get("kv_bytes_per_token")
        if kv is not None and not (isinstance(kv, int) and not isinstance(kv, bool) and kv > 0):
            raise ValueError(f"kv_bytes_per_token: must be a whole number > 0, got {kv!r}")
        scatter = cm.get("step_scatter")
        return cls(cm["feature_set"], _seconds_by_term(cm, "coefficients"), meta,
                   dict(d.get("fit", {})), _seconds(cm.get("min_cost", 1e-6), "min_cost"),
                   _seconds_by_term(cm, "overhead"), _seconds_by_term(cm, "request_path"),
                   None if scatter is None else StepScatter.from_dict(scatter))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg})") from None
        try:
            return cls.from_dict(d)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: malformed profile ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token of the calibrated model (sizes the simulated cache like the real one)."""
        return int(self.metadata.get("kv_bytes_per_token", 0)) or 1


@dataclass(frozen=True)
class SpecAcceptance:
    """How the simulator accepts speculative drafts: `rates[i]` is the fraction of verification
    rows that accept draft i (and so every draft before it), as a real run's counters give it:
    `cadence:spec_decode_num_accepted_tokens_per_pos_total{position="i"}` over
    `cadence:spec_decode_num_drafts_total` (of a run with fixed k, where every row carries them
    all). Past the list, each further draft is accepted with the last ratio of successive rates;
    one rate a is the geometric model (each draft accepted with probability a given the ones
    before it were)."""

    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        r = self.rates
        if not r or any(not (math.isfinite(x) and 0.0 <= x <= 1.0) for x in r):
            raise ValueError(f"spec_acceptance_rate: rates must be in [0, 1], got {list(r)}")
        if any(b > a for a, b in zip(r, r[1:], strict=False)):
            raise ValueError(f"spec_acceptance_rate: per-position rates cannot rise (a draft is accepted only "
                             f"after the ones before it), got {list(r)}")
        # P(draft i accepted | drafts before it were): the ratio of successive rates.
        cond = [r[0]] + [b / a if a > 0 else 0.0 for a, b in zip(r, r[1:], strict=False)]
        object.__setattr__(self, "_conditional", tuple(cond))

    @classmethod
    def parse(cls, text: str) -> SpecAcceptance:
        """From "0.7" or "0.8,0.6,0.45" (the command line's spelling)."""
        try:
            rates = tuple(float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"spec_acceptance_rate: expected a rate or comma-separated rates, got {text!r}") from None
        return cls(rates)

    def conditional(self, i: int) -> float:
        c = self._conditional  # type: ignore[attr-defined]
        return c[i] if i < len(c) else c[-1]


@dataclass(frozen=True)
class DecodeRun:
    """`num_steps` consecutive steps that each schedule the same `num_seqs` plain decodes and, with
    `chunk`, one prompt chunk of `chunk` tokens after them that samples nothing (with `sampled`, its
    last chunk, which does); nothing else. Row i decodes at its first step's position plus the
    step's index; step j's chunk starts at `chunk_start + j * chunk`. What
    `SimExecutor.decode_run_costs` needs to cost the steps (for the simulator's fast-forward,
    sim/fast_forward.py): the rows' first positions summed and their maximum, and the chunk."""

    num_seqs: int
    start_sum: int
    start_max: int
    num_steps: int
    chunk: int = 0
    chunk_start: int = 0
    sampled: int = 0  # 1: the chunk is its prompt's last and samples (one step: a prompt joining a stretch)
    # Keys the rows read from blocks an earlier row of the step read (`shared_decode_keys`), the same
    # in every step of the run: the blocks a decode row takes during it are its own.
    shared: int = 0



class SimExecutor:
    """`Executor` for the simulator: a scripted token for every row that samples, and the step's
    modelled cost added to the virtual clock (when given one), so the engine core reads the time
    after the step just as it would after a real forward pass.

    It also costs a `DecodeRun` (steps of the same plain decodes) in one call: the simulator
    fast-forwards such stretches without building a step each (see sim/fast_forward.py).
    Every plain decode samples `token_id`.

    With `spec_acceptance` (an engine that speculates), output i of every request is instead
    `token_id + i % SPEC_CYCLE`: text that repeats, where the n-gram lookup finds drafts (a constant
    token would leave it one draft at a time). A verification row is priced as what it is, a chunk
    of 1 + k tokens whose every position goes through the LM head; its drafts are accepted by
    `spec_acceptance` (`SpecAcceptance`), drawn from a generator seeded with `seed`, whatever they
    are, and the token after the accepted ones is the one of its output index. For a draft model
    (`draft_requests`), the drafts proposed are the outputs that follow, and with `draft_cost` the
    step is charged the draft model's time as the scheduler prices it (`DraftModelCost.total`: k
    decode passes over the requests drafted for, each its share of layers of a served decode step).

    With `scatter`, each step's cost (the draft model's time included) is its predicted mean times
    the draw of its index and kind (`ScatterDraws`: the step-time scatter measured on served
    traffic); without, the mean.

    With `answer`, each step's tokens are what `answer` returns for it (benchmarks/spec_replay.py
    answers from a real model's recorded greedy outputs, verifying drafts against them) instead of
    the scripted ones; the step is priced as any other."""

    def __init__(self, cost_model: StepCostModel, *, clock: VirtualClock | None = None,
                 token_id: int = DEFAULT_SIM_TOKEN, kv_bytes_per_token: int | None = None,
                 spec_acceptance: SpecAcceptance | None = None, seed: int = 0,
                 scatter: ScatterDraws | None = None,
                 draft_cost: DraftModelCost | None = None,
                 answer: Callable[[SchedulerOutput], ModelOutput] | None = None) -> None:
        self.cost_model = cost_model
        self.answer = answer
        self.scatter = scatter
        self.spec_acceptance = spec_acceptance
        self.draft_cost = draft_cost
        self._rng = random.Random(seed)
        self.clock = clock
        self.token_id = token_id
        self._kv_bytes_per_token = kv_bytes_per_token or cost_model.kv_bytes_per_token
        self._w = cost_model._w
        self._min_cost = cost_model.min_cost
        self.prices_shared_context = cost_model.prices_shared_context
        self.num_blocks: int | None = None
        self.block_size: int | None = None
        self.last_step_cost = 0.0
        self.total_cost = 0.0
        self.num_steps = 0
        # Set by the simulator before a step: seconds added per step and per row (co-located
        # replicas contending for cores, `SimOptions.contended_overhead`).
        self.extra_overhead = (0.0, 0.0)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self._kv_bytes_per_token * block_size

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        # One pass over the rows computes both the features and the sampled tokens: this runs
        # once per simulated step, so the cost is written flat rather than through StepFeatures and
        # StepCostModel.predict (measured: going through them made a 5,000-request trace
        # simulation 8% slower). It must stay the same sum as StepFeatures.bases() . weights;
        # tests/unit/test_cost_model.py compares the two past every knee.
        rows = scheduler_output.scheduled
        pt, ps, ds, dc, dmax, pa, sm, sampled = scan_rows(rows, self.token_id)
        # Shared keys need a second pass over the tables: only for a model that prices them.
        sh = shared_decode_keys(rows, self._block_size()) if self.prices_shared_context and ds > 1 else 0
        cost = 0.0 if scheduler_output.is_empty else self._cost(pt, ps, ds, sm, dc, ds * dmax, pa, sh)
        es, eq = self.extra_overhead
        if (es or eq) and cost:
            cost = max(self._min_cost, cost + es + eq * (ps + ds))
        if self.draft_cost is not None and scheduler_output.draft_requests:
            cost += self._drafting(scheduler_output)
        if self.scatter is not None:  # (without: the mean, untouched)
            cost *= self.scatter.factor(self.num_steps, pt > 0)
        self._charge(cost)
        if self.answer is not None:
            return self.answer(scheduler_output)
        if self.spec_acceptance is None:
            if sm != len(sampled):
                raise ValueError("a verification row reached a SimExecutor without spec_acceptance")
            return ModelOutput(sampled_token_ids=sampled)
        return self._speculating(scheduler_output)

    def _speculating(self, out: SchedulerOutput) -> ModelOutput:
        """The answer of an engine that speculates: output i is `token_id + i % SPEC_CYCLE`; a
        verification row keeps the drafts `spec_acceptance` accepts, then the next output."""
        acc = self.spec_acceptance
        assert acc is not None
        draw, base = self._rng.random, self.token_id
        sampled, verified, drafts = {}, {}, {}
        wanted = out.draft_requests
        for r in out.scheduled:
            if not r.sample:
                continue
            k, m = r.num_draft_tokens, 0
            while m < k and draw() < acc.conditional(m):
                m += 1
            token = base + (r.num_output_tokens + m) % SPEC_CYCLE
            sampled[r.request_id] = token
            if k:
                verified[r.request_id] = (*r.draft_token_ids[:m], token)
            want = wanted.get(r.request_id)
            if want is not None:  # a draft model's proposals: the outputs that follow (accepted as drawn)
                after = r.num_output_tokens + m + 1
                drafts[r.request_id] = tuple(base + (after + j) % SPEC_CYCLE for j in range(want.k))
        return ModelOutput(sampled_token_ids=sampled, verified_token_ids=verified, draft_token_ids=drafts)

    def _drafting(self, out: SchedulerOutput) -> float:
        """The draft model's time after the step: the requests it drafts for, at the contexts the
        scheduler weighed them at (their row's first position + 1)."""
        assert self.draft_cost is not None
        wanted = out.draft_requests
        contexts = [r.start_pos + 1 for r in out.scheduled if r.request_id in wanted]
        return self.draft_cost.total(self.cost_model.predict, len(contexts), sum(contexts), max(contexts, default=0))

    def _block_size(self) -> int:
        if self.block_size is None:
            raise RuntimeError("the cost model prices shared decode keys: initialize_kv_cache must give the block size")
        return self.block_size

    def _cost(self, pt: int, ps: int, ds: int, sm: int, dc: int, pad: int, pa: int, sh: int = 0) -> float:
        """One step's cost from its features (the names of `StepFeatures`, in `bases()` order; `sh`
        its shared decode keys)."""
        w = self._w
        cost = (w[0] + w[1] * pt + w[2] * ps + w[3] * ds + w[4] * sm + w[5] * dc + w[6] * pad + w[10] * pa
                + w[11] * (pt > 0) + w[12] * (ds if pt else 0))
        if sh:  # (a model without the feature adds nothing: the same sum as before it existed)
            cost += w[SHARED] * sh
        if pt and w[CHUNK_CONTEXT]:  # (likewise)
            cost += w[CHUNK_CONTEXT] * prefill_context(pt, ps, pa)
        if pad > KNEE_1:  # the hinges (see KNEES)
            cost += w[7] * (pad - KNEE_1) + w[8] * max(0, pad - KNEE_2) + w[9] * max(0, pad - KNEE_3)
        return max(cost, self._min_cost)

    def _charge(self, cost: float) -> None:
        """A step of `cost` seconds ran: count it and move the clock past it."""
        self.last_step_cost = cost
        self.total_cost += cost
        self.num_steps += 1
        if self.clock is not None and cost:
            self.clock.advance(cost)

    # -- decode runs (see DecodeRun): steps of the same plain decodes, costed and charged in bulk ----

    def decode_run_costs(self, run: DecodeRun, first_step: int = 0) -> list[float]:
        """What `execute` would charge for each step of `run`, in order (charges nothing), its
        first step coming `first_step` steps after those charged so far (the index its scatter
        draw is taken at).

        Step j decodes `run.num_seqs` rows, each at its first step's position plus j, and feeds the
        run's prompt chunk (if any) at its start plus j chunks: the features of `execute`, from the
        run's totals instead of the columns, for all steps at once. Each cost is
        `_cost(c, ps, n, n + sampled, dc, pad, pa, shared)` (c the chunk, ps 1 with a chunk): the same additions in
        the same order, element by element (numpy neither reorders nor fuses them), so the same
        rounding."""
        w, n, c = self._w, run.num_seqs, run.chunk
        ps = 1 if c else 0
        sm = n + run.sampled  # rows that sample: the decodes, and a prompt's last chunk
        scatter = self.scatter
        if run.num_steps <= _FEW_STEPS:  # numpy's fixed cost is more than a few `_cost` calls
            means = [self._cost(c, ps, n, sm, run.start_sum + n + n * j, n * (run.start_max + 1 + j),
                                c * (run.chunk_start + c * j) + c * (c + 1) // 2, run.shared)
                     for j in range(run.num_steps)]
            if scatter is None:
                return means
            f = scatter.factors(self.num_steps + first_step, run.num_steps, c > 0, self.num_steps)
            return [m * x for m, x in zip(means, f, strict=True)]
        head = w[0] + w[1] * c + w[2] * ps + w[3] * n + w[4] * sm  # the terms no step changes
        step = _STEPS[: run.num_steps] if run.num_steps <= len(_STEPS) else np.arange(run.num_steps, dtype=np.int64)
        # Integers, exact: dc = start_sum + n + n * step (keys read: every row's context is its
        # position + 1) and pad = n * (start_max + 1 + step), sharing n * step.
        ns = n * step
        dc = ns + (run.start_sum + n)
        pad = ns + n * (run.start_max + 1)
        cost = head + w[5] * dc
        cost += w[6] * pad  # in place: the same one rounding as `cost = cost + ...`
        if c:  # without a chunk the last three terms are zeros, and adding a zero changes no sum
            pa = c * (run.chunk_start + c * step) + c * (c + 1) // 2  # the chunk's query-key pairs
            cost += w[10] * pa
            cost += w[11]  # w[11] * (c > 0)
            cost += w[12] * n
            if w[CHUNK_CONTEXT]:  # `prefill_context` of one chunk: pa / c + (c - 1) / 2, as `_cost` has it
                cost += w[CHUNK_CONTEXT] * (pa / c + (c - 1) / 2)
        if run.shared:
            cost += w[SHARED] * run.shared
        if pad[-1] > KNEE_1:  # the hinges (see KNEES); pad grows with the step, so past K1 is a tail
            knee = pad > KNEE_1
            hinge = w[7] * (pad - KNEE_1) + w[8] * np.maximum(0, pad - KNEE_2) + w[9] * np.maximum(0, pad - KNEE_3)
            cost = np.where(knee, cost + hinge, cost)
        cost = np.maximum(cost, self._min_cost)
        if scatter is not None:  # (the same one multiplication per step as `execute`'s)
            cost *= np.array(scatter.factors(self.num_steps + first_step, run.num_steps, c > 0, self.num_steps))
        return cost.tolist()

    def charge_decode_run(self, costs: Sequence[float], end: float | None = None) -> None:
        """The first steps of a decode run ran (`decode_run_costs`' leading `costs`): charge them
        as that many `execute` calls would, one addition at a time. `end`: the clock reading
        after them, if the caller has summed the costs onto the clock's reading already."""
        if not costs:
            return
        self.last_step_cost = costs[-1]
        self.total_cost = reduce(add, costs, self.total_cost)
        self.num_steps += len(costs)
        if self.clock is not None:
            self.clock.advance_to(reduce(add, costs, self.clock.now()) if end is None else end)


@dataclass(frozen=True)
class RecordedStep:
    """What one real step returned, how long it took, and (optionally) the clock reading after it."""

    tokens: dict[str, int]
    duration: float
    end_time: float | None = None


class ReplayDivergence(AssertionError):
    """The replayed scheduler asked for a different step than the recorded run made."""


class ReplayExecutor:
    """`Executor` that hands back a recorded run's tokens and step times, step by step.

    With a clock, each step moves it to the recorded end time (or on by the recorded duration
    when no end time was kept), so the engine reads the times the recorded run read. It checks that each step samples the same requests as the recorded one, so a replay that
    drifts fails at the first step that differs rather than producing plausible numbers.
    """

    def __init__(self, steps: Sequence[RecordedStep], *, kv_bytes_per_block: int = 1,
                 clock: VirtualClock | None = None) -> None:
        self.steps = list(steps)
        self.clock = clock
        self._kv_bytes_per_block = kv_bytes_per_block
        self.index = 0
        self.last_step_cost = 0.0

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self._kv_bytes_per_block

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if self.index >= len(self.steps):
            raise ReplayDivergence(f"replay ran past the {len(self.steps)} recorded steps")
        rec = self.steps[self.index]
        want = {r.request_id for r in scheduler_output.scheduled if r.sample}
        if want != set(rec.tokens):
            raise ReplayDivergence(f"step {self.index}: the replay samples {sorted(want)}, "
                                   f"the recorded run sampled {sorted(rec.tokens)}")
        self.index += 1
        self.last_step_cost = rec.duration
        if self.clock is not None:
            if rec.end_time is not None:
                self.clock.advance_to(rec.end_time)
            else:
                self.clock.advance(rec.duration)
        return ModelOutput(sampled_token_ids=dict(rec.tokens))
