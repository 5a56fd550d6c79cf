"""PNG plots of a benchmark: latency CDFs for one run, load curves for a sweep (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from cadence.bench.report import RequestRecord  # noqa: E402


def _cdf(ax, values: Sequence[float], title: str) -> None:
    xs = sorted(v * 1000 for v in values)
    if not xs:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post")
        for q in (0.5, 0.95, 0.99):
            ax.axhline(q, color="grey", linewidth=0.5, linestyle=":")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(True, alpha=0.3)


def plot_latency_cdfs(records: Sequence[RequestRecord], path: str | Path, title: str = "") -> Path:
    """One PNG with the CDFs of TTFT, ITL, TPOT and end-to-end latency of completed requests."""
    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _cdf(axes[0][0], [r.ttft for r in ok if r.ttft is not None], "time to first token")
    _cdf(axes[0][1], [g for r in ok for g in r.itls], "inter-token latency")
    _cdf(axes[1][0], [r.tpot for r in ok if r.tpot is not None], "time per output token")
    _cdf(axes[1][1], [r.e2e for r in ok if r.e2e is not None], "end-to-end latency")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(points: Sequence[tuple[float, dict]], path: str | Path, load_label: str = "offered load (req/s)",
               offered_diagonal: bool = True) -> Path:
    """Left: throughput and goodput against offered load. Right: p95 TTFT and ITL beside them.

    With `offered_diagonal` (rate sweeps) a dotted y = x line shows where completions keep up.
    """
    xs = [x for x, _ in points]
    overall = [s["overall"] for _, s in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if offered_diagonal and xs:
        left.plot([0, max(xs)], [0, max(xs)], ":", color="grey", label="offered")
    left.plot(xs, [o["request_throughput"] or 0 for o in overall], "o-", label="throughput")
    if any(o["goodput"] is not None for o in overall):
        left.plot(xs, [o["goodput"] or 0 for o in overall], "s--", label="goodput (meets SLOs)")
    left.set_xlabel(load_label)
    left.set_ylabel("completed req/s")
    left.legend()
    left.grid(True, alpha=0.3)
    for key, style in (("ttft", "o-"), ("itl", "s--")):
        ys = [o[key]["p95"] * 1000 if o[key]["p95"] is not None else float("nan") for o in overall]
        right.plot(xs, ys, style, label=f"p95 {key.upper()}")
    left.set_title("throughput")
    right.set_title("p95 latency")
    right.set_xlabel(load_label)
    right.set_ylabel("ms")
    if any((o["ttft"]["p95"] or 0) > 0 for o in overall):
        right.set_yscale("log")  # TTFT and ITL differ by orders of magnitude near saturation
    right.legend()
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
