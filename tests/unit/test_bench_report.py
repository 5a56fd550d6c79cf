"""Report arithmetic against hand-computed cases: percentiles, goodput, throughput, fairness."""

from __future__ import annotations

import json
import os
import random
from array import array
from pathlib import Path

import numpy as np
import pytest

from cadence.bench.plots import plot_latency_cdfs, plot_sweep
from cadence.bench.report import (
    RequestRecord,
    client_starvation,
    compare,
    distribution,
    format_table,
    jain_index,
    meets_slos,
    parse_slos,
    percentile,
    pooled_itls,
    summarize,
    summarize_records,
)


def rec(i: int, send: float, tokens: list[float], end: float | None = None, status: int = 200, **kw) -> RequestRecord:
    """A completed request whose token chunks arrived at `tokens` (absolute seconds)."""
    return RequestRecord(index=i, send_time=send, first_token_time=tokens[0] if tokens else None,
                         token_times=list(tokens), end_time=end if end is not None else (tokens[-1] if tokens else send),
                         output_tokens=len(tokens), output_tokens_asked=len(tokens), status=status,
                         prompt_tokens=kw.pop("prompt_tokens", 10), **kw)


def test_percentile_by_hand() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == pytest.approx(2.5)  # h = 1.5
    assert percentile(xs, 90) == pytest.approx(3.7)  # h = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (50, 90, 95, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution() -> None:
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d["count"] == 4 and d["mean"] == 2.5 and d["max"] == 4.0 and d["p50"] == pytest.approx(2.5)
    assert distribution([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None, "max": None}


def test_jain_index() -> None:
    assert jain_index([1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 2.0]) == pytest.approx(9 / 10)  # (1+2)^2 / (2 * (1+4))
    assert jain_index([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError):
        jain_index([])
    with pytest.raises(ValueError):
        jain_index([1.0, -1.0])


def test_parse_slos() -> None:
    assert parse_slos(["ttft=0.5", "itl=0.1", "E2E=10"]) == {"ttft": 0.5, "itl": 0.1, "e2e": 10.0}
    for bad in ("ttft", "speed=1", "ttft=fast", "ttft=0", "ttft=-1"):
        with pytest.raises(ValueError):
            parse_slos([bad])


def test_record_derived_latencies() -> None:
    r = rec(0, send=1.0, tokens=[1.2, 1.25, 1.45], end=1.5)
    assert r.ttft == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.05, 0.2])
    assert r.tpot == pytest.approx((1.45 - 1.2) / 2)
    assert r.e2e == pytest.approx(0.5)
    assert RequestRecord.from_dict(r.to_dict()).token_times == r.token_times


def _four() -> list[RequestRecord]:
    return [
        rec(0, 0.0, [0.3, 0.35, 0.40], end=1.0, tenant="a"),  # meets ttft, itl, e2e
        rec(1, 0.5, [1.1, 1.15], end=1.2, tenant="a"),  # ttft 0.6 misses ttft=0.5
        rec(2, 1.0, [1.2, 1.4, 1.45], end=2.0, tenant="b"),  # a 0.2 s gap misses itl=0.1
        rec(3, 1.5, [], end=1.6, status=429, tenant="b", error="HTTP 429: full", retry_after=1.0),
    ]


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = {"ttft": 0.5, "itl": 0.1, "e2e": 10.0}
    records = _four()
    assert [meets_slos(r, slos) for r in records] == [True, False, False, False]
    s = summarize_records(records, slos)
    assert s["duration_s"] == pytest.approx(2.0)  # first send 0.0, last end 2.0
    assert s["goodput"] == pytest.approx(1 / 2.0)
    assert s["goodput_fraction"] == pytest.approx(1 / 4)
    assert meets_slos(records[1], {"e2e": 1.0}) and not meets_slos(records[1], {"e2e": 0.6})
    assert not meets_slos(records[0], {"queue": 1.0})  # no queue time reported: cannot be shown


