"""API keys guard every route of the fleet's ingress exactly as on a single server."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from fleet_helpers import TINY_ENGINE, Fleet, running_fleet
from starlette.routing import Route

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import OPEN_PATHS, create_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def keyed() -> Iterator[Fleet]:
    with running_fleet(api_keys=("sk-good",)) as fleet:
        yield fleet


def _routes() -> list[Route]:
    """The app's routes (the ingress runs the same create_app)."""
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY_ENGINE), tiny=True))
    try:
        return [r for r in create_app(engine, ServerConfig(api_keys=("sk-good",))).routes if isinstance(r, Route)]
    finally:
        engine.shutdown()


def test_every_route_but_liveness_needs_the_key(keyed: Fleet) -> None:
    routes = _routes()
    assert len(routes) >= 10
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for route in routes:
            for method in (route.methods or {"GET"}) - {"HEAD"}:
                path = re.sub(r"\{[^}]+\}", "cadence-tiny-random", route.path)
                for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good"}):
                    r = c.request(method, path, headers=headers)
                    if route.path in OPEN_PATHS:  # the liveness probes
                        assert r.status_code == 200
                    else:
                        assert r.status_code == 401, (method, path, r.status_code)
                        assert r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer sk-good"}
        r = c.post("/v1/completions", headers=good, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-cadence-replica"]
        assert c.get("/metrics", headers=good).status_code == 200
