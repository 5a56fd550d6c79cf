"""`GET /v1/requests/{request_id}`: where a request is and why it waits.

The engine answers with plain `RequestSnapshot`s (one per choice); this module only shapes them
as JSON. With API keys mapped to tenants, a caller sees only its own tenant's requests: another
tenant's id gets exactly the answer an unknown id gets (404), so an id's existence never leaks.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from cadence.boundary import RequestSnapshot
from cadence.errors import ErrorKind
from cadence.server.engine_client import EngineClient
from cadence.server.errors import APIError
from cadence.server.inputs import KEY_TENANT_SCOPE

MAX_REQUEST_ID_CHARS = 256  # longer ids are never issued: answered 404 without asking the engine
_NOT_FOUND = "no request with this id is known here (finished requests are kept for a while, then forgotten)"


def add_request_status_route(app: FastAPI, engine: EngineClient, responses: dict[int | str, dict[str, Any]],
                             profile: dict[str, Any] | None = None) -> None:
    """`profile`: the cost profile the predictions come from (`TTFTPredictor.describe`), shown with them."""

    @app.get("/v1/requests/{request_id}", responses=responses)
    async def request_status(request_id: str, raw: Request) -> JSONResponse:
        lookup = getattr(engine, "request_status", None)
        if lookup is None:  # an engine client that cannot say
            raise APIError(ErrorKind.NOT_FOUND, _NOT_FOUND, param="request_id")
        snaps = None
        if len(request_id) <= MAX_REQUEST_ID_CHARS:
            snaps = await lookup(request_id, raw.scope.get(KEY_TENANT_SCOPE) or None)
        if not snaps:
            raise APIError(ErrorKind.NOT_FOUND, _NOT_FOUND, param="request_id")
        return JSONResponse(status_body(request_id, snaps, profile), headers={"X-Request-Id": request_id})


def status_body(request_id: str, snaps: tuple[RequestSnapshot, ...],
                profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request as a whole (its least advanced choice) and, with several choices, each one."""
    body: dict[str, Any] = {"id": request_id, "object": "request.status"}
    body.update(_choice(_least_advanced(snaps)))
    if len(snaps) > 1:
        body["choices"] = [{"index": i, **_choice(s)} for i, s in enumerate(snaps)]
        predicted = [s.predicted_ttft for s in snaps if s.predicted_ttft is not None]
        if predicted:  # the request's first token: its earliest choice's
            body["predicted_ttft"] = _round(min(predicted))
            body["predicted_ttft_unavailable"] = None
    body["cost_profile"] = profile
    return body


_ORDER = {"waiting": 0, "preempted": 1, "prefilling": 2, "decoding": 3, "finished": 4}


def _least_advanced(snaps: tuple[RequestSnapshot, ...]) -> RequestSnapshot:
    return min(snaps, key=lambda s: _ORDER.get(s.state, 0))


def _choice(s: RequestSnapshot) -> dict[str, Any]:
    wait = s.wait
    return {
        "state": s.state,
        "queue_position": s.queue_position,
        "wait_reason": wait.reason.value if wait is not None else None,
        "waiting_behind": wait.behind if wait is not None else None,
        "wait_reason_step": wait.step if wait is not None else None,
        "prompt_tokens": s.num_prompt_tokens,
        "prompt_tokens_computed": s.num_computed_prompt_tokens,
        "output_tokens": s.num_output_tokens,
        "preemptions": s.num_preemptions,
        "priority": s.priority,
        "finish_reason": s.finish_reason,
        "ttft": _ttft(s),
        "predicted_ttft": _round(s.predicted_ttft),
        "predicted_ttft_unavailable": s.predicted_ttft_unavailable,
    }


def _ttft(s: RequestSnapshot) -> float | None:
    """Seconds from arrival to its first token, once it is out."""
    return None if s.first_token_time is None else _round(s.first_token_time - s.arrival_time)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
