"""Two `cadence serve --replicas` on one machine: each starts a Ray of its own, even with
RAY_ADDRESS naming the other's (joining a cluster is what --ray-address is for), and both serve."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from fleet_helpers import free_port

pytestmark = pytest.mark.slow


def _start(port: int, ray_address: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--tiny", "--replicas", "1", "--replica-threads", "1",
           "--port", str(port), "--num-kv-blocks", "128", "--max-model-len", "512", "--device", "cpu",
           "--dtype", "float32", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.Popen(cmd, env={**env, "RAY_USAGE_STATS_ENABLED": "0"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    end = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < end, "the fleet did not start"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:  # SIGTERM: it stops its Ray (SIGKILL would leave it behind)
        proc.terminate()
        try:
            return proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return proc.returncode


def test_a_second_fleet_on_the_machine_starts_its_own_ray_and_both_serve() -> None:
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    first = _start(ports[0])
    second = None
    try:
        _wait_ready(first, f"http://127.0.0.1:{ports[0]}")
        from ray._private.services import find_gcs_addresses

        (gcs,) = find_gcs_addresses()  # the first fleet's Ray, the only one running
        # Ray would join the cluster RAY_ADDRESS names (and refuse the fleet's num_cpus there)
        second = _start(ports[1], ray_address=gcs)
        _wait_ready(second, f"http://127.0.0.1:{ports[1]}")
        replicas = []
        for port in ports:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            replicas.append(r.headers["x-cadence-replica"])
        assert replicas[0] != replicas[1]  # two fleets, not one fleet's replica behind both ports
    finally:
        codes = [_stop(p) for p in (second, first) if p is not None]
    assert codes == [0, 0]
