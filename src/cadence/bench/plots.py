"""PNG plots of a benchmark: latency CDFs for one run, load curves for a sweep (matplotlib, Agg)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from cadence.bench.report import RequestRecord  # noqa: E402


def _cdf(ax, values: Sequence[float], title: str, label: str | None = None) -> None:
    xs = sorted(v * 1000 for v in values)
    if not xs:
        if label is None:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=label)
        for q in (0.5, 0.95, 0.99):
            ax.axhline(q, color="grey", linewidth=0.5, linestyle=":")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(True, alpha=0.3)


def plot_latency_cdfs(records: Sequence[RequestRecord], path: str | Path, title: str = "") -> Path:
    """One PNG with the CDFs of TTFT, ITL, TPOT and end-to-end latency of completed requests."""
    return plot_latency_cdfs_compared([("", records)], path, title)


def plot_latency_cdfs_compared(runs: Sequence[tuple[str, Sequence[RequestRecord]]], path: str | Path,
                               title: str = "") -> Path:
    """The same four CDFs with one labelled curve per run (e.g. two server settings)."""
    fig = latency_cdf_figure(runs, title)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_cdf_figure(runs: Sequence[tuple[str, Sequence[RequestRecord]]], title: str = "") -> Any:
    """The figure `plot_latency_cdfs_compared` saves (the caller closes it)."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for name, records in runs:
        ok = [r for r in records if r.ok]
        label = name or None
        _cdf(axes[0][0], [r.ttft for r in ok if r.ttft is not None], "time to first token", label)
        _cdf(axes[0][1], [g for r in ok for g in r.itls], "inter-token latency", label)
        _cdf(axes[1][0], [r.tpot for r in ok if r.tpot is not None], "time per output token", label)
        _cdf(axes[1][1], [r.e2e for r in ok if r.e2e is not None], "end-to-end latency", label)
    if any(name for name, _ in runs):
        for ax in (a for row in axes for a in row):
            ax.set_xscale("log")  # two settings can differ by orders of magnitude
            _readable_log_ticks(ax)
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _readable_log_ticks(ax: Any) -> None:
    """Plain-number labels that never overlap on a log axis. matplotlib's own label every minor
    tick in scientific notation when the range is under a decade (as two close TPOTs make it):
    '9.5x10^0 1.05x10^1 1.1x10^1 ...' run into each other."""
    lo, hi = ax.get_xlim()
    if lo <= 0 or hi <= lo:
        return
    decades = math.log10(hi / lo)
    if decades < 1:  # a few evenly spaced round values
        major: Any = MaxNLocator(nbins=4)
    else:  # 1-2-5 steps for a decade or two; decades only beyond
        major = LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,))
    ax.xaxis.set_major_locator(major)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_sweep(points: Sequence[tuple[float, dict]], path: str | Path, load_label: str = "offered load (req/s)",
               offered_diagonal: bool = True) -> Path:
    """Left: throughput and goodput against offered load. Right: p95 TTFT and ITL beside them.

    With `offered_diagonal` (rate sweeps) a dotted y = x line shows where completions keep up.
    """
    return plot_sweeps([("", points)], path, load_label, offered_diagonal)


def plot_sweeps(series: Sequence[tuple[str, Sequence[tuple[float, dict]]]], path: str | Path,
                load_label: str = "offered load (req/s)", offered_diagonal: bool = True) -> Path:
    """`plot_sweep` for several labelled sweeps on the same axes (one colour each), e.g. the same
    load against two server configurations."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    top = max((x for _, pts in series for x, _ in pts), default=0)
    if offered_diagonal and top:
        left.plot([0, top], [0, top], ":", color="grey", label="offered")
    log = False
    for i, (name, points) in enumerate(series):
        color = f"C{i}"
        tag = f"{name} " if name else ""
        xs = [x for x, _ in points]
        overall = [s["overall"] for _, s in points]
        left.plot(xs, [o["request_throughput"] or 0 for o in overall], "o-", color=color, label=f"{tag}throughput")
        if any(o["goodput"] is not None for o in overall):
            left.plot(xs, [o["goodput"] or 0 for o in overall], "s--", color=color, label=f"{tag}goodput (meets SLOs)")
        for key, style in (("ttft", "o-"), ("itl", "s--")):
            ys = [o[key]["p95"] * 1000 if o[key]["p95"] is not None else float("nan") for o in overall]
            right.plot(xs, ys, style, color=color if name else None, label=f"{tag}p95 {key.upper()}")
        log = log or any((o["ttft"]["p95"] or 0) > 0 for o in overall)
    left.set_xlabel(load_label)
    left.set_ylabel("completed req/s")
    left.legend()
    left.grid(True, alpha=0.3)
    left.set_title("throughput")
    right.set_title("p95 latency")
    right.set_xlabel(load_label)
    right.set_ylabel("ms")
    if log:
        right.set_yscale("log")  # TTFT and ITL differ by orders of magnitude near saturation
    right.legend()
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
