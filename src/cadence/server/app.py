"""The HTTP app: routes, the guard middleware (API keys, body size), and `run_server` with SIGTERM draining.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health (liveness), /ready (readiness),
/metrics (Prometheus), /tokenize, /detokenize, and FastAPI's /openapi.json and /docs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.errors import CadenceError, ErrorKind
from cadence.metrics.prometheus import PrometheusExporter
from cadence.server.engine_client import EngineClient
from cadence.server.errors import (
    ERROR_TABLE,
    APIError,
    HTTPKind,
    error_bytes,
    error_response,
    install_error_handlers,
)
from cadence.server.inputs import KEY_TENANT_SCOPE
from cadence.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from cadence.server.serving import OpenAIServing

log = logging.getLogger("cadence.server")

OPEN_PATHS = frozenset({"/health"})  # liveness answers without a key: orchestrators probe it bare
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503)
}


class GuardMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would buffer streams and hide disconnects).

    Answers 401 without a valid key on every path but /health, and 413 for a body over the limit,
    by its Content-Length at once, or, for a chunked body, as soon as the bytes read pass the limit.
    """

    def __init__(self, app: Any, config: ServerConfig) -> None:
        self.app = app
        self.max_body = config.max_body_bytes
        self.keys = [k.encode() for k in config.api_keys]
        self.key_tenants = {k.encode(): t for k, t in config.api_key_tenants}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.keys and scope["path"] not in OPEN_PATHS:
            key = self._key(headers)
            if key is None:
                await _send_error(
                    send,
                    HTTPKind.UNAUTHORIZED,
                    "a valid API key is required (Authorization: Bearer KEY)",
                    extra=[(b"www-authenticate", b"Bearer")],
                )
                return
            if key in self.key_tenants:
                scope[KEY_TENANT_SCOPE] = self.key_tenants[key]
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _send_error(
                send, HTTPKind.BODY_TOO_LARGE, f"the request body is over {self.max_body} bytes"
            )
            return
        await self.app(scope, self._limited(receive), send)

    def _key(self, headers: dict[bytes, bytes]) -> bytes | None:
        auth = headers.get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        given = given.strip()
        match = None
        for key in self.keys:  # compare against every key, in constant time each
            if hmac.compare_digest(given, key):
                match = key
        return match

    def _limited(self, receive: Any) -> Any:
        seen = 0

        async def wrapped() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise APIError(HTTPKind.BODY_TOO_LARGE, f"the request body is over {self.max_body} bytes")
            return message

        return wrapped


