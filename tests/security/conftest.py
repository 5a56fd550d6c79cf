"""Fixtures of the hostile-input tests: servers in their own processes (serve_process.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_process import CliServer, start_cli_server


@pytest.fixture
def cli_server_factory() -> Iterator:
    """start(*flags) -> CliServer; each one started is stopped (and its log removed) after the test."""
    started: list[CliServer] = []

    def start(*flags: str) -> CliServer:
        server = start_cli_server(*flags)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()
            server.log_path.unlink(missing_ok=True)
