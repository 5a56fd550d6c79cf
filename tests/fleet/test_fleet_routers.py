"""Prefix affinity against round robin on a real fleet (two fleets, one after the other)."""

from __future__ import annotations

import httpx
import pytest
from fleet_helpers import complete, metric, running_fleet

pytestmark = pytest.mark.slow

# 25 documents, each asked about twice, all of them before any again: round robin over two
# replicas sends a document's second question to the other replica (25 is odd).
DOCS = [f"Document {d}: " + " ".join(f"clause {d}.{k} binds the parties to term {k * d % 97}." for k in range(12))
        for d in range(25)]


def _hit_rate(url: str) -> float:
    with httpx.Client(base_url=url, timeout=60) as c:
        before = c.get("/metrics").text
        for rnd in range(2):
            for doc in DOCS:
                r = complete(c, doc + f" Question {rnd}: who is bound?", max_tokens=2)
                assert r.status_code == 200, r.text
        after = c.get("/metrics").text
    name_q, name_h = "cadence:prefix_cache_query_tokens_total", "cadence:prefix_cache_hit_tokens_total"
    queried = metric(after, name_q) - metric(before, name_q)
    assert queried > 0
    return (metric(after, name_h) - metric(before, name_h)) / queried


def test_prefix_affinity_hits_the_cache_more_than_round_robin() -> None:
    with running_fleet("prefix-affinity") as fleet:
        affinity = _hit_rate(fleet.url)
    with running_fleet("round-robin") as fleet:
        round_robin = _hit_rate(fleet.url)
    assert affinity > 0.35 and affinity > 2 * round_robin, (affinity, round_robin)
