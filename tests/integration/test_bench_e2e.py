"""`cadence bench` end to end against a real cadence server (tiny model): counts, lengths, queue time."""

from __future__ import annotations

import json

from cadence.bench.client import BenchConfig, run_benchmark
from cadence.workload import builtin_workload


def test_bench_against_cadence_server(server, tmp_path) -> None:
    wl = builtin_workload("chat", 12, seed=3)
    cfg = BenchConfig(base_url=server.url, workload=wl, arrival="poisson", rate=20.0, seed=3,
                      out_dir=str(tmp_path), progress=False, slos={"ttft": 30.0})
    result = run_benchmark(cfg)
    assert len(result.records) == 12
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok]
    # ignore_eos + min_tokens make cadence produce exactly the asked lengths, counted from usage.
    for rec, req in zip(sorted(result.records, key=lambda r: r.index), wl.requests, strict=True):
        assert rec.output_tokens == req.output_tokens
        assert rec.queue_time is not None and 0.0 <= rec.queue_time <= rec.e2e
        assert 0.0 < rec.ttft <= rec.e2e
    overall = result.summary["overall"]
    assert overall["completed"] == 12 and overall["short_outputs"] == 0 and overall["goodput"] > 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["overall"]["completed"] == 12
    assert any(p.endswith(".png") for p in result.files)
