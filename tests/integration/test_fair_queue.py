"""Fair share at the queue door through the server: a tenant over its share of a full queue is refused
(429 `fair_share_exceeded`), and a tenant within its share gets in by dropping the over-share
tenant's newest queued request, whose client is answered with that refusal: a 429 when nothing was
sent to it yet, an SSE error event when another choice of its request was already streaming."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}
FLOOD = {"X-Tenant": "flood"}
TRICKLE = {"X-Tenant": "trickle"}


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def raw_post(url: str, body: dict, headers: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n".encode() + data
    )
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection ended before {marker!r}: {buf[-300:]!r}")
        buf += chunk
    return buf


def read_all(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """A whole `Connection: close` response: status, headers, body."""
    buf = b""
    while chunk := sock.recv(65536):
        buf += chunk
    sock.close()
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def state(live) -> tuple[int, int]:
    st = live.core.scheduler_stats
    return st.num_running, st.num_waiting


def metric(live, name: str, **labels: str) -> float:
    text = httpx.get(live.url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


@pytest.fixture(scope="module")
def fair(server_factory):
    """Fair share over a queue of two (and 64 prompt tokens), one running request at a time; the
    trickler weighs 3. Steps take at least 10 ms, so a long request outlasts the test."""
    live = server_factory({"policy": "fair", "tenant_weights": {"trickle": 3.0}, "max_num_seqs": 1,
                           "max_queue_len": 2, "max_queued_tokens": 64})
    runner = live.core.executor
    real = runner.execute

    def slow(out):
        time.sleep(0.01)
        return real(out)

    runner.execute = slow
    return live


def test_the_over_share_tenant_is_refused_and_its_dropped_requests_are_answered(fair):
    # The flood: a streaming request of two choices (one runs, one waits) and one more queued, also
    # streaming (the same answer as a non-streaming one while nothing has been sent).
    stream = raw_post(fair.url, {"prompt": "A", "stream": True, "n": 2, **LONG}, FLOOD)
    read_until(stream, b"data: ")
    wait_for(lambda: state(fair) == (1, 1), what="one choice running, one waiting")
    queued = raw_post(fair.url, {"prompt": "B", "stream": True, **LONG}, FLOOD)
    wait_for(lambda: state(fair) == (1, 2), what="a full queue")

    # The trickler (weight 3) holds nothing: the flood's newest request makes room for it, and that
    # request's client gets a real 429 (no header is sent before the first token) with the reason.
    t1 = raw_post(fair.url, {"prompt": "C", "max_tokens": 3}, TRICKLE)
    status, headers, body = read_all(queued)
    error = json.loads(body)["error"]
    assert status == 429 and error["code"] == "fair_share_exceeded" and error["type"] == "rate_limit_error"
    assert error["message"].startswith("tenant 'flood' is over its fair share of the queue")
    assert "trickle" not in error["message"]  # another tenant's name is not disclosed
    assert int(headers["retry-after"]) >= 1

    # The flood asking for more is refused at the door: it is the one over its share.
    r = httpx.post(fair.url + "/v1/completions", json={"prompt": "D", "max_tokens": 2}, headers=FLOOD, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "fair_share_exceeded", r.text
    assert "with this request it would hold 2 of the 2 queued requests" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1

    # The trickler again (2 per 3 of weight against the flood's 1): the flood's waiting choice is
    # dropped. Its sibling was already streaming, so the stream ends with the refusal as an event.
    t2 = raw_post(fair.url, {"prompt": "E", "max_tokens": 3}, TRICKLE)
    events = [e.decode() for e in re.findall(rb"data: ([^\n]*)\n\n", read_until(stream, b"data: [DONE]\n\n"))]
    stream.close()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "fair_share_exceeded"

    # Both trickler requests run once the flood's stream has ended (its running choice is aborted).
    for sock in (t1, t2):
        status, _, body = read_all(sock)
        assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"
    assert fair.wait_idle() and fair.core.kv.num_free_blocks == fair.core.kv.num_blocks
    serving = fair.app.state.serving
    wait_for(lambda: serving.active == 0 and not serving.tenant_in_flight, what="released response slots")
    # Refusals answered as such: the door refusal and the dropped request answered 429.
    assert metric(fair, "cadence:rejected_requests_total", reason="fair_share") == 2
    assert metric(fair, "cadence:finished_requests_total", reason="evicted", tenant="flood") == 2


def test_a_request_that_could_never_be_queued_is_a_400(fair):
    # A prompt over --max-queued-tokens never fits, however long the client waits.
    r = httpx.post(fair.url + "/v1/completions", json={"prompt": list(range(1, 70)), "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "exceeds max_queued_tokens (64)" in r.json()["error"]["message"] and "retry-after" not in r.headers
    # Nor do more choices than the queue holds.
    r = httpx.post(fair.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "more than the waiting queue holds (2, max_queue_len)" in r.json()["error"]["message"]
    assert not fair.core.has_unfinished_requests()
