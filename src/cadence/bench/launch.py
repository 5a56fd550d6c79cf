"""Start a server process for a measurement, wait until it answers, and stop it afterwards.

One piece for every place that measures a real server it starts itself: calibration's serving
phase (`cadence.sim.serving`) and the benchmark scripts (`benchmarks/bench_serve.py`, `knobs.py`,
`sim_fidelity.py`). The server runs in its own session, so stopping it also stops its children.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx


@contextmanager
def served(
    cmd: Sequence[str],
    ready_url: str,
    log_path: str | Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    append: bool = False,
    timeout: float = 300.0,
) -> Iterator[subprocess.Popen]:
    """Run `cmd` with its output in `log_path`; yield once `ready_url` answers 200; stop it on exit.

    First waits until nothing listens on `ready_url`'s port: the server stopped before may still
    hold it (a fleet's HTTP proxy is a Ray process of its own, which can outlive `cadence serve`
    by seconds), and the new one must not take its answer for its own."""
    wait_port_free(ready_url, timeout)
    with open(log_path, "a" if append else "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env), cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(ready_url, proc, log_path, timeout)
        yield proc
    finally:
        stop(proc)


def wait_port_free(url: str, timeout: float) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) != 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{host}:{port} is still taken after {timeout:.0f} s: another server listens there")


def wait_ready(url: str, proc: subprocess.Popen, log_path: str | Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready; see {log_path}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (a graceful drain), then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
