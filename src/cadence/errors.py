"""Error kinds the engine raises at its boundary. The server maps each kind to an HTTP status in one table."""

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
