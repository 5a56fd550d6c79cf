"""Hostile request heads against a real `cadence serve` process, over raw sockets: too many header
fields, an oversized or endless header line, a huge request line, slow and silent clients, idle
keep-alive connections, endless trailer fields; and that ordinary requests, streams included, still work."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_process import CliServer, read_response, start_cli_server, status_of

HEADER_TIMEOUT = 2.0
KEEP_ALIVE_TIMEOUT = 1.0
BODY_TIMEOUT = 3.0
MiB = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[CliServer]:
    live = start_cli_server(
        "--header-timeout", str(HEADER_TIMEOUT), "--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT),
        "--body-timeout", str(BODY_TIMEOUT),
    )
    try:
        yield live
    finally:
        live.stop()
        live.log_path.unlink(missing_ok=True)


def head(path: str = "/v1/models", fields: list[bytes] = (), method: bytes = b"GET") -> bytes:
    lines = [method + b" " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close", *fields]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def exchange(server: CliServer, data: bytes) -> bytes:
    """Send `data` and read the answer to the close; the sending may be cut off by the server."""
    return _flood(server, data, 0)[1]


def error_of(response: bytes) -> dict:
    body = response.partition(b"\r\n\r\n")[2]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def assert_refused(response: bytes, status: int, code: str) -> dict:
    assert status_of(response) == status, response[:300]
    assert b"connection: close" in response.lower()
    err = error_of(response)
    assert err["code"] == code, err
    return err


def fields(n: int, size: int = 1) -> list[bytes]:
    return [b"X-Field-%d: %s" % (i, b"v" * size) for i in range(n)]


def test_header_field_count_limit(server):
    # Host and Connection are two of the 100 allowed.
    assert status_of(exchange(server, head(fields=fields(98)))) == 200
    err = assert_refused(exchange(server, head(fields=fields(99))), 431, "request_headers_too_large")
    assert "100 header fields" in err["message"]
    err = assert_refused(exchange(server, head(fields=fields(100_000))), 431, "request_headers_too_large")


def test_head_size_limit(server):
    # 60 fields of 1,000 bytes: a 60 KB head, under the 64 KiB limit.
    assert status_of(exchange(server, head(fields=fields(60, 1000)))) == 200
    err = assert_refused(
        exchange(server, head(fields=[b"X-Big: " + b"a" * 70_000])), 431, "request_headers_too_large"
    )
    assert "65536 bytes" in err["message"]
    # The same bytes spread over many fields count just the same.
    assert_refused(exchange(server, head(fields=fields(70, 1000))), 431, "request_headers_too_large")


def test_request_line_limit(server):
    # "GET " + URL + " HTTP/1.1" up to 8 KiB is served.
    fits = "/v1/models?q=" + "a" * (8192 - len("GET  HTTP/1.1") - len("/v1/models?q="))
    assert status_of(exchange(server, head(fits))) == 200
    err = assert_refused(exchange(server, head(fits + "a")), 414, "request_line_too_long")
    assert "8192 bytes" in err["message"]
    assert_refused(exchange(server, head("/v1/models?q=" + "a" * 5 * MiB)), 414, "request_line_too_long")


def _flood(server: CliServer, prefix: bytes, total: int) -> tuple[int, bytes]:
    """Send `prefix`, then up to `total` bytes of 'a' in 1 MiB writes, while reading what the server
    answers (a refusal comes before the client is done sending). Returns (bytes of 'a' sent before
    the server closed, its answer)."""
    sock = server.connect(timeout=30)
    sent = 0

    def send() -> None:
        nonlocal sent
        try:
            sock.sendall(prefix)
            chunk = b"a" * MiB
            while sent < total:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server closed the connection: what the test wants

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        answer = read_response(sock, timeout=30)
        sender.join(30)
    finally:
        sock.close()
    return sent, answer


def test_unfinished_header_lines_are_cut_off_and_memory_stays_flat(server):
    """Six connections each start an 80 MB header line that never ends: each is answered 431 and
    closed after a small part of it, and the server's resident memory hardly moves."""
    baseline = server.rss_mib()
    peak = baseline
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.05):
            peak = max(peak, server.rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    prefix = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: "
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: _flood(server, prefix, 80 * MiB), range(6)))
    finally:
        stop.set()
        sampler.join()
    peak = max(peak, server.rss_mib())
    for sent, answer in results:
        assert sent < 16 * MiB, f"the server took {sent / MiB:.0f} MiB of one header line"
        assert_refused(answer, 431, "request_headers_too_large")
    assert peak - baseline < 32, f"RSS went from {baseline:.0f} MiB to {peak:.0f} MiB"