async def _send_error(send: Any, kind: HTTPKind, message: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = error_bytes(kind, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    if kind == HTTPKind.BODY_TOO_LARGE:
        headers.append((b"connection", b"close"))  # the unread body makes the connection unusable
    await send({"type": "http.response.start", "status": ERROR_TABLE[kind].status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_json(raw: Request, model: type[BaseModel]) -> Any:
    """Parse and validate a JSON body: UTF-8 only, strict types; nesting is capped by the parser."""
    body = await raw.body()
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            ErrorKind.INVALID_REQUEST, f"the request body is not valid UTF-8 (byte {e.start})"
        ) from None
    return model.model_validate_json(body)


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Request bodies are parsed by hand (size, UTF-8, strictness), so their schemas are added here."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for m in models:
            js = m.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(js.pop("$defs", {}))
            comps[m.__name__] = js
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# Renders /metrics from this app's exporter (its refusals) and wherever the engines' are.
MetricsRenderer = Callable[[PrometheusExporter], Awaitable[bytes]]


def create_app(
    engine: EngineClient,
    server_config: ServerConfig,
    *,
    exporter: PrometheusExporter | None = None,
    render_metrics: MetricsRenderer | None = None,
) -> FastAPI:
    """The app over `engine`; `render_metrics` replaces the local /metrics (a fleet merges its replicas')."""
    server_config.validate()
    exporter = exporter or PrometheusExporter(
        slo_ttft=server_config.slo_ttft,
        slo_itl=server_config.slo_itl,
        max_tenant_labels=server_config.max_tenant_labels,
    )
    engine.stats_hooks.append(exporter.record_step)
    serving = OpenAIServing(engine, server_config, exporter)
    app = FastAPI(title="cadence", version="0.1.0", description="An OpenAI-compatible LLM server.")
    app.state.engine, app.state.serving, app.state.exporter = engine, serving, exporter
    install_error_handlers(app)
    _add_routes(app, engine, serving, exporter, render_metrics)
    _install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])
    app.add_middleware(GuardMiddleware, config=server_config)
    return app


def _add_routes(
    app: FastAPI,
    engine: EngineClient,
    serving: OpenAIServing,
    exporter: PrometheusExporter,
    render_metrics: MetricsRenderer | None = None,
) -> None:
    @app.post(
        "/v1/completions",
        openapi_extra=_body_doc(CompletionRequest),
        responses={200: {"model": CompletionResponse}, **_ERRORS},
    )
    async def completions(raw: Request) -> Response:
        with serving.counting_refusals():
            body = await read_json(raw, CompletionRequest)
        return await serving.completions(body, raw)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=_body_doc(ChatCompletionRequest),
        responses={200: {"model": ChatCompletionResponse}, **_ERRORS},
    )
    async def chat_completions(raw: Request) -> Response:
        with serving.counting_refusals():
            body = await read_json(raw, ChatCompletionRequest)
        return await serving.chat(body, raw)

    @app.post("/tokenize", openapi_extra=_body_doc(TokenizeRequest), responses=_ERRORS)
    async def tokenize(raw: Request) -> dict[str, Any]:
        return await serving.tokenize(await read_json(raw, TokenizeRequest))

    @app.post("/detokenize", openapi_extra=_body_doc(DetokenizeRequest), responses=_ERRORS)
    async def detokenize(raw: Request) -> dict[str, Any]:
        return await serving.detokenize(await read_json(raw, DetokenizeRequest))

    created = int(time.time())

    def card() -> ModelCard:
        return ModelCard(id=engine.model_name, created=created, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> ModelCard:
        serving.inputs.check_model(model_id)
        return card()

    @app.get("/health", responses=_ERRORS)
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return error_response(ErrorKind.UNAVAILABLE, f"the engine loop is not running: {engine.dead_reason}")

    @app.get("/ready")
    async def ready() -> Response:
        body = {"ready": engine.is_ready, "draining": engine.is_draining, "healthy": engine.is_healthy}
        return JSONResponse(body, status_code=200 if engine.is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if render_metrics is not None:
            return Response(await render_metrics(exporter), media_type=exporter.render()[1])
        # The gauges as of now, not as of the last step: an abort (a client that left) or a finish
        # with nothing left to run changes them with no step after it. The core keeps a snapshot
        # for exactly this read from another thread.
        exporter.record_scheduler(engine.core.scheduler_stats)
        data, content_type = exporter.render()
        return Response(data, media_type=content_type)


# -- running the server ---------------------------------------------------------------------------


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains instead of closing the socket.

    On SIGTERM: readiness flips and new requests get 503 (the socket stays open so they get an
    answer, not a refused connection); in-flight requests get `shutdown_timeout` seconds to finish,
    then the rest end with an error event; then uvicorn exits and the process returns 0.
    """

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, serving: OpenAIServing, timeout: float
    ) -> None:
        super().__init__(config)
        self.engine, self.serving, self.timeout = engine, serving, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
        elif self._drain_task is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.should_exit = True  # a second SIGTERM: stop now

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        log.info(
            "SIGTERM: draining (up to %.1f s for %d requests in flight)", self.timeout, self.serving.active
        )
        self.engine.begin_drain()
        if not await _wait_for(
            lambda: self.engine.num_in_flight == 0 and self.serving.active == 0, self.timeout
        ):
            log.warning("shutdown timeout: ending %d requests with an error", self.serving.active)
            self.engine.abort_all(
                CadenceError(
                    ErrorKind.UNAVAILABLE,
                    f"the server shut down; the request did not finish within {self.timeout:g} s",
                )
            )
            await _wait_for(lambda: self.serving.active == 0, 5.0)
        self.should_exit = True


async def _wait_for(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(0.02)
    return True


def run_server(engine_config: EngineConfig, server_config: ServerConfig, *, tiny: bool = False) -> int:
    """Build the engine, serve until SIGTERM (drained) or SIGINT, and return the exit code."""
    from cadence.engine.builder import build_engine

    server_config.validate()
    engine = AsyncEngine(build_engine(engine_config, tiny=tiny))
    app = create_app(engine, server_config)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    server = DrainingServer(config, engine, app.state.serving, server_config.shutdown_timeout)
    log.info("serving %s on http://%s:%d", engine.model_name, server_config.host, server_config.port)
    try:
        server.run()
    finally:
        engine.shutdown(timeout=5.0)
    return 0
