"""A second signal (or a first SIGINT) stops the server at once and cleanly: every stream ends with
an error event and `data: [DONE]`, a waiting non-streaming request gets a 503 in the usual error
shape, a request whose body is still arriving gets a 503 too, all within about a second; nothing
logs a traceback, and the process exits."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_process import CliServer, read_response, status_of

MAX_TOKENS = 2000  # far longer than the test: both requests are still running at the second signal
LONG = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}


def _stream(server: CliServer, out: dict) -> threading.Thread:
    def run() -> None:
        body = {"prompt": "a", **LONG, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            out["events"] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line.removeprefix("data: "))
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _non_streaming(server: CliServer, out: dict) -> threading.Thread:
    def run() -> None:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "b", **LONG}, timeout=60)
        out["status"], out["body"], out["at"] = r.status_code, r.json(), time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _slow_upload(server: CliServer, out: dict) -> threading.Thread:
    """A request whose body has only begun to arrive (the rest never comes)."""
    sock = server.connect(timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{\"prompt\": "
    )

    def run() -> None:
        with sock:
            out["answer"] = read_response(sock, timeout=60)
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _running(server: CliServer) -> int:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return int(float(next(line.split()[-1] for line in text.splitlines() if line.startswith("cadence:running_requests"))))


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize(
    "signals, exit_code",
    [
        ((signal.SIGTERM, signal.SIGTERM), 0),
        ((signal.SIGTERM, signal.SIGINT), 130),
        ((signal.SIGINT,), 130),
    ],
    ids=["term-term", "term-int", "int"],
)
def test_stop_signal_ends_everything_at_once_and_cleanly(cli_server_factory, signals, exit_code):
    server = cli_server_factory("--shutdown-timeout", "60", "--max-model-len", "2048")
    streamed, waited, uploading = {}, {}, {}
    threads = [_stream(server, streamed), _non_streaming(server, waited), _slow_upload(server, uploading)]
    _wait(lambda: len(streamed.get("events", [])) > 0 and _running(server) == 2, 60, "both requests to run")
    *drain, stop = signals
    for sig in drain:  # SIGTERM first: draining, with 60 s for the requests to finish
        server.proc.send_signal(sig)
        _wait(lambda: httpx.get(server.url + "/ready", timeout=5).status_code == 503, 10, "the drain")
    sent = time.monotonic()
    server.proc.send_signal(stop)
    code = server.proc.wait(30)
    exited = time.monotonic() - sent
    for t in threads:
        t.join(30)
    answered = max(out["at"] for out in (streamed, waited, uploading)) - sent
    assert code == exit_code
    assert answered < 1.5, f"the last answer came {answered:.1f} s after the signal"
    # The rest of the exit is the interpreter's own teardown, torch's above all: 0.3 s on an idle
    # 2-core machine, over 10 s on one loaded five times over. What the signal promises is the
    # answers above; the exit only has to come, not to race the machine's load.
    assert exited < 25.0, f"the server took {exited:.1f} s to exit"
    # The stream: some tokens, then a terminal error event, then [DONE].
    events = streamed["events"]
    assert streamed["status"] == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {
        "error": {"message": "the server is shutting down", "type": "service_unavailable_error",
                  "param": None, "code": "unavailable"}
    }
    assert 1 <= len(events) - 2 < MAX_TOKENS
    # The non-streaming request: a 503 in the usual shape.
    assert waited["status"] == 503
    assert waited["body"]["error"]["code"] == "unavailable"
    # The request still uploading its body: a 503 too.
    upload_answer = uploading["answer"]
    assert status_of(upload_answer) == 503, upload_answer[:300]
    assert json.loads(upload_answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "unavailable"
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
