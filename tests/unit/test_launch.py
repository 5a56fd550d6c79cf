"""cadence.bench.launch: start a real server process, wait for it, stop it (and say why when it fails)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from cadence.bench.launch import served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_waits_for_ready_and_stops_on_exit(tmp_path: Path) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    log = tmp_path / "server.log"
    with served(cmd, f"http://127.0.0.1:{port}/", log, timeout=30) as proc:
        assert proc.poll() is None  # answering, still running
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    assert proc.poll() is not None  # stopped on leaving the block
    log.write_text("before\n")
    failing = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with (
        pytest.raises(RuntimeError, match=r"exited with 3 .*see .*server\.log"),
        served(failing, "http://127.0.0.1:1/", log, append=True, timeout=30),
    ):
        pass
    assert log.read_text().startswith("before\n") and "boom" in log.read_text()  # appended, not truncated


def test_served_gives_up_after_its_timeout(tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with (
        pytest.raises(RuntimeError, match="not ready after 1 s"),
        served(sleeper, f"http://127.0.0.1:{_free_port()}/", tmp_path / "log", timeout=1),
    ):
        pass


def test_served_does_not_start_while_another_server_holds_its_port(tmp_path: Path) -> None:
    # A server that outlives its stop (a fleet's Ray proxy) would otherwise answer for the next one.
    marker = tmp_path / "started"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with (
            pytest.raises(RuntimeError, match=f"127.0.0.1:{port} is still taken after 1 s"),
            served(cmd, f"http://127.0.0.1:{port}/health", tmp_path / "log", timeout=1),
        ):
            pass
    assert not marker.exists()  # the new server was never started