def test_throughput_and_counts() -> None:
    s = summarize_records(_four(), {})
    assert (s["requests"], s["completed"], s["errors"], s["rate_limited"]) == (4, 3, 1, 1)
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["output_tokens"] == 8 and s["output_token_throughput"] == pytest.approx(8 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((8 + 30) / 2.0)
    assert s["goodput"] is None
    assert s["ttft"]["count"] == 3 and s["ttft"]["max"] == pytest.approx(0.6)
    assert s["itl"]["count"] == 5  # gaps pooled over requests: 2 + 1 + 2
    assert s["itl"]["max"] == pytest.approx(0.2)


def test_short_outputs_are_counted() -> None:
    r = rec(0, 0.0, [0.1, 0.2], end=0.3)
    r.output_tokens_asked = 5
    assert summarize_records([r], {})["short_outputs"] == 1


def test_short_outputs_warn_by_finish_reason() -> None:
    """Stopping at EOS means ignore_eos was ignored; a deadline is the server's own decision."""
    eos = rec(0, 0.0, [0.1, 0.2], end=0.3, finish_reason="stop")
    late = rec(1, 0.0, [0.1], end=0.3, finish_reason="deadline")
    full = rec(2, 0.0, [0.1, 0.2], end=0.3, finish_reason="length")
    eos.output_tokens_asked = late.output_tokens_asked = 5
    warnings = summarize([eos, late, full], {})["warnings"]
    assert any("1 of 3" in w and "ignore_eos" in w for w in warnings)
    assert any("1 with finish_reason 'deadline'" in w for w in warnings)
    only_late = summarize([late, full], {})["warnings"]
    assert not any("ignore_eos" in w for w in only_late) and any("deadline" in w for w in only_late)


def test_per_tenant_and_fairness() -> None:
    s = summarize(_four(), {"ttft": 0.5})
    a, b = s["per_tenant"]["a"], s["per_tenant"]["b"]
    assert (a["completed"], b["completed"], b["rate_limited"]) == (2, 1, 1)
    # Both groups share the run's 2 s: a produced 5 tokens, b 3.
    assert a["output_token_throughput"] == pytest.approx(2.5) and b["output_token_throughput"] == pytest.approx(1.5)
    assert s["fairness"]["tenants"]["jain_output_throughput"] == pytest.approx((2.5 + 1.5) ** 2 / (2 * (2.5**2 + 1.5**2)))
    assert s["fairness"]["priorities"]["jain_output_throughput"] is None  # one class only
    assert s["errors"] == {"HTTP 429": 1}
    assert any("429" in w for w in s["warnings"])
    table = format_table(s)
    assert "ttft" in table and "Jain's index" in table and "goodput" in table


def test_compare_prints_ratios() -> None:
    a = summarize(_four(), {})
    b = summarize([rec(0, 0.0, [0.15, 0.2], end=1.0)], {})
    text = compare(a, b, "base", "new")
    row = next(line for line in text.splitlines() if line.startswith("request_throughput"))
    # A: 3 completed / 2 s = 1.5 req/s; B: 1 / 1 s = 1.0 req/s -> B/A 0.667
    assert row.split()[-3:] == ["1.5", "1", "0.667"]
    ttft = next(line for line in text.splitlines() if line.startswith("ttft.p50"))
    assert ttft.split()[-1] == f"{0.15 / 0.3:.3f}"


def test_plots_write_png(tmp_path: Path) -> None:
    records = _four()
    p = plot_latency_cdfs(records, tmp_path / "cdf.png", "t")
    assert p.read_bytes()[:4] == b"\x89PNG"
    points = [(1.0, summarize(records, {"ttft": 0.5})), (2.0, summarize(records[:2], {"ttft": 0.5}))]
    assert plot_sweep(points, tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_pooled_itls_equal_each_records_gaps_concatenated() -> None:
    rng = random.Random(3)
    for _ in range(50):
        recs = []
        for i in range(rng.randint(0, 6)):
            t = sorted(rng.uniform(0, 10) for _ in range(rng.choice([0, 1, 1, 2, 5])))
            recs.append(RequestRecord(index=i, token_times=t if i % 2 else array("d", t)))  # as the simulator keeps them
        expected = [g for r in recs for g in r.itls]
        assert pooled_itls(recs).tolist() == expected  # exactly: the same subtractions


def test_distribution_takes_an_array_and_agrees_with_percentile() -> None:
    xs = [0.3, 0.1, 0.25, 0.9, 0.5, 0.05, 0.7]
    d, a = distribution(xs), distribution(np.array(xs))
    assert d == a
    assert all(d[f"p{q}"] == percentile(xs, q) for q in (50, 90, 95, 99))
    assert d["max"] == 0.9 and d["mean"] == pytest.approx(sum(xs) / len(xs))


def test_table_switches_to_seconds_when_milliseconds_would_fill_the_columns() -> None:
    """A simulated day of queueing in ms would run the columns together: the table goes to seconds."""
    short = format_table(summarize([rec(0, 0.0, [0.25, 0.5]), rec(1, 0.0, [0.5, 1.0])], {}))
    assert "metric (ms)" in short and "500.0" in short
    long = format_table(summarize([rec(0, 0.0, [90_000.0, 90_001.0]), rec(1, 0.0, [26_123.5, 26_124.0])], {}))
    assert "metric (s)" in long and "metric (ms)" not in long
    ttft = next(line for line in long.splitlines() if line.startswith("ttft")).split()
    assert ttft[1] == "2" and float(ttft[-1]) == 90_000.0  # count, then max, each its own column
    assert all(len(line.split()) == 8 for line in long.splitlines() if line.split()[0] in ("ttft", "itl", "e2e"))


def _replay(events: list[tuple[float, dict]], source_from_text: bool = False) -> RequestRecord:
    """Fold a recorded stream (arrival time, SSE event) into a record the way the client does."""
    from cadence.bench.client import _on_event

    r = RequestRecord(index=0, send_time=1.0, status=200, output_tokens_asked=8)
    for now, obj in events:
        _on_event(r, obj, now)
    r.end_time = events[-1][0]
    if source_from_text:  # no usage: the client re-counts the text (2 tokens here)
        r.output_tokens, r.output_count_source = 2, "tokenize"
    return r


def _chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


def test_tpot_spans_an_end_of_sequence_token_that_streams_no_text() -> None:
    """cadence and vLLM stream "Yes" "." then EOS as an empty chunk with finish_reason stop, and
    count it in usage (3 tokens, one step apart): TPOT is 0.1 s, not (1.2 - 1.1) / 2 = 0.05."""
    events = [
        (1.05, _chat_chunk({"role": "assistant", "content": ""})),
        (1.1, _chat_chunk({"content": "Yes"})),
        (1.2, _chat_chunk({"content": "."})),
        (1.3, _chat_chunk({}, "stop")),
        (1.31, {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 3}}),
    ]
    r = _replay(events)
    assert (r.output_tokens, r.output_count_source, r.finish_reason) == (3, "usage", "stop")
    assert r.ttft == pytest.approx(0.1) and r.itls == pytest.approx([0.1])  # text chunks only
    assert r.tpot == pytest.approx(0.1)
    assert RequestRecord.from_dict(r.to_dict()).tpot == pytest.approx(0.1)  # re-analysis of requests.jsonl
    # Counted from the text (no usage), the EOS is not among the tokens: the span ends at the text.
    assert _replay(events[:-1], source_from_text=True).tpot == pytest.approx(0.1)
    # The cap reached with text in the finishing chunk: nothing changes.
    capped = _replay([(1.1, _chat_chunk({"content": "a"})), (1.2, _chat_chunk({"content": "b"}, "length")),
                      (1.21, {"choices": [], "usage": {"completion_tokens": 2}})])
    assert capped.tpot == pytest.approx(0.1)


def test_short_outputs_without_exact_lengths_asked_do_not_blame_the_server() -> None:
    """--no-exact-output sends no ignore_eos/min_tokens: a model stopping early is what was asked."""
    eos = rec(0, 0.0, [0.1, 0.2], end=0.3, finish_reason="stop")
    eos.output_tokens_asked = 5
    asked = summarize([eos], {}, {"force_output_lengths": True})["warnings"]
    assert any("does not honour ignore_eos" in w for w in asked)
    free = summarize([eos], {}, {"force_output_lengths": False})["warnings"]
    assert not any("does not honour" in w for w in free)
    assert any("1 of 1 completed requests stopped before max_tokens" in w and "model chose" in w for w in free)


def test_compare_warns_when_runs_differ_in_more_than_one_setting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from cadence.bench.cli import _compare

    meta = {"model": "m", "endpoint": "chat", "workload": "chat", "arrival": "poisson", "rate": 4.0,
            "concurrency": None, "num_requests": 4, "seed": 0}
    runs = {"same": meta, "rate": {**meta, "rate": 8.0}, "three": {**meta, "rate": 8.0, "workload": "code",
                                                                      "endpoint": "completions"}}
    for name, m in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(summarize(_four(), {}, m)))
    out = {}
    for name in runs:
        assert _compare([str(tmp_path / "same.json"), str(tmp_path / f"{name}.json")]) == 0
        out[name] = capsys.readouterr().out
    assert "warning" not in out["same"] and "differ" not in out["same"]
    assert "note: the runs differ in rate: 4.0 vs 8.0" in out["rate"] and "warning" not in out["rate"]
    warning = next(line for line in out["three"].splitlines() if line.startswith("warning:"))
    assert "3 settings" in warning and "endpoint: chat vs completions" in warning and "workload: chat vs code" in warning


