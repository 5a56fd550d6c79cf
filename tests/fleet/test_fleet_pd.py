"""Disaggregated prefill and decode on a local Ray cluster: one tiny prefill replica and one tiny
decode replica, the prompt's KV blocks moving between them (docs/fleet.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import ray
from fastapi.testclient import TestClient
from fleet_helpers import Fleet, complete, metric, running_fleet

from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app

pytestmark = pytest.mark.slow

# A cache of 80 blocks of 16 tokens holds one burst prompt's blocks (about 45) at a time.
PD_ENGINE = {"num_kv_blocks": 80, "max_num_seqs": 4, "max_queue_len": 8}
LONG = "The lighthouse keeper counted gulls, shells and letters she never sent to her sister. "
PROMPTS = ["The capital of France is", "def fibonacci(n):", LONG * 12 + "What did she count?"]


@pytest.fixture(scope="module")
def pd() -> Iterator[Fleet]:
    options = {"prefill_replicas": 1, "decode_replicas": 1, "kv_transfer_timeout_s": 20.0, "max_queued_requests": 16}
    with running_fleet(fleet_options=options, engine_options=PD_ENGINE) as f:
        yield f


def _local_outputs(fleet: Fleet, prompts: list[str], max_tokens: int) -> list[str]:
    engine = AsyncEngine(build_engine(fleet.engine_config, tiny=True))
    try:
        with TestClient(create_app(engine, fleet.server_config)) as local:
            return [complete(local, p, max_tokens=max_tokens, ignore_eos=True).json()["choices"][0]["text"]
                    for p in prompts]
    finally:
        engine.shutdown()


def _handle(name: str):
    from ray import serve

    from cadence.fleet.launch import pool_app

    return serve.get_deployment_handle(name, app_name=pool_app(name))


def _kv_states() -> dict[str, tuple[str, int, int, int]]:
    from cadence.fleet.deploy import DECODE_NAME, PREFILL_NAME
    from cadence.fleet.protocol import Target
    from cadence.fleet.state import deployment_replica_ids

    out = {}
    for pool in (PREFILL_NAME, DECODE_NAME):
        handle = _handle(pool)
        handle.info.remote().result(timeout_s=30)  # (the router learns the replicas on its first call)
        for rid in deployment_replica_ids(pool):
            out[pool] = handle.kv_state.remote(Target(rid)).result(timeout_s=30)
    return out


def _assert_idle(total_blocks: int) -> None:
    """No reservation left on either side, and every block free (cached prefixes count as free)."""
    for pool, (_, free, held, reservations) in _kv_states().items():
        assert (free, held, reservations) == (total_blocks, 0, 0), pool


def test_greedy_outputs_equal_a_single_engines_and_the_header_names_both(pd) -> None:
    expected = _local_outputs(pd, PROMPTS, 12)
    with httpx.Client(base_url=pd.url, timeout=60) as c:
        got = []
        for p in PROMPTS:
            r = complete(c, p, max_tokens=12, ignore_eos=True)
            assert r.status_code == 200, r.text
            assert r.headers["x-cadence-replica"].startswith("prefill=") and ", decode=" in r.headers["x-cadence-replica"]
            body = r.json()
            got.append(body["choices"][0]["text"])
            assert body["usage"]["completion_tokens"] == 12
            status = c.get(f"/v1/requests/{body['id']}").json()  # (from the decode replica)
            assert (status["state"], status["output_tokens"]) == ("finished", 12), status
            assert status["prompt_tokens"] == body["usage"]["prompt_tokens"], status
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True, "stream": True}) as r:
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {"))
    assert got == expected and all(expected)
    assert text == expected[2]
    _assert_idle(PD_ENGINE["num_kv_blocks"])


def test_a_stop_string_begun_in_the_first_tokens_text_ends_the_output_as_on_one_engine(pd) -> None:
    """The first token's text comes from the prefill replica, the rest from the decode replica: a
    stop string across the two is matched as one engine matches it. The request is also found by
    the id the client gave it (X-Request-Id)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    engine = AsyncEngine(build_engine(pd.engine_config, tiny=True))
    try:
        with TestClient(create_app(engine, pd.server_config)) as local:
            pieces = _streamed_texts(local, body)
            stop = pieces[0][-1] + pieces[1][:1]  # begins in the first token's text, ends in the second's
            expected = local.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    finally:
        engine.shutdown()
    assert expected["finish_reason"] == "stop" and expected["text"] == pieces[0][:-1]
    with httpx.Client(base_url=pd.url, timeout=60) as c:
        r = c.post("/v1/completions", json={**body, "stop": [stop]}, headers={"x-request-id": "stop-across"})
        streamed = "".join(_streamed_texts(c, {**body, "stop": [stop]}))
        status = c.get("/v1/requests/stop-across")
    assert r.status_code == 200 and ", decode=" in r.headers["x-cadence-replica"], r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected["text"], "stop", stop)
    assert streamed == expected["text"]
    assert status.status_code == 200 and status.json()["state"] == "finished", status.text


def _streamed_texts(client: Any, body: dict[str, Any]) -> list[str]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        return [ch["text"] for line in r.iter_lines() if line.startswith("data: {")
                for ch in json.loads(line[6:])["choices"]]

