"""A real uvicorn server on a free port around create_app(AsyncEngine(build_engine(config, tiny=True)))."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app

# Small enough to build in seconds and allocate little memory; same code paths as the real engine.
TINY_ENGINE = {"num_kv_blocks": 512, "max_model_len": 1024, "device": "cpu", "dtype": "float32"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def core(self) -> Any:
        return self.engine.core

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.engine.shutdown(timeout=10)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until the engine holds no request (all finished or aborted)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.engine.num_in_flight == 0 and not self.core.has_unfinished_requests():
                return True
            time.sleep(0.02)
        return False


def start_server(engine_options: dict | None = None, **server_options: Any) -> LiveServer:
    config = EngineConfig.from_options(**{**TINY_ENGINE, **(engine_options or {})})
    engine = AsyncEngine(build_engine(config, tiny=True))
    server_config = ServerConfig(port=free_port(), **server_options)
    app = create_app(engine, server_config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=server_config.port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server_config.port}"
    end = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > end or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(url, engine, app, server, thread)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = start_server()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def server_factory() -> Iterator[Any]:
    """start(engine_options=None, **server_options) -> LiveServer; every server started is stopped after the module."""
    started: list[LiveServer] = []

    def start(engine_options: dict | None = None, **server_options: Any) -> LiveServer:
        live = start_server(engine_options, **server_options)
        started.append(live)
        return live

    try:
        yield start
    finally:
        for live in started:
            live.stop()
