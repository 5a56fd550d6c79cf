"""One table from error kinds to HTTP status and OpenAI error type/code, and the handlers that use it.

Every error the server answers has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
whatever raised it: the engine (`CadenceError` with an `ErrorKind`), request validation (pydantic),
the HTTP layer (`APIError` with an `HTTPKind`), routing (404/405), or a bug (500, the server lives on).
"""

from __future__ import annotations

import enum
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cadence.errors import HTTP_STATUS, CadenceError, ErrorKind

log = logging.getLogger("cadence.server")


# (Shaped like request.FinishReason, as string enums of wire values are; they name different things.)
class HTTPKind(str, enum.Enum):
    """Errors that exist only at the HTTP layer (the engine never raises them)."""

    UNAUTHORIZED = "unauthorized"
    BODY_TOO_LARGE = "body_too_large"
    ROUTE_NOT_FOUND = "route_not_found"
    MODEL_NOT_FOUND = "model_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA = "unsupported_media_type"
    HEAD_TIMEOUT = "head_timeout"
    REQUEST_LINE_TOO_LONG = "request_line_too_long"
    HEADERS_TOO_LARGE = "headers_too_large"
    CORS_REFUSED = "cors_refused"


@dataclass(frozen=True)
class ErrorSpec:
    status: int
    type: str
    code: str


# An engine kind's status comes from cadence.errors.HTTP_STATUS (the simulator reports it too).
ERROR_TABLE: dict[ErrorKind | HTTPKind, ErrorSpec] = {
    ErrorKind.INVALID_REQUEST: ErrorSpec(HTTP_STATUS[ErrorKind.INVALID_REQUEST], "invalid_request_error", "invalid_request"),
    ErrorKind.NOT_FOUND: ErrorSpec(HTTP_STATUS[ErrorKind.NOT_FOUND], "invalid_request_error", "not_found"),
    ErrorKind.QUEUE_FULL: ErrorSpec(HTTP_STATUS[ErrorKind.QUEUE_FULL], "rate_limit_error", "queue_full"),
    ErrorKind.TENANT_QUOTA: ErrorSpec(HTTP_STATUS[ErrorKind.TENANT_QUOTA], "rate_limit_error", "tenant_quota_exceeded"),
    ErrorKind.FAIR_SHARE: ErrorSpec(HTTP_STATUS[ErrorKind.FAIR_SHARE], "rate_limit_error", "fair_share_exceeded"),
    ErrorKind.DEADLINE: ErrorSpec(HTTP_STATUS[ErrorKind.DEADLINE], "timeout_error", "deadline_exceeded"),
    ErrorKind.UNAVAILABLE: ErrorSpec(HTTP_STATUS[ErrorKind.UNAVAILABLE], "service_unavailable_error", "unavailable"),
    ErrorKind.INTERNAL: ErrorSpec(HTTP_STATUS[ErrorKind.INTERNAL], "server_error", "internal_error"),
    HTTPKind.UNAUTHORIZED: ErrorSpec(401, "authentication_error", "invalid_api_key"),
    HTTPKind.BODY_TOO_LARGE: ErrorSpec(413, "invalid_request_error", "request_too_large"),
    HTTPKind.ROUTE_NOT_FOUND: ErrorSpec(404, "invalid_request_error", "not_found"),
    HTTPKind.MODEL_NOT_FOUND: ErrorSpec(404, "invalid_request_error", "model_not_found"),
    HTTPKind.METHOD_NOT_ALLOWED: ErrorSpec(405, "invalid_request_error", "method_not_allowed"),
    HTTPKind.UNSUPPORTED_MEDIA: ErrorSpec(415, "invalid_request_error", "unsupported_media_type"),
    HTTPKind.HEAD_TIMEOUT: ErrorSpec(408, "timeout_error", "request_timeout"),
    HTTPKind.REQUEST_LINE_TOO_LONG: ErrorSpec(414, "invalid_request_error", "request_line_too_long"),
    HTTPKind.HEADERS_TOO_LARGE: ErrorSpec(431, "invalid_request_error", "request_headers_too_large"),
    HTTPKind.CORS_REFUSED: ErrorSpec(400, "invalid_request_error", "cors_refused"),
}


