"""The fleet on a local Ray cluster: two tiny engines behind one endpoint (see conftest.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from fleet_helpers import complete, metric

from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app

pytestmark = pytest.mark.slow

FAMILY_TEXT = {
    "a": "You are a meticulous assistant for a shipping company. Answer questions about parcels, customs "
         "forms, tracking numbers and delivery windows, citing the relevant policy section each time. " * 3,
    "b": "Here is the full text of a short story about a lighthouse keeper who collects shells, names "
         "every gull on the island and writes letters to a sister overseas that she never sends. " * 3,
}


def test_greedy_outputs_equal_a_single_engines(fleet) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", FAMILY_TEXT["a"] + "Where is parcel 7?"]
    engine = AsyncEngine(build_engine(fleet.engine_config, tiny=True))
    try:
        with TestClient(create_app(engine, fleet.server_config)) as local:
            expected = [complete(local, p, max_tokens=12).json()["choices"][0]["text"] for p in prompts]
    finally:
        engine.shutdown()
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        got = []
        for p in prompts:
            r = complete(c, p, max_tokens=12)
            assert r.status_code == 200, r.text
            assert r.headers["x-cadence-replica"]
            got.append(r.json()["choices"][0]["text"])
        # Streaming too: the deltas concatenate to the same text.
        with c.stream("POST", "/v1/completions", json={"prompt": prompts[0], "max_tokens": 12, "temperature": 0,
                                                        "stream": True}) as r:
            assert r.headers["x-cadence-replica"]
            text = "".join(_sse_texts(r.iter_lines()))
    assert got == expected and all(expected)
    assert text == expected[0]


def _sse_texts(lines) -> list[str]:
    import json

    out = []
    for line in lines:
        if line.startswith("data: {"):
            out += [ch["text"] for ch in json.loads(line[6:])["choices"]]
    return out


def test_families_each_land_on_one_replica_and_hit_the_cache(fleet) -> None:
    placed: dict[str, Counter[str]] = {f: Counter() for f in FAMILY_TEXT}
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        before = c.get("/metrics").text
        for i in range(10):
            for fam, text in FAMILY_TEXT.items():
                r = complete(c, text + f" Question {i}: what happens next?")
                assert r.status_code == 200, r.text
                placed[fam][r.headers["x-cadence-replica"]] += 1
        after = c.get("/metrics").text
    for fam, where in placed.items():
        assert where.most_common(1)[0][1] >= 9, (fam, placed)
    assert {w.most_common(1)[0][0] for w in placed.values()} == set(fleet.replica_ids())  # one each
    queries = metric(after, "cadence:prefix_cache_query_tokens_total") - metric(before, "cadence:prefix_cache_query_tokens_total")
    hits = metric(after, "cadence:prefix_cache_hit_tokens_total") - metric(before, "cadence:prefix_cache_hit_tokens_total")
    assert queries > 0 and hits / queries > 0.6, (hits, queries)
    # The router counts what decided each choice: requests sent one at a time find no load to
    # divert them, and every family's requests after its first find its prefix.
    decided = {o: metric(after, "cadence:fleet_routed_requests_total", outcome=o)
               - metric(before, "cadence:fleet_routed_requests_total", outcome=o)
               for o in ("prefix", "diverted", "unbalanced", "no-prefix", "load")}
    assert sum(decided.values()) == 20 and decided["prefix"] >= 18, decided
    assert decided["diverted"] == decided["unbalanced"] == decided["load"] == 0, decided


def test_metrics_are_the_sum_of_the_replicas(fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        for i in range(4):
            assert complete(c, f"count {i}").status_code == 200
        merged = c.get("/metrics").text
    per_replica = fleet.replica_call("metrics")
    assert len(per_replica) == 2
    for name in ("cadence:generation_tokens_total", "cadence:prompt_tokens_total",
                 "cadence:time_to_first_token_seconds_count", "cadence:finished_requests_total"):
        total = sum(metric(text, name) for text in per_replica.values())
        assert total > 0 and metric(merged, name) == total, name
    bucket = 'cadence:e2e_request_latency_seconds_bucket'
    assert metric(merged, bucket, le="+Inf") == sum(metric(t, bucket, le="+Inf") for t in per_replica.values())
    for rid in per_replica:  # gauges: one series per replica, and their sum
        assert f'cadence:running_requests{{replica="{rid}"}}' in merged
    assert "cadence:running_requests 0.0" in merged


def test_client_disconnect_aborts_on_the_replica(fleet) -> None:
    async def leave_mid_stream() -> None:
        async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as c:
            body = {"prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one token in: leave

    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        before = c.get("/metrics").text
    asyncio.run(leave_mid_stream())
    loads = _wait(lambda: fleet.replica_call("load"), lambda v: all(n == 0 and run == 0 for _, n, run in v.values()))
    assert all(n == 0 and run == 0 for _, n, run in loads.values()), loads
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        after = c.get("/metrics").text
    aborted = metric(after, "cadence:finished_requests_total", reason="abort") - metric(
        before, "cadence:finished_requests_total", reason="abort")
    tokens = metric(after, "cadence:generation_tokens_total") - metric(before, "cadence:generation_tokens_total")
    assert aborted == 1 and tokens < 900


def _wait(read, done, timeout: float = 20.0):
    import time

    end = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < end:
        time.sleep(0.1)
        value = read()
    return value


def test_every_replica_full_gives_429_with_retry_after(fleet) -> None:
    # A replica's engine queues at most 2 requests (max_queue_len) and runs 4; the ingress holds
    # 2 more for the two replicas' 12 seats: of 20 long requests at once, the rest are refused,
    # each with Retry-After, and none hangs.
    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=fleet.url, timeout=120) as c:
            body = {"prompt": "Flood", "max_tokens": 60, "ignore_eos": True}
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(20)])

    answers = asyncio.run(flood())
    codes = Counter(r.status_code for r in answers)
    assert set(codes) == {200, 429} and codes[200] >= 2, codes
    for r in answers:
        if r.status_code == 429:
            assert float(r.headers["retry-after"]) > 0
            assert r.headers["content-type"] == "application/json", r.text
            assert r.json()["error"]["type"]


def test_a_burst_is_refused_at_the_ingress_only_beyond_what_it_holds(fleet) -> None:
    # The ingress holds 14 requests at once: two replicas' 6 seats each (max_num_seqs 4 +
    # max_queue_len 2) and 2 more (max_queued_requests). Of 20 arriving together it refuses at
    # most the 6 beyond that ("every replica is full") and serves the rest: what the replicas'
    # engines cannot take yet (a waiting queue of 2 fills before a step moves requests into the
    # running batch) waits at the ingress for room, never refused by an engine.
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=fleet.url, timeout=120) as c:
            bodies = [{"prompt": f"Burst {i}", "max_tokens": 40, "ignore_eos": True} for i in range(20)]
            return await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies])

    answers = asyncio.run(burst())
    codes = Counter(r.status_code for r in answers)
    refused = [r for r in answers if r.status_code == 429]
    assert set(codes) <= {200, 429} and codes[200] >= 14 and len(refused) <= 20 - 14, codes
    for r in refused:
        assert "every replica is full" in r.text, r.text  # (the ingress's, not an engine's full queue)
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full", r.text
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in answers if r.status_code == 200)
    with httpx.Client(base_url=fleet.url, timeout=60) as c:  # what the burst held is let go
        assert all(complete(c, f"After the burst {i}").status_code == 200 for i in range(3))


def test_tenants_priorities_and_deadlines_reach_the_replicas(fleet) -> None:
    name = "cadence:finished_requests_total"
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        before = c.get("/metrics").text
        r = c.post("/v1/completions", headers={"x-tenant": "alice"},
                   json={"prompt": "tenant test", "max_tokens": 3, "priority": 2, "deadline": 60})
        assert r.status_code == 200, r.text
        late = c.post("/v1/completions", json={"prompt": "too late", "max_tokens": 3, "deadline": 1e-6})
        after = c.get("/metrics").text
    assert metric(after, name, tenant="alice") - metric(before, name, tenant="alice") == 1
    assert late.status_code == 408, late.text
    assert late.json()["error"]["code"] == "deadline_exceeded" or "deadline" in late.json()["error"]["message"]


def test_request_status_asks_the_replica_that_served_it(fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        status = c.get(f"/v1/requests/{rid}")
        assert status.status_code == 200, status.text
        body = status.json()
        assert body["id"] == rid and body["state"] == "finished" and body["output_tokens"] == 3
        assert status.headers["x-cadence-replica"] == r.headers["x-cadence-replica"]
        assert c.get("/v1/requests/cmpl-not-a-request").status_code == 404


def test_a_response_has_one_request_id_header_and_it_finds_the_request(fleet) -> None:
    # Serve's proxy adds its own X-Request-Id to every response: a second header beside the
    # response's id would reach a client as "cmpl-..., <uuid>", an id nothing answers to.
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "one id", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        (rid,) = r.headers.get_list("x-request-id")
        status = c.get(f"/v1/requests/{rid}")
        assert status.status_code == 200, status.text
        assert status.json()["state"] == "finished" and status.json()["output_tokens"] == 3
        assert c.get(f"/v1/requests/{r.json()['id']}").status_code == 200  # the body's id answers too
        with c.stream("POST", "/v1/completions", json={"prompt": "streamed", "max_tokens": 2, "stream": True}) as s:
            (sid,) = s.headers.get_list("x-request-id")
            s.read()
        assert c.get(f"/v1/requests/{sid}").json()["output_tokens"] == 2
        # A client's own X-Request-Id is the one sent back, and finds its request; naming another
        # response's id with it does not take that id over.
        mine = c.post("/v1/completions", json={"prompt": "mine", "max_tokens": 2, "ignore_eos": True},
                      headers={"X-Request-Id": "client-chosen-7"})
        assert mine.headers.get_list("x-request-id") == ["client-chosen-7"]
        assert c.get("/v1/requests/client-chosen-7").json()["output_tokens"] == 2
        c.post("/v1/completions", json={"prompt": "squatter", "max_tokens": 1, "ignore_eos": True},
               headers={"X-Request-Id": r.json()["id"]})
        assert c.get(f"/v1/requests/{r.json()['id']}").json()["output_tokens"] == 3


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` (IPv4, /proc/net/tcp)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
            inodes.add(fields[9])
    return inodes


def test_cadence_serves_the_port_itself_without_serves_http_proxy(fleet) -> None:
    import os

    import ray

    # The socket the clients reach is this process's (start_fleet's, as `cadence serve`'s) ...
    listening = _listening_inodes(fleet.server_config.port)
    assert listening
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    assert listening <= mine
    # ... and no Serve HTTP proxy nor ingress deployment runs: responses cross Ray once.
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert any("CadenceReplica" in name for name in actors), actors
    assert not [name for name in actors if "PROXY" in name.upper() or "CadenceIngress" in name], actors
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        r = complete(c, "served here")
    assert r.status_code == 200 and r.headers["x-cadence-replica"]


def test_the_local_rays_unused_head_processes_are_stopped(fleet) -> None:
    import os

    from ray._private import worker

    from cadence.fleet.launch import UNUSED_HEAD_PROCESSES

    # Ray's node no longer holds them (its shutdown stops what it holds) ...
    held = set(worker._global_node.all_processes)
    assert "raylet" in held and not held & set(UNUSED_HEAD_PROCESSES), held
    # ... and no process of this one's runs their scripts.
    scripts = ("dashboard/dashboard.py", "_private/log_monitor.py")
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == os.getpid()]
    running = [c for c in children if any(s in _cmdline(c) for s in scripts)]
    assert children and not running, [_cmdline(c) for c in running]
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        assert complete(c, "served without them").status_code == 200


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):  # (gone meanwhile)
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def test_the_single_servers_head_limits_guard_the_fleet(fleet) -> None:
    # A head over max_header_bytes (64 KiB) is refused as on a single server: 431 with its error.
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        r = c.get("/v1/models", headers={"X-Big": "a" * 70_000})
        assert r.status_code == 431, r.text
        assert r.json()["error"]["code"] == "request_headers_too_large"
        assert c.get("/v1/models").status_code == 200  # (and the server serves on)


def test_a_real_clusters_address_passes_the_ray_address_check(fleet) -> None:
    import ray

    from cadence.fleet.launch import check_reachable

    # The check that refuses what is not Ray (tests/unit/test_fleet_cli.py) lets Ray's GCS through.
    check_reachable(ray.get_runtime_context().gcs_address)
