"""SIGTERM drains the fleet as it drains a single server: `cadence serve --replicas 2` in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fleet_helpers import free_port

pytestmark = pytest.mark.slow


def test_sigterm_finishes_requests_in_flight_and_refuses_new_ones() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--tiny", "--replicas", "2", "--replica-threads", "1",
           "--port", str(port), "--num-kv-blocks", "512", "--max-model-len", "2048", "--device", "cpu",
           "--dtype", "float32", "--shutdown-timeout", "60", "--log-level", "warning"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            end = time.monotonic() + 180
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    if c.get("/health").status_code == 200 and c.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < end, "the fleet did not start"
                time.sleep(0.5)
            texts: list[str] = []
            first_token = threading.Event()

            def stream() -> None:
                body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                with httpx.Client(base_url=url, timeout=120) as s, s.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            texts.append(line[6:])
                            first_token.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert first_token.wait(60)
            proc.send_signal(signal.SIGTERM)
            # New requests are refused while the one in flight finishes.
            end = time.monotonic() + 30
            while c.get("/ready").status_code != 503:
                assert time.monotonic() < end
                time.sleep(0.05)
            r = c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert r.status_code == 503, r.text
            reader.join(120)
        assert texts[-1] == "[DONE]"
        last = json.loads(texts[-2])
        assert last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:  # (SIGTERM first: it stops Ray, which SIGKILL would leave behind)
            proc.terminate()
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
