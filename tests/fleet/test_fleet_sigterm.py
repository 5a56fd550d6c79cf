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


def _session_processes(sid: int) -> list[str]:
    """The command lines of the live processes of session `sid` (what a server started and left)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace").replace("\0", " ")
        except OSError:  # (gone meanwhile)
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{pid} {cmdline[:120]}")
    return found


def test_sigterm_while_the_fleet_starts_stops_ray_and_leaves_no_process() -> None:
    # Ray's own handler took SIGTERM once Ray was up (the process aborted, its Ray's agents stayed).
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--tiny", "--replicas", "1", "--replica-threads", "1",
           "--port", str(free_port()), "--device", "cpu", "--dtype", "float32"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # (Ray is up, the replicas are being deployed)
            lines.append(line)
            if "Started Serve" in line:
                break
        assert proc.poll() is None, "".join(lines)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        rest = proc.stderr.read()
        assert code == 128 + signal.SIGTERM, (code, rest[-2000:])
        assert "SIGTERM received" not in rest, rest[-2000:]
        end = time.monotonic() + 20  # (Ray's processes end once their head has gone)
        while _session_processes(proc.pid) and time.monotonic() < end:
            time.sleep(0.5)
        assert not _session_processes(proc.pid), _session_processes(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for line in _session_processes(proc.pid):  # (leave nothing behind, whatever the outcome)
            os.kill(int(line.split()[0]), signal.SIGKILL)
