"""How far the simulator is from real runs, as a profile records it, and what that means for a plan.

`benchmarks/sim_fidelity.py --record-validation` runs real `cadence bench` runs beside simulated
ones (several workloads, seeds and loads) and writes what it found into the cost profile as a
`validation` block: for each latency percentile (`ttft_p50`, `itl_p90`, ...) the sim/real ratios'
median and spread over every cell. A ratio below 1 means the simulator was optimistic. Where
each real run was made more than once (`--repeat`), the block also carries `real_vs_real`: how
many p50/p90 cells of a repeat fell within 15% of the first run, the bound the real system itself
sets on how close any simulator can come on that machine.

Two readers:
- `cadence sim` prints the band beside its percentiles: a simulated p90 TTFT of 300 ms with
  sim/real between 0.8 and 1.0 says the real one is likely 300 to 375 ms.
- `cadence sim plan` tightens each objective by the pessimistic end of its ratio (the 10th
  percentile of the cells) and searches again, so it prints both the raw replica count and a safe
  one that still holds if the real run is as far off as the worst tenth of the validation cells.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

WITHIN = 0.15  # a cell is "within" when sim/real is in [1 - WITHIN, 1 + WITHIN]
GATED_QUANTILES = (50, 90)  # the percentiles the goal counts; p99 is reported, not gated


@dataclass(frozen=True)
class RatioSpread:
    """The sim/real ratios of one percentile over the validation cells."""

    median: float
    low: float  # 10th percentile of the ratios: the optimistic end
    high: float  # 90th percentile: the pessimistic end
    cells: int
    within: int  # cells within WITHIN of 1

    @classmethod
    def of(cls, ratios: Iterable[float]) -> RatioSpread:
        r = sorted(ratios)
        if not r:
            raise ValueError("no ratios")
        return cls(statistics.median(r), _quantile(r, 0.1), _quantile(r, 0.9), len(r),
                   sum(1 for x in r if abs(x - 1.0) <= WITHIN))

    def as_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "low": self.low, "high": self.high, "cells": self.cells, "within": self.within}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _ratio_key(key: str) -> str:
    metric, _, q = key.rpartition("_p")
    if not metric or not q.isdigit() or not 0 < int(q) < 100:
        raise ValueError(f"validation.ratios: {key!r} is not METRIC_pQ (e.g. ttft_p90)")
    return key


def _spread(key: str, s: Any) -> RatioSpread:
    """A stored spread, checked: a ratio of 0 or below, or a low end above the high one, would
    turn the safe count and the error band into nonsense without a word."""
    where = f"validation.ratios.{key}"
    fields = ("median", "low", "high", "cells", "within")
    if not isinstance(s, dict) or set(s) != set(fields):
        raise ValueError(f"{where}: expected the fields {', '.join(fields)}, got {s!r}")
    for name in ("median", "low", "high"):
        if not (_number(s[name]) and s[name] > 0):
            raise ValueError(f"{where}.{name}: a ratio sim/real must be a finite number > 0, got {s[name]!r}")
    if not s["low"] <= s["median"] <= s["high"]:
        raise ValueError(f"{where}: expected low <= median <= high, got {s['low']}, {s['median']}, {s['high']}")
    if not all(isinstance(s[n], int) and not isinstance(s[n], bool) for n in ("cells", "within")) \
            or not 0 <= s["within"] <= s["cells"] or s["cells"] < 1:
        raise ValueError(f"{where}: expected whole numbers 0 <= within <= cells, cells >= 1, "
                         f"got within {s['within']!r} of {s['cells']!r}")
    return RatioSpread(float(s["median"]), float(s["low"]), float(s["high"]), s["cells"], s["within"])


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class RealVsReal:
    """How close the real runs came to themselves: p50/p90 cells of repeats 2..N within WITHIN of
    the first run's."""

    within: int
    cells: int
    repeats: int  # real runs per (workload, seed, load)

    @classmethod
    def parse(cls, r: Any) -> RealVsReal:
        """A stored `real_vs_real`, checked like the spreads: a count that cannot be would make the
        machine look steadier (or noisier) than it was."""
        where = "validation.real_vs_real"
        fields = ("within", "cells", "repeats")
        if not isinstance(r, dict) or set(r) != set(fields):
            raise ValueError(f"{where}: expected the fields {', '.join(fields)}, got {r!r}")
        if not all(isinstance(r[n], int) and not isinstance(r[n], bool) for n in fields) \
                or not 0 <= r["within"] <= r["cells"] or r["cells"] < 1 or r["repeats"] < 2:
            raise ValueError(f"{where}: expected whole numbers 0 <= within <= cells, cells >= 1, repeats >= 2, "
                             f"got within {r['within']!r} of {r['cells']!r}, repeats {r['repeats']!r}")
        return cls(r["within"], r["cells"], r["repeats"])

    def as_dict(self) -> dict[str, int]:
        return {"within": self.within, "cells": self.cells, "repeats": self.repeats}


