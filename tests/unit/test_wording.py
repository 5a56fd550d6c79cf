"""Counts in messages agree with their number."""

from __future__ import annotations

from cadence.bench.report import RequestRecord, summarize
from cadence.wording import counted


def test_counted() -> None:
    assert [counted(n, "request") for n in (0, 1, 2)] == ["0 requests", "1 request", "2 requests"]
    assert counted(1, "child", "children") == "1 child" and counted(3, "child", "children") == "3 children"


def test_bench_warning_for_one_rate_limited_request() -> None:
    refused = RequestRecord(index=0, send_time=0.0, end_time=0.1, status=429, error="HTTP 429: full")
    warnings = summarize([refused], {})["warnings"]
    assert any(w.startswith("1 request refused with HTTP 429") for w in warnings), warnings
