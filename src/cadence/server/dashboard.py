"""The live dashboard: `GET /dashboard` (one self-contained page) and `GET /dashboard/data` (its JSON).

The page is static: inline script and style, charts drawn on canvases, nothing fetched but its own
JSON (its Content-Security-Policy allows nothing else), so it works offline. It carries no data,
so it is served without an API key, as /health is; the JSON it polls is guarded like every route,
and the page sends the key the operator gives it (a field on the page, or `#key=...` in the URL).

A caller whose API key belongs to a tenant gets that tenant's rows only (`tenant` in the JSON):
every total stays whole, but no other tenant's name or count is listed.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cadence.config import ServerConfig
from cadence.metrics.dashboard import DashboardRecorder, Limits
from cadence.server.engine_client import EngineClient
from cadence.server.inputs import KEY_TENANT_SCOPE

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"
# Only the page's own inline code and its own origin's JSON; no frame may embed it (the key field).
PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@cache
def page_html() -> bytes:
    return files("cadence.server").joinpath("dashboard.html").read_bytes()


def make_recorder(engine: EngineClient, config: ServerConfig) -> DashboardRecorder:
    """The recorder over `engine`: with its queue census where the engine runs here (not a fleet's)."""
    engine_config = getattr(engine.engine, "config", None)
    limits = None
    if engine_config is not None:
        sched = engine_config.scheduler
        limits = Limits(sched.max_num_batched_tokens, sched.max_num_seqs)
    return DashboardRecorder(
        limits=limits,
        census=getattr(engine, "census", None),
        max_tenant_labels=config.max_tenant_labels,
        known_tenants=[tenant for _, tenant in config.api_key_tenants],
    )


def add_dashboard_routes(app: FastAPI, engine: EngineClient, recorder: DashboardRecorder) -> None:
    core = getattr(engine, "core", None)  # a local engine's gauges can be read as of now

    @app.get(PAGE_PATH, response_class=Response, responses={200: {"content": {"text/html": {}}}})
    async def dashboard() -> Response:
        """The live dashboard page (no data in it; it polls /dashboard/data every second)."""
        headers = {
            "content-security-policy": PAGE_CSP,
            "x-frame-options": "DENY",
            "referrer-policy": "no-referrer",
            "cache-control": "no-cache",
        }
        return Response(page_html(), media_type="text/html; charset=utf-8", headers=headers)

    @app.get(DATA_PATH)
    async def dashboard_data(raw: Request) -> Response:
        """The dashboard's numbers: queues, recent steps, KV blocks, latency percentiles, service
        share, preemptions and refusals (docs/observability.md lists the fields)."""
        tenant = raw.scope.get(KEY_TENANT_SCOPE)
        gauges = core.scheduler_stats if core is not None else None
        body: dict[str, Any] = recorder.snapshot(tenant=tenant, gauges=gauges)
        return JSONResponse(body, headers={"cache-control": "no-store"})
