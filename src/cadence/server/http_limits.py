"""Limits on the request head, and clocks for slow and idle clients, in uvicorn's httptools protocol.

httptools (llhttp) caps neither a header's size, nor the number of headers, nor the URL's length,
and uvicorn starts no clock before a request's headers are complete: one connection could hold an
endless header line in memory, or keep a worker's socket with one byte every few seconds. This
subclass of uvicorn's protocol adds, per connection:

- the number of header fields, the request line's bytes and the head's bytes, counted as httptools
  parses them: over a limit, 431 or 414 (an OpenAI-shaped JSON error) and the connection closes;
- the raw bytes of a head still incomplete after each read: httptools keeps an unfinished header
  line to itself (no callback sees it before its end), so this is what cuts off an endless line
  after `max_header_bytes` and one read (256 KiB at most);
- the raw bytes of a whole message: the body has its own limit in the app, but chunk framing and
  trailer fields never reach it, so a message over twice the body limit plus the head limit closes;
- a clock from a connection's opening, or a request's first byte, to its last header field:
  past `header_timeout`, 408 (or a plain close when nothing of a request came);
- a clock from a request's last header field to the end of its body: past `body_timeout`, the
  connection closes (a byte every few seconds would otherwise hold a body's memory for ever).

Idle connections between requests are closed by uvicorn's own keep-alive timer. httptools stays
the parser (rather than h11, whose size limit could replace the byte counts): it costs less Python
per streamed token, and the checks here run once per header field or read, not per body byte.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from cadence.config import ServerConfig
from cadence.errors import ErrorKind
from cadence.server.errors import ERROR_TABLE, HTTPKind, error_bytes

log = logging.getLogger("cadence.server")

LINGER_S = 1.0  # after a refusal, seconds the connection stays half-open for the answer to reach the client
_VERSION_BYTES = len(b" HTTP/1.1")


@dataclass(frozen=True)
class HeadLimits:
    max_header_count: int
    max_header_bytes: int  # request line and header fields
    max_request_line_bytes: int
    header_timeout: float
    body_timeout: float
    max_message_bytes: int  # head, body, chunk framing and trailers of one request

    @classmethod
    def from_config(cls, config: ServerConfig) -> HeadLimits:
        return cls(
            max_header_count=config.max_header_count,
            max_header_bytes=config.max_header_bytes,
            max_request_line_bytes=config.max_request_line_bytes,
            header_timeout=config.header_timeout,
            body_timeout=config.body_timeout,
            max_message_bytes=config.max_header_bytes + 2 * config.max_body_bytes,
        )


@dataclass(frozen=True)
class Refusal:
    kind: ErrorKind | HTTPKind
    message: str


class _Refused(Exception):
    """Raised in a parser callback to stop httptools; the refusal itself is kept on the protocol."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head limits and the head clock of `limits`."""

    limits: ClassVar[HeadLimits]

    @classmethod
    def with_limits(cls, limits: HeadLimits) -> type[LimitedHttpToolsProtocol]:
        """A subclass bound to `limits` (uvicorn builds protocols from a class and its own config)."""
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # the next bytes parsed belong to a request head
        self._raw = 0  # bytes read since the last message ended (counted by whole reads)
        self._head_bytes = 0  # header fields parsed so far, as sent ("name: value\r\n")
        self._header_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._pending: Refusal | None = None  # found in a parser callback, answered after it
        self._refused = False

    # -- connection ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends a byte is timed too

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered already: the rest is dropped
        self._unset_keepalive_if_required()
        if self._reading_head and self._head_timer is None:
            self._arm_head_timer()
        self._raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as e:
            refusal = self._pending or Refusal(ErrorKind.INVALID_REQUEST, f"invalid HTTP request: {e}")
            self._refuse(refusal)
            return
        if self._reading_head and self._raw > self.limits.max_header_bytes:
            self._refuse(Refusal(HTTPKind.HEADERS_TOO_LARGE, self._head_over()))
        elif self._raw > self.limits.max_message_bytes:
            self._refuse(
                Refusal(HTTPKind.BODY_TOO_LARGE, f"the request is over {self.limits.max_message_bytes} bytes")
            )

    # -- parser callbacks ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._header_count = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        line = len(self.parser.get_method()) + 1 + len(self.url) + _VERSION_BYTES
        if line > self.limits.max_request_line_bytes:
            self._stop(
                HTTPKind.REQUEST_LINE_TOO_LONG,
                f"the request line is over {self.limits.max_request_line_bytes} bytes",
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        # Also called for trailer fields after a chunked body: they count against the same limits.
        self._header_count += 1
        self._head_bytes += len(name) + len(value) + 4
        if self._header_count > self.limits.max_header_count:
            self._stop(
                HTTPKind.HEADERS_TOO_LARGE,
                f"the request has more than {self.limits.max_header_count} header fields",
            )
        if len(self.url) + self._head_bytes > self.limits.max_header_bytes:
            self._stop(HTTPKind.HEADERS_TOO_LARGE, self._head_over())
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()
        self._reading_head = True
        self._raw = 0

    # -- refusing -----------------------------------------------------------------------------------

    def _head_over(self) -> str:
        return f"the request head (request line and header fields) is over {self.limits.max_header_bytes} bytes"

    def _stop(self, kind: HTTPKind, message: str) -> None:
        self._pending = Refusal(kind, message)
        raise _Refused(message)

    def _refuse(self, refusal: Refusal) -> None:
        """Answer `refusal` and close. A response already under way on this connection (a request
        whose trailers or pipelined successor broke a limit) leaves no room for another: closed."""
        self._refused = True
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        self._log_refusal(refusal.message)
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        self.transport.write(self._response(refusal))
        if self.transport.can_write_eof():
            # Closing a socket with unread input makes the kernel send a reset at once, which can
            # destroy the answer before the client has it. So the answer and the end of the stream
            # go out first; reading stops (what the client still sends fills the socket buffers,
            # then waits), and the socket closes once the client does, or LINGER_S later.
            self.transport.write_eof()
            self.flow.pause_reading()
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _response(self, refusal: Refusal) -> bytes:
        body = error_bytes(refusal.kind, refusal.message)
        parts = [STATUS_LINE[ERROR_TABLE[refusal.kind].status]]
        for name, value in self.server_state.default_headers:
            parts += [name, b": ", value, b"\r\n"]
        parts += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
        return b"".join(parts)

    # -- the head clock -----------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _body_timed_out(self) -> None:
        """The body is not all in `body_timeout` after its head: the request is given up and the
        connection closed (the app, waiting for the body, sees the client gone)."""
        self._body_timer = None
        if self.transport.is_closing() or self._reading_head or self._refused:
            return
        self._refused = True
        self._log_refusal(f"the request body did not arrive within {self.limits.body_timeout:g} s")
        self.transport.close()

    def _log_refusal(self, message: str) -> None:
        client = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
        log.info("%srefused: %s", client, message)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head or self._refused:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head waits behind a response still being sent: its clock starts over.
            self._arm_head_timer()
            return
        if self._raw == 0:
            self.transport.close()  # nothing of a request came: an idle connection, closed quietly
            return
        self._refuse(
            Refusal(HTTPKind.HEAD_TIMEOUT, f"the request head did not arrive within {self.limits.header_timeout:g} s")
        )