def test_first_plot_logs_nothing_about_matplotlib_font_cache(tmp_path: Path) -> None:
    """A fresh matplotlib config (as on a new machine) builds its font cache on the first plot;
    that is not news for the user of `cadence bench`."""
    import subprocess
    import sys

    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(summarize(_four(), {}, {"label": name})))
        (run / "requests.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in _four()))
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"), "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    done = subprocess.run([sys.executable, "-m", "cadence.cli", "bench", "compare", str(tmp_path / "a"),
                           str(tmp_path / "b"), "--out", str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "latency_cdf_compare.png").exists()
    assert "matplotlib" not in done.stderr and "fontManager" not in done.stderr, done.stderr


def _stream(i: int, stall_at: float | None, resume: float = 0.0, step: float = 0.02) -> RequestRecord:
    """A stream of a chunk every `step` s; after the chunk at `stall_at` nothing is read until
    `resume`, when five chunks are read at once."""
    times, t = [], 0.1 + i * 0.003
    while len(times) < 60:
        times.append(t)
        if stall_at is not None and abs(t - stall_at) < step / 2:
            t = resume
            times += [t + k * 2e-5 for k in range(5)]
            t += 5 * 2e-5
        t += step
    return rec(i, 0.0, times)


def test_client_starvation_warned_when_streams_burst_together() -> None:
    # All four streams stall together and then read their buffered chunks at once.
    starved = [_stream(i, stall_at=0.6 + i * 0.003, resume=0.8) for i in range(4)]
    warning = client_starvation(starved)
    assert warning is not None and warning.startswith("the client was starved of CPU: 4 of 4 streams")
    assert "200 ms" in warning  # the longest stall: stream 0's, from 0.6 s to 0.8 s
    assert warning in summarize(starved, {})["warnings"]
    # Steady streams, or a single stream's burst (the server's own doing, not the client's): no warning.
    assert client_starvation([_stream(i, stall_at=None) for i in range(4)]) is None
    alone = [_stream(0, stall_at=0.6, resume=0.8), *(_stream(i, stall_at=None) for i in range(1, 4))]
    assert client_starvation(alone) is None
    apart = [_stream(i, stall_at=0.3 + 0.2 * i, resume=0.45 + 0.2 * i) for i in range(4)]  # at different moments
    assert client_starvation(apart) is None
