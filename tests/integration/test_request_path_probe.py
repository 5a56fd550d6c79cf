"""The request-path probe against a real server: each probe is a new prompt sent twice, the second
send timed with the prompt's full blocks in the prefix cache; prompts of each length are measured,
and the fitted path is what the client waited beyond the priced prefill steps."""

from __future__ import annotations

import dataclasses
import re

import httpx
import pytest

from cadence.executor.cost_model import StepCostModel, StepFeatures
from cadence.sim.profile import default_profile_path
from cadence.sim.serving import fit_request_path, probe_request_path


def test_probe_times_the_second_send_of_each_new_prompt_of_each_length(server):
    hits_before = _prefix_hits(server.url)
    runs = probe_request_path(server.url, words=(4, 60), repeats=3, seed=5)
    assert len(runs) == 6
    short, long = [r["prompt_tokens"] for r in runs[:3]], [r["prompt_tokens"] for r in runs[3:]]
    assert max(short) < 20 and min(long) > 50  # usage reported by the server, per prompt
    assert all(r["ttft_s"] > 0 for r in runs)
    block = server.core.scheduler.kv.block_size
    # The second send finds every full block of its prompt but the one holding its last token.
    assert [r["cached_tokens"] for r in runs] == [(r["prompt_tokens"] - 1) // block * block for r in runs]
    server.wait_idle()
    # ... and only its own: the first sends of new prompts found nothing cached.
    assert _prefix_hits(server.url) - hits_before == sum(r["cached_tokens"] for r in runs)
    # A model that prices every step at the minimum leaves the client's whole wait to the path.
    free = dataclasses.replace(StepCostModel.load(default_profile_path()), coefficients={}, overhead={})
    assert free.predict(StepFeatures(prefill_tokens=60, prefill_seqs=1, sampled=1)) == free.min_cost
    fit = fit_request_path(runs, free)
    x = [sorted(r["prompt_tokens"] for r in g)[1] for g in (runs[:3], runs[3:])]
    y = [sorted(r["ttft_s"] for r in g)[1] - free.min_cost for g in (runs[:3], runs[3:])]
    slope = (y[1] - y[0]) / (x[1] - x[0])  # the line through the two lengths' medians, clipped at 0
    assert fit["per_prompt_token"] == pytest.approx(max(slope, 0.0))
    assert fit["per_request"] == pytest.approx(max(y[0] - fit["per_prompt_token"] * x[0], 0.0)
                                               if slope > 0 else max((y[0] + y[1]) / 2, 0.0))


def _prefix_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^cadence:prefix_cache_hit_tokens_total (\S+)$", text, re.M)
    assert m, "cadence:prefix_cache_hit_tokens_total missing from /metrics"
    return float(m.group(1))