class APIError(CadenceError):
    """An HTTP-layer error (its kind may be one only HTTP has, such as 413 or 415); raised in
    handlers and middleware, answered through the table as the engine's errors are."""

    kind: ErrorKind | HTTPKind  # type: ignore[assignment]  # HTTP's kinds beside the engine's

    def __init__(self, kind: ErrorKind | HTTPKind, message: str, *, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(kind, message, param=param, retry_after=retry_after)  # type: ignore[arg-type]


def error_payload(kind: ErrorKind | HTTPKind, message: str, param: str | None = None) -> dict[str, Any]:
    spec = ERROR_TABLE[kind]
    return {"error": {"message": message, "type": spec.type, "param": param, "code": spec.code}}


def error_response(
    kind: ErrorKind | HTTPKind, message: str, *, param: str | None = None, retry_after: float | None = None
) -> JSONResponse:
    headers = {}
    if retry_after is not None:
        # Whole seconds, at least 1: clients (the openai package among them) read it as an integer.
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return JSONResponse(
        error_payload(kind, message, param), status_code=ERROR_TABLE[kind].status, headers=headers
    )


def error_bytes(kind: ErrorKind | HTTPKind, message: str) -> bytes:
    """The same body, byte for byte as `error_response` writes it (JSONResponse's compact JSON),
    for the ASGI middleware, which has no FastAPI response."""
    return bytes(JSONResponse(error_payload(kind, message)).body)


def from_exception(exc: BaseException) -> JSONResponse:
    """Any exception as an OpenAI-shaped error response."""
    if isinstance(exc, CadenceError):  # APIError too
        return error_response(exc.kind, exc.message, param=exc.param, retry_after=exc.retry_after)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        message, param = describe_validation(exc.errors())
        return error_response(ErrorKind.INVALID_REQUEST, message, param=param)
    if isinstance(exc, ValueError):  # SamplingParams and the tokenizer speak "field: why"
        message = str(exc)
        return error_response(ErrorKind.INVALID_REQUEST, message, param=param_of(message))
    if isinstance(exc, ClientDisconnect):  # the client left (or was cut off) mid-body: no one to answer
        return error_response(ErrorKind.INVALID_REQUEST, "the connection closed before the request body was read")
    log.exception("unhandled error", exc_info=exc)
    return error_response(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}")


# -- validation errors ------------------------------------------------------------------------------

# Pydantic puts union members and validator names in `loc` ('str', 'list[int]', 'function-after[...]');
# they mean nothing to a client, so the parameter path keeps field names and list indexes only.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|constrained-\w+)$|[\[\]\-]")
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


# Fields of several accepted forms (unions): when a value fits none of them, the message lists them.
_UNION_FORMS = {
    "prompt": "a non-empty string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and bool(_TYPE_TAG.search(part))


def _pick(errors: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None, int]:
    """(the error to report, a message to use instead of its own, how many errors are about other fields).

    A value that fits no member of a union gets one error per member, the first usually "Input
    should be a valid string" even when the client clearly meant a list: an error that is not a mere
    type mismatch (a bound, a length, a literal) says what is wrong with the form the client used.
    When every member's error is a type mismatch, the message lists the accepted forms."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    cut = next((i for i, part in enumerate(loc) if _is_tag(part)), None)
    if cut is None:
        return first, None, len(errors) - 1
    group = [
        e
        for e in errors
        if len(e.get("loc", ())) > cut and tuple(e["loc"][:cut]) == loc[:cut] and _is_tag(e["loc"][cut])
    ]
    others = len(errors) - len(group)
    if len(group) < 2:
        return first, None, others
    specific = next((e for e in group if not str(e.get("type", "")).endswith("_type")), None)
    if specific is not None:
        return specific, None, others
    name = next((str(part) for part in reversed(loc[:cut]) if isinstance(part, str)), "")
    forms = _UNION_FORMS.get(name)
    return first, (f"must be {forms}" if forms else None), others


# The JSON parser refuses a \uD800-\uDFFF escape without its pair as "unexpected end of hex escape" or
# "lone leading surrogate" (for a trailing one too): say what is wrong with the text.
SURROGATE_HINT = (" (a \\ud800-\\udfff escape is half of a UTF-16 surrogate pair and must be followed by its "
                  "other half: alone it is not text)")


def describe_validation(errors: list[dict[str, Any]] | Any) -> tuple[str, str | None]:
    """(message, param) for a list of pydantic errors: the first error names the parameter."""
    errors = list(errors)
    if not errors:
        return "invalid request", None
    first, instead, others = _pick(errors)
    loc = [p for p in first.get("loc", ()) if p != "body"]
    path = [str(p) for p in loc if isinstance(p, int) or not _TYPE_TAG.search(str(p))]
    msg = instead or str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        detail = str(first.get("ctx", {}).get("error", msg))
        if "hex escape" in detail or "surrogate" in detail:  # the parser's words for it mislead
            detail += SURROGATE_HINT
        return f"invalid JSON body: {detail}", None
    param = ".".join(path) or param_of(msg)
    more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
    where = f"{param}: " if param and not msg.startswith(f"{param}:") else ""
    return f"{where}{msg}{more}", param


def param_of(message: str) -> str | None:
    m = _FIELD_PREFIX.match(message)
    return m.group(1) if m else None


# -- handlers -------------------------------------------------------------------------------------


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return from_exception(exc)


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        return error_response(HTTPKind.ROUTE_NOT_FOUND, f"no route {request.method} {request.url.path}")
    if exc.status_code == 405:
        return error_response(
            HTTPKind.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.url.path}"
        )
    kind = ErrorKind.INTERNAL if exc.status_code >= 500 else ErrorKind.INVALID_REQUEST
    resp = error_response(kind, str(exc.detail))
    resp.status_code = exc.status_code
    return resp


def install_error_handlers(app: FastAPI) -> None:
    # ClientDisconnect by name: under the catch-all `Exception` it would reach Starlette's outermost
    # middleware, which answers and then re-raises, and the server would log a traceback for a
    # client that merely left.
    for exc_type in (CadenceError, ValidationError, RequestValidationError, ValueError, ClientDisconnect,
                     Exception):  # (CadenceError covers APIError, its subclass)
        app.add_exception_handler(exc_type, _handle)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
