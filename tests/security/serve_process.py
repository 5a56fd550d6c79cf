"""`cadence serve --tiny` in its own process (its memory, its signals, its log), and raw-socket helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TINY_FLAGS = ["--tiny", "--num-kv-blocks", "512", "--max-model-len", "1024", "--device", "cpu", "--dtype", "float32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class CliServer:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_mib(self) -> float:
        """Resident memory of the server process now (VmRSS)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS line")

    def connect(self, timeout: float = 10.0) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return sock

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_cli_server(*flags: str) -> CliServer:
    port = free_port()
    fd, name = tempfile.mkstemp(prefix="cadence-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "cadence.cli", "serve", *TINY_FLAGS, "--port", str(port), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    server = CliServer(proc, port, Path(name))
    end = time.monotonic() + 120
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    log = server.log()
    server.log_path.unlink(missing_ok=True)
    raise AssertionError(f"the server did not start:\n{log[-3000:]}")


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])
