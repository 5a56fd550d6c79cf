"""GET /dashboard and /dashboard/data on a live tiny-model server under streaming load."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from dashboard_load import StreamingLoad

KEYS = {"admin": "k-admin", "acme": "k-acme", "globex": "k-globex"}
SERVER_OPTIONS: dict[str, Any] = {
    "api_keys": tuple(KEYS.values()),
    "api_key_tenants": (("k-acme", "acme"), ("k-globex", "globex")),
}
ENGINE_OPTIONS = {"max_num_seqs": 2, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def live(server_factory):
    return server_factory(ENGINE_OPTIONS, **SERVER_OPTIONS)


def data(live, key: str) -> dict[str, Any]:
    r = httpx.get(f"{live.url}/dashboard/data", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    return r.json()


def poll_until(read: Callable[[], dict[str, Any]], cond: Callable[[dict[str, Any]], bool], timeout: float = 30) -> dict:
    """Read the dashboard (as its page does, a few times a second) until `cond` holds."""
    end = time.monotonic() + timeout
    while True:
        d = read()
        if cond(d) or time.monotonic() > end:
            return d
        time.sleep(0.05)


def test_the_page_is_self_contained_and_holds_no_data(live):
    r = httpx.get(f"{live.url}/dashboard", timeout=10)  # no key: the page is static, like /health
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-frame-options"] == "DENY"
    html = r.text
    assert not re.search(r"https?://", html), "the page refers to another site"
    assert not re.search(r"\s(src|href)\s*=", html), "the page loads something besides itself"
    assert "<script>" in html and "/data" in html


def test_the_data_needs_a_key(live):
    assert httpx.get(f"{live.url}/dashboard/data", timeout=10).status_code == 401
    bad = httpx.get(f"{live.url}/dashboard/data", headers={"authorization": "Bearer nope"}, timeout=10)
    assert bad.status_code == 401
    tenant_key = httpx.get(f"{live.url}/dashboard/data", headers={"authorization": "Bearer k-acme"}, timeout=10)
    assert tenant_key.status_code == 200


def test_the_data_follows_the_engine_under_load(live):
    model = live.engine.model_name
    with StreamingLoad(live.url, model, ["k-acme", "k-acme", "k-acme", "k-globex", "k-globex"]) as load:
        read = lambda: data(live, KEYS["admin"])  # noqa: E731
        # Five streams, two sequences at a time: both tenants have requests waiting at some point.
        busy = poll_until(read, lambda d: len(d["queue"]["by_tenant"] or {}) == 2)
        assert set(busy["queue"]["by_tenant"]) == {"acme", "globex"}, busy["queue"]
        assert sum(busy["queue"]["by_priority"].values()) == sum(busy["queue"]["by_tenant"].values())
        steps = busy["steps"]
        assert steps and any(s["decode_rows"] > 0 for s in steps) and any(s["prefill_tokens"] > 0 for s in steps)
        assert all(s["decode_rows"] <= 2 and s["running"] <= 2 for s in steps)  # max_num_seqs
        assert all(s["prefill_tokens"] + s["decode_rows"] <= 256 for s in steps)  # max_num_batched_tokens
        assert busy["limits"] == {"max_num_batched_tokens": 256, "max_num_seqs": 2, "kv_blocks": 512}
        kv = busy["kv"]
        assert kv["used"] + kv["cached"] + kv["free"] == kv["total"] == 512
        assert load.wait_finished(6), load.errors
        later = poll_until(read, lambda d: set(d["service"]["by_tenant"]) == {"acme", "globex"})
        mine = data(live, KEYS["acme"])
    assert not load.errors, load.errors
    service = later["service"]
    assert set(service["by_tenant"]) == {"acme", "globex"}
    assert service["output_tokens"] == sum(service["by_tenant"].values())
    assert all(n % 200 == 0 for n in service["by_tenant"].values())  # whole streams of 200 tokens
    assert later["latency"]["ttft"]["count"] >= 6 and later["latency"]["itl"]["count"] >= 6 * 199
    assert 0 < later["latency"]["itl"]["p50"] <= later["latency"]["itl"]["p99"]
    assert later["refusals"]["by_reason"].get("invalid_request", 0) >= 5
    assert later["refusals"]["total"] >= later["refusals"]["window"] > 0
    # A tenant's key: its own rows, every total, no other tenant's name.
    assert mine["tenant"] == "acme"
    assert set(mine["service"]["by_tenant"]) <= {"acme"}
    assert set(mine["queue"]["by_tenant"] or {}) <= {"acme"}
    assert "globex" not in str(mine)
    assert mine["service"]["output_tokens"] >= later["service"]["output_tokens"]


def test_an_idle_engine_shows_its_cached_prefix_blocks(live):
    data(live, KEYS["admin"])  # the dashboard is watched: the engine counts its queues and cache
    body = {"model": live.engine.model_name, "prompt": "a prompt of a few full blocks " * 12, "max_tokens": 4}
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"authorization": "Bearer k-admin"}, timeout=60)
    assert r.status_code == 200
    assert live.wait_idle()
    d = data(live, KEYS["admin"])
    # The request's full prompt blocks stay findable by hash once freed: cached, not free.
    assert d["requests"] == {"running": 0, "waiting": 0}
    assert d["kv"]["used"] == 0 and d["kv"]["cached"] >= r.json()["usage"]["prompt_tokens"] // live.core.kv.block_size
    assert d["kv"]["cached"] + d["kv"]["free"] == 512
