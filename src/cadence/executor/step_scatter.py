"""How served steps of one shape scatter around the cost model's mean, and the draws that replay it.

The cost model predicts the mean time of a step's shape. Served steps of one shape scatter around
it (other threads and processes share the cores, the memory bus, the caches), and a percentile of
inter-token gaps is made of the slow ones: a simulator that charges every step its mean is
optimistic in the tail. `StepScatter` holds the measured scatter (sim/served_fit.py measures it on
served traffic) and `ScatterDraws` gives each simulated step a factor to multiply its mean by:

- the distribution: quantiles of measured / predicted at evenly spaced probabilities, one table
  for steps of plain decodes and one for steps with a prompt chunk (a kind with too few measured
  steps shares the pooled table), each normalised so that the mean of the distribution the draws
  follow (linear between the quantiles) is 1: the scatter adds spread, never bias;
- the order: slow steps come in runs (served steps' log ratios correlate from one step to the next),
  so the draws follow a Gaussian AR(1) with the measured lag-1 coefficient `phi` mapped through the
  quantile table (a Gaussian copula: each step's factor has the measured distribution, and
  consecutive steps correlate as measured). `phi` 0 gives independent draws.

A step's factor depends only on its index among the executor's steps and its kind, so stepping
one at a time and costing a decode stretch at once (sim/fast_forward.py) charge the same.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("decodes", "prompt")  # a step of plain decodes only; a step with a prompt chunk
_BLOCK = 1024  # draws made at a time
MIN_SCATTER_STEPS = 200  # fewer measured steps of a kind: it takes the table of all kinds pooled


def _checked_quantiles(q: Any, name: str) -> tuple[float, ...]:
    if not isinstance(q, (list, tuple)) or len(q) < 2:
        raise ValueError(f"step_scatter.{name}: expected a list of at least 2 quantiles, got {q!r}")
    out = tuple(float(v) for v in q)
    if any(not (math.isfinite(v) and v > 0) for v in out) or any(b < a for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"step_scatter.{name}: quantiles must be finite, > 0 and non-decreasing")
    return out


def interpolated_mean(q: Sequence[float]) -> float:
    """Mean of the distribution whose quantile function is linear between `q` (evenly spaced
    probabilities from 0 to 1): the average of each segment's midpoint."""
    return sum((a + b) / 2 for a, b in zip(q, q[1:], strict=False)) / (len(q) - 1)


def normalised(q: Sequence[float]) -> tuple[float, ...]:
    """`q` scaled so that `interpolated_mean` is 1."""
    m = interpolated_mean(q)
    return tuple(v / m for v in q)


@dataclass(frozen=True)
class StepScatter:
    """Measured / predicted step time, by kind of step (`KINDS`), and its step-to-step correlation.

    `quantiles[kind]`: the factor at probabilities 0, 1/(n-1), ..., 1, normalised to mean 1
    (`normalised`). `phi`: the AR(1) coefficient of the draws (the lag-1 autocorrelation of the log
    ratio, measured within runs). `steps[kind]`: how many measured steps each table comes from."""

    quantiles: dict[str, tuple[float, ...]]
    phi: float = 0.0
    steps: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if set(self.quantiles) != set(KINDS):
            raise ValueError(f"step_scatter.quantiles: expected the kinds {list(KINDS)}, got {sorted(self.quantiles)}")
        for k, q in self.quantiles.items():
            q = _checked_quantiles(q, f"quantiles.{k}")
            if abs(interpolated_mean(q) - 1.0) > 1e-6:
                raise ValueError(f"step_scatter.quantiles.{k}: must have mean 1 (normalised), got {interpolated_mean(q):.6f}")
            self.quantiles[k] = q
        if not (math.isfinite(self.phi) and 0.0 <= self.phi < 1.0):
            raise ValueError(f"step_scatter.phi: must be in [0, 1), got {self.phi}")

    def describe(self) -> str:
        """One line for reports: the spread of each kind and the correlation."""
        parts = []
        for k in KINDS:
            q = self.quantiles[k]
            n = (self.steps or {}).get(k)
            pooled = ", all kinds pooled" if n is not None and n < MIN_SCATTER_STEPS else ""
            parts.append(f"{k} p10 {_at(q, 0.1):.2f} / p90 {_at(q, 0.9):.2f}" + (f" ({n} steps{pooled})" if n else ""))
        return f"step scatter x mean: {'; '.join(parts)}; lag-1 correlation {self.phi:.2f}"

    def to_dict(self) -> dict[str, Any]:
        return {"phi": self.phi, "quantiles": {k: list(self.quantiles[k]) for k in KINDS},
                **({"steps": dict(self.steps)} if self.steps else {})}

    @classmethod
    def from_dict(cls, d: Any) -> StepScatter:
        if not isinstance(d, dict) or not isinstance(d.get("quantiles"), dict):
            raise ValueError("step_scatter: expected an object with 'quantiles' by kind of step")
        steps, phi = d.get("steps"), d.get("phi", 0.0)
        if isinstance(phi, bool) or not isinstance(phi, (int, float)):
            raise ValueError(f"step_scatter.phi: expected a number in [0, 1), got {phi!r}")
        if isinstance(steps, dict) and not all(isinstance(v, int) and not isinstance(v, bool) for v in steps.values()):
            raise ValueError(f"step_scatter.steps: expected whole numbers of steps by kind, got {steps!r}")
        return cls(dict(d["quantiles"]), float(phi),
                   {k: int(v) for k, v in steps.items()} if isinstance(steps, dict) else None)


