"""The HTTP app: routes, the guard middleware (API keys, content type, body size), CORS, and
`run_server`: uvicorn with limits on the request head (http_limits.py), SIGTERM draining, and a
second signal that ends every request at once.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health (liveness), /ready (readiness),
/metrics (Prometheus), /dashboard and /dashboard/data (the live dashboard, server/dashboard.py),
/v1/requests/{request_id} (a request's state and why it waits, server/request_status.py),
/tokenize, /detokenize, and FastAPI's /openapi.json and /docs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from cadence import __version__
from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.errors import CadenceError, ErrorKind
from cadence.metrics.prometheus import PrometheusExporter
from cadence.server.dashboard import PAGE_PATH, add_dashboard_routes, make_recorder
from cadence.server.engine_client import EngineClient
from cadence.server.errors import (
    ERROR_TABLE,
    APIError,
    HTTPKind,
    error_bytes,
    error_payload,
    error_response,
    install_error_handlers,
)
from cadence.server.http_limits import HeadLimits, LimitedHttpToolsProtocol
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
from cadence.server.request_status import add_request_status_route
from cadence.server.serving import OpenAIServing
from cadence.server.stopping import STOPPED_MESSAGE, StopGuard
from cadence.wording import counted

if TYPE_CHECKING:
    from cadence.server.tracing import RequestTracer

log = logging.getLogger("cadence.server")

# Liveness answers without a key (orchestrators probe it bare), and so does the dashboard's page,
# which holds no data: the JSON it polls needs the key (server/dashboard.py).
OPEN_PATHS = frozenset({"/health", "/ping", PAGE_PATH})
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 415, 429, 500, 503)
}


class GuardMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would buffer streams and hide disconnects).

    Answers 401 without a valid key on every path but /health; 415 for a body on a JSON route
    (`json_paths`) sent as anything but application/json, which is what keeps a web page from
    posting to the server without a CORS preflight (text/plain and forms need none); and 413 for a
    body over the limit, by its Content-Length at once, or, for a chunked body, as soon as the
    bytes read pass the limit.
    """

    def __init__(self, app: Any, config: ServerConfig, json_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.max_body = config.max_body_bytes
        self.keys = [k.encode() for k in config.api_keys]
        self.key_tenants = {k.encode(): t for k, t in config.api_key_tenants}
        self.json_paths = json_paths

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
        if scope["method"] == "POST" and scope["path"] in self.json_paths:
            refusal = _content_type_refusal(headers.get(b"content-type"))
            if refusal is not None:
                await _send_error(send, HTTPKind.UNSUPPORTED_MEDIA, refusal)
                return
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


def _content_type_refusal(content_type: bytes | None) -> str | None:
    """Why a body of this Content-Type is refused on a JSON route; None for application/json,
    with or without parameters (`; charset=utf-8`)."""
    if content_type is None:
        return "the request has no Content-Type; send the JSON body with Content-Type: application/json"
    media_type = content_type.partition(b";")[0].strip().lower()
    if media_type == b"application/json":
        return None
    shown = content_type.decode("latin-1")[:100]
    return f"Content-Type {shown!r} is not accepted; send the JSON body with Content-Type: application/json"


class CORSGuard(CORSMiddleware):
    """Starlette's CORS handling, with a refused preflight answered in the usual error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        reason = bytes(response.body).decode("latin-1")  # "Disallowed CORS origin, method, ..."
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        payload = error_payload(HTTPKind.CORS_REFUSED, f"CORS preflight refused: {reason}")
        return JSONResponse(payload, status_code=ERROR_TABLE[HTTPKind.CORS_REFUSED].status, headers=headers)


async def _send_error(send: Any, kind: HTTPKind, message: str, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = error_bytes(kind, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    if kind in (HTTPKind.BODY_TOO_LARGE, HTTPKind.UNSUPPORTED_MEDIA):
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
        vllm_model_name=engine.model_name if "vllm" in server_config.metrics_compat else None,
    )
    engine.stats_hooks.append(exporter.record_step)
    dashboard = make_recorder(engine, server_config)
    engine.stats_hooks.append(dashboard.record_step)
    exporter.rejection_listeners.append(dashboard.record_rejection)
    exporter.watch_engine(lambda: engine.is_healthy)
    if render_metrics is None:  # a local engine (a fleet's replicas report their own caches)
        core = engine.engine.core
        exporter.record_kv_cache(core.kv_cache_dtype, core.num_blocks * core.config.cache.block_size)
        exporter.record_speculation(core.config.speculative_config)
    if engine.engine_thread_times() is not None:
        exporter.watch_thread_times(lambda: engine.engine_thread_times() or {})
    tracer = make_tracer(server_config, exporter)
    if tracer is not None and hasattr(engine, "enable_request_events"):
        engine.enable_request_events()  # waits, prefill chunks, preemptions and resumes inside the spans
    serving = OpenAIServing(engine, server_config, exporter, tracer)
    app = FastAPI(title="cadence", version="0.1.0", description="An OpenAI-compatible LLM server.")
    app.state.engine, app.state.serving, app.state.exporter = engine, serving, exporter
    app.state.tracer, app.state.dashboard = tracer, dashboard
    install_error_handlers(app)
    _add_routes(app, engine, serving, exporter, render_metrics)
    add_dashboard_routes(app, engine, dashboard)
    add_request_status_route(app, engine, _ERRORS, _attach_predictor(engine, server_config))
    _install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])
    # POST routes that read a JSON body (a health probe such as /ping takes none)
    json_paths = frozenset(r.path for r in app.routes if isinstance(r, APIRoute) and "POST" in (r.methods or ())) - OPEN_PATHS
    # Added innermost first: StopGuard wraps CORS, which wraps the guard, so a preflight (which
    # carries no API key) and every error the guard answers get their CORS headers.
    app.add_middleware(GuardMiddleware, config=server_config, json_paths=json_paths)
    if server_config.allowed_origins:
        app.add_middleware(
            CORSGuard,
            allow_origins=server_config.allowed_origins,
            allow_methods=server_config.allowed_methods,
            allow_headers=server_config.allowed_headers,
            allow_credentials=server_config.allow_credentials,
        )
    app.add_middleware(StopGuard)
    return app


def _attach_predictor(engine: EngineClient, server_config: ServerConfig) -> dict[str, Any] | None:
    """Load --cost-profile; give the predictor to an engine that runs here (a fleet's replicas load
    their own). Returns the profile's description for request status answers (None: no profile)."""
    from cadence.engine.ttft import attach_predictor, load_cost_profile

    local = getattr(engine, "core", None) is not None  # an engine that runs here (not a fleet's ingress)
    threads = None
    if local:
        import torch  # (loaded already by the engine, its threads set; a fleet's ingress never loads it)

        threads = torch.get_num_threads()
    predictor = load_cost_profile(server_config.cost_profile, threads)
    if predictor is None:
        return None
    if local:
        attach_predictor(engine, predictor)
    return predictor.describe(engine.model_name)


def make_tracer(server_config: ServerConfig, exporter: PrometheusExporter) -> RequestTracer | None:
    """The request tracer of --otlp-traces-endpoint (None: tracing off; the SDK is not even loaded)."""
    if server_config.otlp_traces_endpoint is None:
        return None
    from cadence.server.tracing import RequestTracer, traces_protocol

    tracer = RequestTracer.create(
        server_config.otlp_traces_endpoint, server_config.otlp_traces_sample_ratio, exporter.record_spans_dropped
    )
    log.info("tracing requests to %s over OTLP %s", server_config.otlp_traces_endpoint, traces_protocol(server_config.otlp_traces_endpoint))
    return tracer


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

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in serving.inputs.model_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> ModelCard:
        serving.inputs.check_model(model_id)
        return card(model_id)

    @app.get("/health", responses=_ERRORS)
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return error_response(ErrorKind.UNAVAILABLE, f"the engine loop is not running: {engine.dead_reason}")

    @app.api_route("/ping", methods=["GET", "POST"], responses=_ERRORS)
    async def ping() -> Response:
        """vLLM's (and SageMaker's) health probe: /health under another name."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/ready")
    async def ready() -> Response:
        body: dict[str, Any] = {"ready": engine.is_ready, "draining": engine.is_draining, "healthy": engine.is_healthy}
        if not body["healthy"]:
            body["reason"] = engine.dead_reason  # why: a stall, or steps that kept failing
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if render_metrics is not None:
            return Response(await render_metrics(exporter), media_type=exporter.render()[1])
        # The gauges as of now, not as of the last step: an abort (a client that left) or a finish
        # with nothing left to run changes them with no step after it. The core keeps a snapshot
        # for exactly this read from another thread.
        exporter.record_scheduler(engine.engine.core.scheduler_stats)
        data, content_type = exporter.render()
        return Response(data, media_type=content_type)


# -- running the server ---------------------------------------------------------------------------


# Once stopping: how long the engine gets to end every request (an abort lands at its next step
# boundary), then how long uvicorn waits for the answers to go out before it cancels what is left.
STOP_ENGINE_S = 1.0
STOP_GRACE_S = 0.5


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains instead of closing the socket, and a second signal stops at once.

    On SIGTERM: readiness flips and new requests get 503 (the socket stays open so they get an
    answer, not a refused connection); in-flight requests get `shutdown_timeout` seconds to finish,
    then the rest end with an error event; then uvicorn exits and the process returns 0.

    On a second SIGTERM or SIGINT (or a first SIGINT): stop now. Every request in flight ends at
    once with an `unavailable` error, an SSE error event and `data: [DONE]` for a stream, a 503 for
    the others; uvicorn exits as soon as they are answered (StopGuard answers whatever is left after
    STOP_ENGINE_S + STOP_GRACE_S). A third signal exits without waiting.
    """

    def __init__(
        self, config: uvicorn.Config, engine: EngineClient, serving: OpenAIServing, timeout: float
    ) -> None:
        super().__init__(config)
        self.engine, self.serving, self.timeout = engine, serving, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None
        self._phase = "serving"  # -> "draining" -> "stopping"; set in the signal handler itself
        self.interrupted = False  # a SIGINT arrived: exit status 130

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig not in (signal.SIGTERM, signal.SIGINT) or self._loop is None:
            super().handle_exit(sig, frame)
            return
        if sig == signal.SIGINT:
            self._captured_signals.append(sig)  # uvicorn raises it again on the way out: exit status 130
            self.interrupted = True  # (and where SIGINT was ignored when the process started, that does nothing)
        if sig == signal.SIGTERM and self._phase == "serving":
            self._phase = "draining"
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._phase != "stopping":
            self._phase = "stopping"
            self._loop.call_soon_threadsafe(self._start_stop)
        else:
            self.should_exit = self.force_exit = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    def _start_stop(self) -> None:
        self._stop_task = asyncio.ensure_future(self.stop_now())

    async def drain(self) -> None:
        log.info(
            "SIGTERM: draining (up to %.1f s for %s in flight)", self.timeout, counted(self.serving.active, "request")
        )
        self.engine.begin_drain()
        if not await _wait_for(
            lambda: self.engine.num_in_flight == 0 and self.serving.active == 0, self.timeout
        ):
            log.warning("shutdown timeout: ending %s with an error", counted(self.serving.active, "request"))
            self.engine.abort_all(
                CadenceError(
                    ErrorKind.UNAVAILABLE,
                    f"the server shut down; the request did not finish within {self.timeout:g} s",
                )
            )
            await _wait_for(lambda: self.serving.active == 0, 5.0)
        self.should_exit = True

    async def stop_now(self) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        log.warning("stopping now: ending %s in flight with an error", counted(self.serving.active, "request"))
        self.engine.begin_drain()
        self.engine.abort_all(CadenceError(ErrorKind.UNAVAILABLE, STOPPED_MESSAGE))
        await _wait_for(lambda: self.serving.active == 0, STOP_ENGINE_S)
        # Requests the engine did not answer in time (a body still arriving, a long step) are
        # cancelled after this grace; StopGuard gives them their 503 or terminal event.
        self.config.timeout_graceful_shutdown = STOP_GRACE_S  # type: ignore[assignment]  # (uvicorn takes a float)
        self.should_exit = True


async def _wait_for(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(0.02)
    return True


def uvicorn_config(app: FastAPI, server_config: ServerConfig) -> uvicorn.Config:
    """uvicorn on its httptools protocol with the head limits and clocks of `server_config`."""
    protocol = LimitedHttpToolsProtocol.with_limits(HeadLimits.from_config(server_config))
    return uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        http=protocol,
        ws="none",  # no WebSocket routes: an upgrade request is served as plain HTTP
        timeout_keep_alive=server_config.keep_alive_timeout,  # type: ignore[arg-type]  # a float works
        log_level=server_config.uvicorn_log_level or server_config.log_level,
        timeout_graceful_shutdown=5,
        lifespan="off",
    )


def run_server(engine_config: EngineConfig, server_config: ServerConfig, *, tiny: bool = False) -> int:
    """Build the engine, serve until SIGTERM (drained) or SIGINT, and return the exit code."""
    from cadence.engine.builder import build_engine

    server_config.validate()
    engine = AsyncEngine(build_engine(engine_config, tiny=tiny))
    app = create_app(engine, server_config)
    config = uvicorn_config(app, server_config)
    server = DrainingServer(config, engine, app.state.serving, server_config.shutdown_timeout)
    log.info("serving %s on http://%s:%d", engine.model_name, server_config.host, server_config.port)
    try:
        server.run()
    finally:
        engine.shutdown(timeout=5.0)
        if app.state.tracer is not None:
            app.state.tracer.shutdown()
    # A SIGINT normally comes back out of run() as KeyboardInterrupt (130 in cli.main); a process
    # started with SIGINT ignored (`nohup ... &` in a script) gets no such exception.
    return 130 if server.interrupted else 0
