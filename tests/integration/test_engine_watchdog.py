"""The engine watchdog: a step that never returns makes the server unhealthy, answers every client
waiting on it and refuses new ones; a step that is long but expected does not."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}


def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Hang:
    """Wraps the model runner: once `armed`, the next step blocks until `release` (a deadlocked kernel)."""

    def __init__(self, live: Any) -> None:
        runner = live.core.executor
        self.real = runner.execute
        self.armed, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()
        runner.execute = self.execute

    def execute(self, out: Any) -> Any:
        if self.armed.is_set():
            self.entered.set()
            self.release.wait(120)
        return self.real(out)


class Call(threading.Thread):
    """One request in the background; `result` is (status, events or JSON body)."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first_event = threading.Event()
        self.result: tuple[int, Any] | None = None

    def run(self) -> None:
        with httpx.Client(timeout=60) as c:
            if not self.body.get("stream"):
                r = c.post(self.url + "/v1/completions", json=self.body)
                self.result = (r.status_code, r.json())
                return
            events: list[str] = []
            with c.stream("POST", self.url + "/v1/completions", json=self.body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        self.first_event.set()
            self.result = (r.status_code, events)


def metric(live: Any, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(live.url + "/metrics").text, re.M)
    assert m, f"{name} is not exported"
    return float(m.group(1))


def test_a_stalled_step_fails_everyone_waiting_and_the_health_checks(server_factory, caplog):
    live = server_factory({"step_timeout": 1.0})
    hang = Hang(live)
    try:
        assert metric(live, "cadence:engine_healthy") == 1.0
        stream = Call(live.url, {"prompt": "Hi", "stream": True, **LONG})
        stream.start()
        assert stream.first_event.wait(30), "the stream did not start"
        plain = Call(live.url, {"prompt": "Hello", **LONG})
        plain.start()
        wait_for(lambda: live.engine.num_in_flight == 2, what="both requests in the engine")
        with caplog.at_level(logging.ERROR, logger="cadence.engine"):
            hang.armed.set()
            assert hang.entered.wait(30)
            stalled_at = time.monotonic()
            stream.join(30)
            plain.join(30)
        assert time.monotonic() - stalled_at < 10, "the waiting clients were not answered promptly"

        # The stream had its first tokens: an error event, then [DONE].
        status, events = stream.result
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable_error" and "running for" in error["message"]
        assert "choices" in json.loads(events[0])
        # The non-streaming request had no answer yet: a 503 with the reason.
        status, body = plain.result
        assert status == 503 and "running for" in body["error"]["message"], body

        health = httpx.get(live.url + "/health")
        assert health.status_code == 503
        assert re.search(r"running for \d+\.\d s, over the 1\.0 s limit", health.json()["error"]["message"])
        ready = httpx.get(live.url + "/ready")
        assert ready.status_code == 503 and "running for" in ready.json()["reason"]
        t0 = time.monotonic()
        refused = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and time.monotonic() - t0 < 2.0
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        assert "running for" in refused.json()["error"]["message"]
        assert metric(live, "cadence:engine_healthy") == 0.0
        stalls = [r for r in caplog.records if r.name == "cadence.engine" and r.levelno == logging.ERROR]
        assert len(stalls) == 1 and re.search(r"engine stalled: .*running for \d+\.\d s", stalls[0].getMessage())
    finally:
        hang.release.set()
    # The stalled step returns after all: the engine frees what it held and stays down.
    wait_for(lambda: not live.engine._thread.is_alive(), what="the engine thread to stop")
    assert live.core.kv.num_free_blocks == live.core.kv.num_blocks
    assert not live.core.has_unfinished_requests()
    assert httpx.get(live.url + "/health").status_code == 503


def test_a_long_step_the_engine_expects_is_not_a_stall(server_factory):
    """Steps cost 5 ms a token: a full prefill of 512 tokens (2.6 s) is past the 1 s floor, but
    within 5x what a 64-token step before it predicts for a full step, so nothing trips."""
    live = server_factory({"step_timeout": 1.0, "max_num_batched_tokens": 512})
    runner = live.core.executor
    real = runner.execute
    steps: list[int] = []

    def paced(out: Any) -> Any:
        steps.append(out.num_batched_tokens)
        time.sleep(0.005 * out.num_batched_tokens)
        return real(out)

    runner.execute = paced
    short = httpx.post(live.url + "/v1/completions", json={"prompt": list(range(700, 764)), "max_tokens": 2},
                       timeout=60)
    assert short.status_code == 200 and max(steps) == 64, (short.text, steps, live.engine.dead_reason)
    r = httpx.post(live.url + "/v1/completions", json={"prompt": list(range(100, 611)), "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, (r.text, live.engine.dead_reason)
    assert max(steps) >= 500, steps  # the long step did happen
    assert live.engine.is_healthy, live.engine.dead_reason
    assert httpx.get(live.url + "/health").status_code == 200