@dataclass(frozen=True)
class Validation:
    """A profile's `validation` block: the spread of sim/real per percentile key, and where it ran."""

    spreads: Mapping[str, RatioSpread]
    date: str
    machine: str
    workloads: tuple[str, ...]
    seeds: tuple[int, ...]
    loads: tuple[float, ...]
    real_vs_real: RealVsReal | None = None  # absent where each real run was made once

    @classmethod
    def from_profile(cls, metadata: Mapping[str, Any]) -> Validation | None:
        v = metadata.get("validation")
        if not isinstance(v, dict) or not isinstance(v.get("ratios"), dict):
            return None
        spreads = {_ratio_key(k): _spread(k, s) for k, s in v["ratios"].items()}
        loads = v.get("loads", ())
        if not isinstance(loads, list) or not all(_number(x) and x > 0 for x in loads):
            raise ValueError(f"validation.loads: expected a list of fractions of saturation, got {loads!r}")
        real = RealVsReal.parse(v["real_vs_real"]) if "real_vs_real" in v else None
        return cls(spreads, str(v.get("date", "?")), str(v.get("machine", "?")), tuple(v.get("workloads", ())),
                   tuple(v.get("seeds", ())), tuple(loads), real)

    def as_dict(self) -> dict[str, Any]:
        doc = {"date": self.date, "machine": self.machine, "workloads": list(self.workloads),
               "seeds": list(self.seeds), "loads": list(self.loads),
               "ratios": {k: s.as_dict() for k, s in self.spreads.items()}}
        if self.real_vs_real is not None:
            doc["real_vs_real"] = self.real_vs_real.as_dict()
        return doc

    def spread_for(self, metric: str, q: int) -> RatioSpread | None:
        """The spread measured for `metric` at percentile `q`, or the nearest percentile above it
        that was measured (p95 reads p99 where there is one, else p90)."""
        measured = sorted(int(k.rpartition("_p")[2]) for k in self.spreads if k.startswith(metric + "_p"))
        if not measured:
            return None
        above = [m for m in measured if m >= q]
        return self.spreads[f"{metric}_p{above[0] if above else measured[-1]}"]

    def gated_within(self) -> tuple[int, int]:
        """(cells within WITHIN, cells) over the gated percentiles."""
        keys = [k for k in self.spreads if int(k.rpartition("_p")[2]) in GATED_QUANTILES]
        return sum(self.spreads[k].within for k in keys), sum(self.spreads[k].cells for k in keys)

    def describe(self) -> str:
        within, cells = self.gated_within()
        text = (f"validated {self.date} on {self.machine}: {within} of {cells} p50/p90 cells within "
                f"{WITHIN:.0%} ({', '.join(self.workloads)}; seeds {', '.join(map(str, self.seeds))}; "
                f"loads {', '.join(f'{x:.0%}' for x in self.loads)})")
        if self.real_vs_real is not None:
            r = self.real_vs_real
            text += (f"; real vs real {r.within} of {r.cells} ({r.within / r.cells:.0%}) over "
                     f"{r.repeats} runs each")
        return text


def safe_bound(bound: float, spread: RatioSpread | None) -> float:
    """The simulated value that keeps the real one under `bound` when the simulator is as
    optimistic as the low end of its validation (unchanged where it was not optimistic)."""
    if spread is None or spread.low >= 1.0:
        return bound
    return bound * spread.low


def band(value: float, spread: RatioSpread) -> tuple[float, float]:
    """Where the real value likely lies, given a simulated `value` and the ratios' spread."""
    return value / max(spread.high, 1e-9), value / max(spread.low, 1e-9)