def test_endless_trailer_field_is_cut_off(server):
    """A chunked body that ends in a trailer field that never ends: the connection closes early."""
    prefix = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: "
    )
    baseline = server.rss_mib()
    sent, _ = _flood(server, prefix, 64 * MiB)
    assert sent < 16 * MiB, f"the server took {sent / MiB:.0f} MiB of one trailer field"
    assert server.rss_mib() - baseline < 32
    # The request's body read ends with the connection: nothing for the log but the refusal.
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_slowloris_gets_408_within_the_header_timeout(server):
    """One byte every 0.5 s: the head never completes, and the server answers 408 at the limit."""
    with server.connect() as sock:
        start = time.monotonic()
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        answered = False
        for _ in range(40):  # 20 s at most
            sock.sendall(b"a")
            readable, _, _ = select.select([sock], [], [], 0.5)
            if readable:
                answered = True
                break
        elapsed = time.monotonic() - start
        assert answered, "the slow client was never answered"
        response = read_response(sock)
    assert_refused(response, 408, "request_timeout")
    assert HEADER_TIMEOUT - 0.2 <= elapsed <= HEADER_TIMEOUT + 1.5, elapsed


def test_silent_connection_is_closed(server):
    with server.connect() as sock:
        start = time.monotonic()
        assert read_response(sock, timeout=20) == b""
        elapsed = time.monotonic() - start
    assert HEADER_TIMEOUT - 0.2 <= elapsed <= HEADER_TIMEOUT + 1.5, elapsed


def _read_one_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head_bytes.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head_bytes


def test_idle_keep_alive_connection_is_closed(server):
    request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with server.connect() as sock:
        sock.sendall(request)
        assert status_of(_read_one_response(sock)) == 200
        sock.sendall(request)  # reused while within the timeout
        assert status_of(_read_one_response(sock)) == 200
        idle_from = time.monotonic()
        assert read_response(sock, timeout=20) == b""
        idle = time.monotonic() - idle_from
    assert KEEP_ALIVE_TIMEOUT - 0.2 <= idle <= KEEP_ALIVE_TIMEOUT + 1.5, idle


def test_ordinary_requests_and_streams_still_work(server):
    # A large but allowed head (90 fields, 40 KB) on a streamed completion.
    extra = {f"X-Pad-{i}": "p" * 440 for i in range(90)}
    body = {"prompt": "Hello", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=extra, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(oai.chat.completions.create(
        model="cadence-tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    ))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert oai.completions.create(model="cadence-tiny-random", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_client_gone_mid_body_is_no_server_error(app_client):
    """The connection closes while the app reads the body (a limit cut it off, or the client left):
    the app ends the request without raising, so the server logs no traceback for it."""
    import asyncio

    app = app_client.app
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect before
    assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400


def test_a_body_trickled_in_is_cut_off_at_the_body_timeout(server):
    """A whole head, then the body a byte every 0.3 s: each read is news, but the body as a whole
    must arrive within --body-timeout, so the connection closes then (it never would before)."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode() + b" " * 200
    head_bytes = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
    with server.connect() as sock:
        sock.sendall(head_bytes)
        start = time.monotonic()
        closed = False
        for byte in body:  # 240 bytes x 0.3 s: over a minute if never cut off
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            readable, _, _ = select.select([sock], [], [], 0.3)
            if readable and sock.recv(4096) == b"":
                closed = True
                break
        elapsed = time.monotonic() - start
    assert closed, "the trickled body was never cut off"
    assert BODY_TIMEOUT - 0.2 <= elapsed <= BODY_TIMEOUT + 3.0, elapsed
    assert "Traceback" not in server.log()
    # A body that arrives in time is served.
    assert status_of(exchange(server, head_bytes.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1)
                              + body)) == 200
