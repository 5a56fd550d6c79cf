"""benchmarks/bench_fleet.py `ceiling`: simulated hit rates of prefix affinity, round-robin and one
server with the fleet's cache, by fleet size and family count (no server started)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ceiling_simulates_each_fleet_size_and_family_count(tmp_path: Path) -> None:
    out = tmp_path / "ceiling"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_fleet.py"), "ceiling", "--fleet-sizes", "2,3",
           "--families-list", "3", "--seeds", "0,1", "--per-family", "4", "--prefix-tokens", "64",
           "--suffix-tokens", "16", "--output-tokens", "4", "--rate", "4", "--kv-blocks", "64", "--max-num-seqs", "4",
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "rows.json").read_text())
    assert [(r["replicas"], r["families"]) for r in rows] == [(2, 3), (3, 3)]
    for r in rows:
        hit = r["hit"]
        assert all(len(v) == 2 and all(0 < x < 1 for x in v) for v in hit.values()), hit
        # Every prefix fits in every cache here: round-robin computes each family's prefix once per
        # replica it visits, the single server once in all (the most any fleet can find), affinity
        # once unless the load term sends a request elsewhere.
        for a, rr, one in zip(hit["prefix-affinity"], hit["round-robin"], hit["single"], strict=True):
            assert rr < a <= one, hit
        ratios = [a / b for a, b in zip(hit["prefix-affinity"], hit["round-robin"], strict=True)]
        assert f"| {r['replicas']} | 3 | {statistics.median(hit['prefix-affinity']):.0%} |" in done.stdout
        assert f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" in done.stdout
    # Each simulated fleet left its run, with the router's decisions, where the table says it came from.
    meta = json.loads((out / "prefix-affinity_n2_f3_s0" / "summary.json").read_text())["meta"]
    assert meta["replicas"] == 2 and sum(meta["routing_decisions"].values()) == 12
