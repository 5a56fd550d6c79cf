"""Error kinds the engine raises at its boundary, and the HTTP status a client of the server gets for each."""

from __future__ import annotations

import enum


class ErrorKind(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"  # 400: bad parameter, prompt too long, bad token id
    NOT_FOUND = "not_found"  # 404: unknown model or route
    QUEUE_FULL = "queue_full"  # 429: waiting queue bounded in requests or tokens
    FAIR_SHARE = "fair_share"  # 429: a full queue, and the tenant over its fair share of it (--policy fair)
    TENANT_QUOTA = "tenant_quota"  # 429: a tenant over its cap
    DEADLINE = "deadline"  # 408-ish: deadline passed before service
    UNAVAILABLE = "unavailable"  # 503: draining or engine dead
    INTERNAL = "internal"  # 500: a step failed


# The one map from an engine error's kind to its HTTP status: the server's error table
# (server/errors.py) reads it, and the simulator reports it for a refusal without loading the server.
HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.QUEUE_FULL: 429,
    ErrorKind.FAIR_SHARE: 429,
    ErrorKind.TENANT_QUOTA: 429,
    ErrorKind.DEADLINE: 408,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}


class CadenceError(Exception):
    """An error with a kind, a message for the client, the parameter at fault, and a retry hint."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after = retry_after


class AdmissionError(CadenceError):
    """A request refused before any work was done (too long, queue full, tenant over quota)."""
