"""Fixtures of the hostile-input tests: servers in their own processes (serve_process.py), and the
tiny random model (real tokenizer, random weights) behind the offline API and behind the server
in-process (FastAPI's TestClient: no socket, the app and its engine thread).

The in-process context is short (64 tokens), so a request that asks for "the rest of the context"
stays cheap whatever a generated body says. How many examples the hypothesis tests run: hostile.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from serve_process import CliServer, start_cli_server

from cadence import LLM
from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app

TINY = {"num_kv_blocks": 256, "max_model_len": 64, "max_num_seqs": 8, "device": "cpu", "dtype": "float32"}


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


@pytest.fixture(scope="session")
def tiny_llm() -> LLM:
    return LLM(tiny=True, **TINY)


@pytest.fixture(scope="session")
def app_client() -> Iterator[TestClient]:
    # With n-gram speculation on: the tiny model's greedy text repeats itself, so fuzzed greedy
    # requests also go through verification rows (stops mid-draft, the context's end, min_tokens).
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY, speculative_config=spec), tiny=True))
    app = create_app(engine, ServerConfig())
    try:
        # An exception escaping the app becomes the 500 it would be behind uvicorn, for the tests to see.
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client
    finally:
        engine.shutdown(timeout=10)
