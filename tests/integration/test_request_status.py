"""GET /v1/requests/{id} on a live server with the tiny model: a request held waiting behind a
full sequence cap says so, and the ids it answers to are those of the responses."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from cadence.request import RequestStatus


def waiting_ids(live: Any) -> list[str]:
    """The ids in the engine's waiting queue (read from the test thread: retried if it changes)."""
    for _ in range(50):
        try:
            return [r.request_id for r in live.core.scheduler.waiting]
        except RuntimeError:  # the engine thread changed the queue mid-read
            time.sleep(0.01)
    raise AssertionError("could not read the waiting queue")


def queue_a_waiter(live: Any) -> threading.Thread:
    """A short completion sent from a thread, returned once it waits in the engine's queue."""
    waiter = threading.Thread(target=lambda: httpx.post(
        f"{live.url}/v1/completions", json={"prompt": "wait", "max_tokens": 2}, timeout=60))
    waiter.start()
    end = time.monotonic() + 30
    while not waiting_ids(live):
        assert time.monotonic() < end, "the second request never queued"
        time.sleep(0.005)
    return waiter


def test_a_request_behind_the_sequence_cap_says_why(server_factory) -> None:
    live = server_factory({"max_num_seqs": 1})
    long_body = {"prompt": "hold the seat", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    short_body = {"prompt": "wait for it", "max_tokens": 3, "ignore_eos": True}
    with httpx.Client(base_url=live.url, timeout=60) as client, client.stream("POST", "/v1/completions", json=long_body) as first:
        assert first.status_code == 200
        holder = first.headers["x-request-id"]
        done: dict[str, httpx.Response] = {}
        second = threading.Thread(target=lambda: done.setdefault("r", httpx.post(
            f"{live.url}/v1/completions", json=short_body, timeout=60)))
        second.start()
        end = time.monotonic() + 30
        while not waiting_ids(live):
            assert time.monotonic() < end, "the second request never queued"
            time.sleep(0.005)
        assert live.core.scheduler.requests[holder].status is RequestStatus.RUNNING
        rid = waiting_ids(live)[0]
        status = client.get(f"/v1/requests/{rid}")
        assert status.status_code == 200, status.text
        body = status.json()
        while body["wait_reason"] == "not_reached":  # asked before the engine's next step: ask again
            assert time.monotonic() < end, body
            body = client.get(f"/v1/requests/{rid}").json()
        assert body["state"] == "waiting" and body["queue_position"] == 0
        assert body["wait_reason"] == "max_num_seqs", body
        assert body["output_tokens"] == 0 and body["prompt_tokens_computed"] == 0
        third = threading.Thread(target=lambda: done.setdefault("third", httpx.post(
            f"{live.url}/v1/completions", json=short_body, timeout=60)))
        third.start()
        while len(waiting_ids(live)) < 2:
            assert time.monotonic() < end, "the third request never queued"
            time.sleep(0.005)
        last = waiting_ids(live)[1]
        behind = client.get(f"/v1/requests/{last}").json()
        while behind["wait_reason"] == "not_reached":
            assert time.monotonic() < end, behind
            behind = client.get(f"/v1/requests/{last}").json()
        assert behind["wait_reason"] == "behind" and behind["waiting_behind"] == rid, behind
        assert behind["queue_position"] == 1
        held = client.get(f"/v1/requests/{holder}").json()
        assert held["state"] in ("prefilling", "decoding") and held["wait_reason"] is None
        assert held["queue_position"] is None
    # Leaving the stream aborts the holder: the second request runs and answers with its id.
    second.join(60)
    third.join(60)
    assert done["third"].status_code == 200
    response = done["r"]
    assert response.status_code == 200, response.text
    assert response.json()["id"] == response.headers["x-request-id"] == rid
    with httpx.Client(base_url=live.url, timeout=60) as client:
        after = client.get(f"/v1/requests/{rid}").json()
        assert after["state"] == "finished" and after["finish_reason"] == "length" and after["output_tokens"] == 3
        aborted = client.get(f"/v1/requests/{holder}").json()
        assert aborted["state"] == "finished" and aborted["finish_reason"] == "abort"


def test_finished_requests_are_kept_a_bounded_number(server_factory, monkeypatch) -> None:
    import cadence.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "FINISHED_KEEP", 2)
    live = server_factory()
    body = {"prompt": "hi", "max_tokens": 1, "ignore_eos": True}
    with httpx.Client(base_url=live.url, timeout=60) as client:
        ids = [client.post("/v1/completions", json=body).headers["x-request-id"] for _ in range(3)]
        found = [client.get(f"/v1/requests/{rid}").status_code for rid in ids]
    assert found == [404, 200, 200]  # the oldest was forgotten


def test_a_waiting_request_has_a_predicted_ttft_from_the_shipped_profile(server_factory) -> None:
    import torch

    from cadence.sim.profile import default_profile_path

    live = server_factory({"max_num_seqs": 1})
    long_body = {"prompt": "hold the seat", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=60) as client, client.stream("POST", "/v1/completions", json=long_body):
        waiter = queue_a_waiter(live)
        body = client.get(f"/v1/requests/{waiting_ids(live)[0]}").json()
        assert body["state"] == "waiting"
        # Behind a holder that may decode 200 tokens: at least its remaining decode steps.
        assert isinstance(body["predicted_ttft"], float) and body["predicted_ttft"] > 0, body
        assert body["predicted_ttft_unavailable"] is None and body["ttft"] is None
        assert body["cost_profile"]["path"] == str(default_profile_path(torch.get_num_threads()))
        assert body["cost_profile"]["model"] == "SmolLM2-135M-Instruct"
    waiter.join(60)
    with httpx.Client(base_url=live.url, timeout=60) as client:
        rid = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).headers["x-request-id"]
        done = client.get(f"/v1/requests/{rid}").json()
    assert done["predicted_ttft"] is None and done["ttft"] is not None and done["ttft"] > 0


def test_without_a_profile_only_a_request_before_its_first_token_says_why_there_is_no_prediction(
        server_factory) -> None:
    live = server_factory({"max_num_seqs": 1}, cost_profile="none")
    long_body = {"prompt": "hold the seat", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=60) as client, client.stream("POST", "/v1/completions", json=long_body) as first:
        holder = first.headers["x-request-id"]  # the stream's headers come with its first token
        waiter = queue_a_waiter(live)
        waiting = client.get(f"/v1/requests/{waiting_ids(live)[0]}").json()
        decoding = client.get(f"/v1/requests/{holder}").json()
    waiter.join(60)
    assert waiting["state"] == "waiting" and waiting["predicted_ttft"] is None
    assert waiting["predicted_ttft_unavailable"] == "no cost-model profile is loaded"
    # Its first token is out: there is nothing to predict, so no reason either (as with a profile).
    assert decoding["state"] == "decoding" and decoding["ttft"] is not None
    assert decoding["predicted_ttft"] is None and decoding["predicted_ttft_unavailable"] is None, decoding