# Series that count requests, tokens and latency samples: a handed-off request once, as one engine.
COUNTED = ("cadence:finished_requests_total", "cadence:goodput_requests_total", "cadence:prompt_tokens_total",
           "cadence:generation_tokens_total", "cadence:time_to_first_token_seconds_count",
           "cadence:inter_token_latency_seconds_count", "cadence:e2e_request_latency_seconds_count",
           "cadence:request_queue_time_seconds_count")


def _counted(client: Any, requests: list[tuple[str, int]]) -> dict[str, float]:
    """What `requests` (prompt, max_tokens) add to the COUNTED series of `client`'s /metrics."""
    before = client.get("/metrics").text
    for prompt, n in requests:
        r = complete(client, prompt, max_tokens=n, ignore_eos=True)
        assert r.status_code == 200, r.text
    after = client.get("/metrics").text
    return {name: metric(after, name) - metric(before, name) for name in COUNTED}


def test_the_merged_metrics_count_each_handed_off_request_as_one_engine_does(pd) -> None:
    requests = [("Violet kites over the salt marsh drift", 5), ("Seven brass keys hang in the", 9),
                ("Under the orchard the badger family", 3)]  # (prompts no earlier test cached)
    engine = AsyncEngine(build_engine(pd.engine_config, tiny=True))
    try:
        with TestClient(create_app(engine, pd.server_config)) as local:
            expected = _counted(local, requests)
    finally:
        engine.shutdown()
    with httpx.Client(base_url=pd.url, timeout=60) as c:
        got = _counted(c, requests)
    assert expected["cadence:finished_requests_total"] == 3
    assert got == expected


def test_a_prompt_the_decode_side_holds_moves_no_bytes(pd) -> None:
    prompt = "A ferry timetable, stop by stop, with the tides at each pier. " * 8 + "When is the last boat?"
    with httpx.Client(base_url=pd.url, timeout=60) as c:
        m0 = c.get("/metrics").text
        first = complete(c, prompt, max_tokens=4)
        m1 = c.get("/metrics").text
        again = complete(c, prompt, max_tokens=4)
        m2 = c.get("/metrics").text
    assert first.status_code == again.status_code == 200
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    moved = [metric(b, "cadence:kv_transfer_bytes_total") - metric(a, "cadence:kv_transfer_bytes_total")
             for a, b in ((m0, m1), (m1, m2))]
    assert moved[0] > 0 and moved[1] == 0, moved
    blocks = metric(m2, "cadence:kv_transfer_blocks_total", source="cached") - metric(
        m1, "cadence:kv_transfer_blocks_total", source="cached")
    assert blocks > 0  # the repeat found its prompt's blocks cached on the decode side
    assert metric(m2, "cadence:kv_transfer_seconds_count") > metric(m0, "cadence:kv_transfer_seconds_count")


def test_a_burst_of_long_prompts_waits_for_decode_room_and_leaks_nothing(pd) -> None:
    prompts = [f"Burst {i}: " + LONG * 40 + f"Question {i}?" for i in range(5)]  # ~45 blocks each
    expected = _local_outputs(pd, prompts, 24)

    def one(p: str) -> httpx.Response:
        with httpx.Client(base_url=pd.url, timeout=120) as c:
            return complete(c, p, max_tokens=24, ignore_eos=True)

    with httpx.Client(base_url=pd.url, timeout=60) as c:
        before = metric(c.get("/metrics").text, "cadence:kv_reservations_refused_total")
        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(one, prompts))
        refused = metric(c.get("/metrics").text, "cadence:kv_reservations_refused_total") - before
    assert [r.status_code for r in responses] == [200] * len(prompts), [r.text for r in responses]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    assert refused > 0  # requests waited for room rather than overrunning the decode cache
    _assert_idle(PD_ENGINE["num_kv_blocks"])


def test_losing_the_prefill_replica_after_its_first_token_still_completes(pd) -> None:
    """The KV that does not come is recomputed by the decode replica: the output is unchanged."""
    from cadence.fleet.deploy import PREFILL_NAME

    prompt = LONG * 10 + "And the letters?"
    [expected] = _local_outputs(pd, [prompt], 40)
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    texts: list[str] = []
    with httpx.Client(base_url=pd.url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        prefill = r.headers["x-cadence-replica"].split(",")[0].removeprefix("prefill=")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if not texts:
                    ray.kill(_replica_actor(PREFILL_NAME, prefill), no_restart=True)
                texts += [ch["text"] for ch in json.loads(line[6:])["choices"]]
    assert "".join(texts) == expected


def test_losing_the_decode_replica_mid_stream_ends_the_stream_with_an_error(pd) -> None:
    from cadence.fleet.deploy import DECODE_NAME

    body = {"prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.Client(base_url=pd.url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        decode = r.headers["x-cadence-replica"].split("decode=")[1]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    ray.kill(_replica_actor(DECODE_NAME, decode), no_restart=True)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "unavailable" or "replica" in error["message"], error


def _replica_actor(deployment: str, replica_id: str):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if deployment in entry["name"] and entry["name"].endswith(replica_id):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise LookupError(replica_id)
