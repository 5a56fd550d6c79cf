"""The request-path probe against a real server: each probe is a new prompt (no prefix-cache hit
makes a first token cheap), prompts of both lengths are measured, and the fitted path is what the
client waited beyond the priced prefill steps."""

from __future__ import annotations

import dataclasses
import re

import httpx
import pytest

from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.sim.profile import default_profile_path
from cadence.sim.serving import fit_request_path, probe_request_path


def test_probe_times_fresh_prompts_of_each_length(server):
    hits_before = _prefix_hits(server.url)
    runs = probe_request_path(server.url, words=(4, 60), repeats=3, seed=5)
    assert len(runs) == 6
    short, long = [r["prompt_tokens"] for r in runs[:3]], [r["prompt_tokens"] for r in runs[3:]]
    assert max(short) < 20 and min(long) > 50  # usage reported by the server, per prompt
    assert all(r["ttft_s"] > 0 for r in runs)
    server.wait_idle()
    assert _prefix_hits(server.url) == hits_before
    # A model that prices every step at the minimum leaves the client's whole wait to the path.
    free = dataclasses.replace(StepCostModel.load(default_profile_path()), coefficients={}, overhead={})
    assert free.predict(StepFeatures(prefill_tokens=60, prefill_seqs=1, sampled=1)) == free.min_cost
    fit = fit_request_path(runs, free)
    short_ttfts = sorted(r["ttft_s"] for r in runs[:3])
    assert fit["per_request"] == pytest.approx(short_ttfts[1] - free.min_cost)  # the median, short prompts only


def _prefix_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^cadence:prefix_cache_hit_tokens_total (\S+)$", text, re.M)
    assert m, "cadence:prefix_cache_hit_tokens_total missing from /metrics"
    return float(m.group(1))
