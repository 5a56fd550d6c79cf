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