def _at(q: Sequence[float], u: float) -> float:
    """The quantile table `q` (evenly spaced probabilities) at probability `u`, linear between."""
    x = u * (len(q) - 1)
    i = min(int(x), len(q) - 2)
    return q[i] + (q[i + 1] - q[i]) * (x - i)


# The latent Gaussian's grid: a kind's factor as a function of z, Q(Phi(z)), tabulated on it once
# so that a block of draws is mapped in one np.interp (per draw, erf and the table cost 3 us).
_Z_GRID = np.linspace(-6.0, 6.0, 1201)
_PHI_GRID = [0.5 * (1.0 + math.erf(z / math.sqrt(2.0))) for z in _Z_GRID.tolist()]


def _z_table(q: Sequence[float]) -> np.ndarray:
    return np.array([_at(q, u) for u in _PHI_GRID])


class ScatterDraws:
    """Each step's factor, by the step's index (0 the executor's first) and kind: a stream seeded
    by `seed` (a string or number), made a block at a time as the steps reach it. The caller says
    which steps can no longer be asked for (`floor`: those before it), and their draws are let go."""

    def __init__(self, scatter: StepScatter, seed: int | str) -> None:
        self.scatter = scatter
        digest = hashlib.sha256(f"step-scatter/{seed}".encode()).digest()
        self._rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        self._phi = scatter.phi
        self._innov = math.sqrt(1.0 - scatter.phi ** 2)
        self._z = float(self._rng.standard_normal())  # the stationary start
        self._dec = _z_table(scatter.quantiles["decodes"])
        self._pro = _z_table(scatter.quantiles["prompt"])
        self._base = 0  # the index of the first draw kept
        self._decodes: list[float] = []  # each kept step's factor were it plain decodes
        self._prompt: list[float] = []  # were it a step with a prompt chunk

    def _more(self, upto: int) -> None:
        """Make draws until the kept ones reach index `upto`."""
        phi, z = self._phi, self._z
        while self._base + len(self._decodes) < upto:
            zs = [0.0] * _BLOCK
            for i, e in enumerate((self._innov * self._rng.standard_normal(_BLOCK)).tolist()):
                zs[i] = z
                z = phi * z + e
            self._decodes += np.interp(zs, _Z_GRID, self._dec).tolist()
            self._prompt += np.interp(zs, _Z_GRID, self._pro).tolist()
        self._z = z

    def _forget(self, floor: int) -> None:
        """Let go of the draws before `floor` (a long run would otherwise keep one per step)."""
        if floor - self._base >= 4 * _BLOCK:
            drop = floor - self._base
            del self._decodes[:drop], self._prompt[:drop]
            self._base = floor

    def factor(self, index: int, prompt: bool) -> float:
        """Step `index`'s factor (a step with a prompt chunk if `prompt`); no step before it is
        asked for again."""
        self._forget(index)
        i = index - self._base
        if i >= len(self._decodes):
            self._more(index + 1)
        return self._prompt[i] if prompt else self._decodes[i]

    def factors(self, start: int, num_steps: int, prompt: bool, floor: int) -> list[float]:
        """Steps `start` to `start + num_steps`' factors; no step before `floor` is asked for again."""
        self._forget(floor)
        if start < self._base:
            raise ValueError(f"step {start}: its draw was let go (the floor passed it)")
        end = start + num_steps
        if end - self._base > len(self._decodes):
            self._more(end)
        i = start - self._base
        return (self._prompt if prompt else self._decodes)[i:i + num_steps]
