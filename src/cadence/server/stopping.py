"""The outermost ASGI layer: a request that uvicorn cancels while the server stops ends cleanly.

uvicorn cancels whatever still runs once its shutdown grace has passed. Without this layer a
cancelled request logs a traceback ("Exception in ASGI application") and gets a bare text 500,
and an event stream is cut without a terminal event. With it, a request that had no response yet
gets a 503 in the usual error shape, and an event stream gets an error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from cadence.errors import ErrorKind
from cadence.server.errors import ERROR_TABLE, error_bytes, error_payload
from cadence.server.formats import DONE_EVENT, sse

STOPPED_MESSAGE = "the server is shutting down"


@dataclass
class _Progress:
    """What the app has sent of its response so far."""

    started: bool = False
    complete: bool = False
    event_stream: bool = False
    done_sent: bool = False  # the stream's own `data: [DONE]` went out

    def see(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            self.done_sent = self.done_sent or message.get("body", b"").endswith(DONE_EVENT)
            self.complete = not message.get("more_body", False)


class StopGuard:
    """Pure ASGI. Ends a cancelled HTTP request with a 503, or an SSE error event then `[DONE]`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        progress = _Progress()

        async def tracked(message: dict) -> None:
            progress.see(message)
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            # Only the server's shutdown cancels a request's task, and the task ends here either
            # way: finishing the response is all that is left to do, so the cancellation stops here.
            await _finish(progress, send)


async def _finish(progress: _Progress, send: Any) -> None:
    if progress.complete:
        return
    if not progress.started:
        body = error_bytes(ErrorKind.UNAVAILABLE, STOPPED_MESSAGE)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        status = ERROR_TABLE[ErrorKind.UNAVAILABLE].status
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif progress.event_stream:
        tail = b"" if progress.done_sent else sse(error_payload(ErrorKind.UNAVAILABLE, STOPPED_MESSAGE)) + DONE_EVENT
        await send({"type": "http.response.body", "body": tail})
    # A JSON body cut midway cannot be mended; uvicorn closes the connection.
