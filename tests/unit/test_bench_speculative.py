"""benchmarks/bench_speculative.py builds its input-grounded prompts from the standard library's
own source: every function it names must have source on the interpreter running it (functions in
C, and modules the interpreter freezes into itself, have none)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_speculative", ROOT / "benchmarks" / "bench_speculative.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up while being made)
    spec.loader.exec_module(module)
    return module


def test_every_grounded_source_has_source_text(tmp_path):
    bench = _load()
    for name in bench.GROUNDED_SOURCES:
        assert inspect.getsource(bench._resolve(name)).strip(), name
    out = tmp_path / "grounded.jsonl"
    bench.grounded_requests(out, len(bench.GROUNDED_SOURCES), 64)
    lines = out.read_text().splitlines()
    assert len(lines) == len(bench.GROUNDED_SOURCES)
    assert all("def " in line for line in lines)  # each prompt quotes a function
