"""The compared latency CDFs: tick labels readable (plain numbers, none overlapping) whatever the range."""

from __future__ import annotations

import random

import matplotlib.pyplot as plt
import pytest

from cadence.bench.plots import latency_cdf_figure
from cadence.bench.report import RequestRecord


def _records(tpot: float, seed: int) -> list[RequestRecord]:
    rnd, out = random.Random(seed), []
    for i in range(100):
        sent = rnd.uniform(0, 10)
        times = [sent + rnd.uniform(0.05, 0.4)]
        for _ in range(30):
            times.append(times[-1] + tpot * rnd.uniform(0.7, 1.3))
        out.append(RequestRecord(index=i, send_time=sent, first_token_time=times[0], token_times=times,
                                 end_time=times[-1], output_tokens=len(times), status=200))
    return out


@pytest.mark.parametrize(("tpot_a", "tpot_b"), [(0.010, 0.011), (0.1, 0.1001), (0.021, 0.034), (0.005, 0.5), (5e-4, 2.0)])
def test_compared_cdf_tick_labels_never_overlap(tpot_a: float, tpot_b: float) -> None:
    fig = latency_cdf_figure([("a", _records(tpot_a, 1)), ("b", _records(tpot_b, 2))])
    try:
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            labels = [t for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True)
                      if t.get_visible() and t.get_text() and lo <= t.get_position()[0] <= hi]
            assert len(labels) >= 2, ax.get_title()
            assert all("times" not in t.get_text() for t in labels)  # 12, not 1.2x10^1
            boxes = [t.get_window_extent(renderer) for t in labels]
            for i in range(len(boxes)):
                for j in range(i + 1, len(boxes)):
                    assert not boxes[i].overlaps(boxes[j]), (ax.get_title(), labels[i].get_text(), labels[j].get_text())
    finally:
        plt.close(fig)
