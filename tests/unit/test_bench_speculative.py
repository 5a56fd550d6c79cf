"""benchmarks/bench_speculative.py builds its input-grounded prompts from the standard library's
own source: every function it names must have source on the interpreter running it (functions in
C, and modules the interpreter freezes into itself, have none)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _load():
    return load_benchmark("bench_speculative")


def test_every_grounded_source_has_source_text(tmp_path):
    bench = _load()
    for name in bench.GROUNDED_SOURCES:
        assert inspect.getsource(bench._resolve(name)).strip(), name
    out = tmp_path / "grounded.jsonl"
    bench.grounded_requests(out, len(bench.GROUNDED_SOURCES), 64)
    lines = out.read_text().splitlines()
    assert len(lines) == len(bench.GROUNDED_SOURCES)
    assert all("def " in line for line in lines)  # each prompt quotes a function


def test_serve_args_reach_every_cells_server(tmp_path, monkeypatch):
    bench = _load()
    started = []

    class Stop(Exception):
        pass

    def served(cmd, *a, **k):
        started.append(cmd)
        raise Stop

    monkeypatch.setattr(bench, "served", served)
    monkeypatch.setattr("sys.argv", ["bench_speculative.py", "--streams", "", "--rounds", "1", "--num-requests", "1",
                                     "--serve-args", "--cost-profile /tmp/p.json", "--out", str(tmp_path)])
    with pytest.raises(Stop):
        bench.main()
    assert started and started[0][-2:] == ["--cost-profile", "/tmp/p.json"]


def test_interleaved_cell_sends_each_request_to_every_mode_in_rotating_order_and_counts_changed_texts(
        tmp_path, monkeypatch):
    bench = _load()
    ports = {"off": 1, "fixed": 2, "adaptive": 3}
    sent = []

    def timed(port, body):
        sent.append((port, body["i"]))
        text = "changed" if (port, body["i"]) == (3, 1) else f"answer {body['i']}"
        return bench.Timed(text, tokens=10, seconds={1: 2.0, 2: 1.0, 3: 0.5}[port], ttft=0.1)

    counters = {p: dict.fromkeys(bench.SPEC_COUNTERS, 0.0) for p in ports.values()}

    def spec_counters(port):
        out = dict(counters[port])
        for name, step in zip(bench.SPEC_COUNTERS, (2.0, 8.0, 6.0), strict=True):
            counters[port][name] += step if port != 1 else 0.0
        return out

    monkeypatch.setattr(bench, "request_bodies", lambda *a: [{"i": 0}, {"i": 1}])
    monkeypatch.setattr(bench, "timed_request", timed)
    monkeypatch.setattr(bench, "spec_counters", spec_counters)
    cells, differ = bench.interleaved_cell("grounded", 1, None, tmp_path, ports)
    # Round 1: request 0 starts at the second mode, request 1 at the third.
    assert sent == [(2, 0), (3, 0), (1, 0), (3, 1), (1, 1), (2, 1)]
    assert differ == 1  # request 1's text from the adaptive server is not off's
    assert cells["off"].tok_s == 20 / 4.0 and cells["adaptive"].tok_s == 20 / 1.0
    assert cells["fixed"].acceptance == 6.0 / 8.0 and cells["fixed"].mean_k == 4.0
    assert cells["off"].acceptance is None
    assert abs(cells["off"].tpot_ms - 1000 * 1.9 / 9) < 1e-9
