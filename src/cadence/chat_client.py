"""`cadence chat` and `cadence complete`: interactive terminal clients of a running server, as
`vllm chat` and `vllm complete` are.

Each reply streams as it is generated. `chat` keeps the conversation and sends all of it on every
turn; `complete` sends each line as a new prompt. Ctrl-C during a reply stops that reply (the
connection is closed, so the server aborts the request) and keeps the session; Ctrl-C at the prompt
clears the line; Ctrl-D (end of input) exits with status 0. `--quick MESSAGE` sends one message,
prints the reply and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

DEFAULT_URL = "http://127.0.0.1:8000/v1"
PROMPT = "> "
API_KEY_ENV = "OPENAI_API_KEY"  # the key when --api-key is not given, as `vllm chat` reads it
# Bytes of the input that are not UTF-8, as Python's surrogateescape reads them.
_UNDECODED = re.compile("[\udc80-\udcff]")


def api_base(url: str) -> str:
    """The OpenAI API base under `url`: the server's root and its /v1 are both accepted."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class ServerError(Exception):
    """The server refused or failed a request; the message says why, as the server put it."""


@dataclass
class Client:
    """The few OpenAI-compatible calls the terminal clients make."""

    base_url: str
    api_key: str | None = None
    timeout: float = 600.0
    _http: httpx.Client = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.base_url = api_base(self.base_url)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # Connecting may fail fast; a reply may take as long as generation takes.
        timeout = httpx.Timeout(self.timeout, connect=10.0)
        self._http = httpx.Client(base_url=self.base_url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def first_model(self) -> str:
        """The first model `/models` lists (a server serves one, under one or more names)."""
        try:
            r = self._http.get("/models")
        except httpx.TransportError as e:
            raise ServerError(f"cannot reach the server at {self.base_url} ({type(e).__name__}: {e})") from None
        _raise_for_error(r)
        models = r.json().get("data") or []
        if not models:
            raise ServerError(f"{self.base_url}/models lists no model")
        return str(models[0]["id"])

    def stream(self, route: str, body: dict[str, Any], text_of: Any) -> Generator[str, None, None]:
        """The text pieces of a streamed reply. Closing the iterator closes the connection, which the
        server takes as the client going away (the request is aborted)."""
        try:
            with self._http.stream("POST", route, json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    r.read()
                    _raise_for_error(r)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ServerError(_error_text(event["error"], None))
                    for choice in event.get("choices") or []:
                        piece = text_of(choice)
                        if piece:
                            yield piece
        except httpx.TransportError as e:
            raise ServerError(f"lost the server at {self.base_url} ({type(e).__name__}: {e})") from None


def _error_text(error: Any, status: int | None) -> str:
    message = error.get("message") if isinstance(error, dict) else None
    where = f"HTTP {status}: " if status is not None else ""
    return where + (message if isinstance(message, str) and message else json.dumps(error)[:500])


def _raise_for_error(r: httpx.Response) -> None:
    if r.status_code == 200:
        return
    try:
        error = r.json().get("error", r.text)
    except (ValueError, AttributeError):
        error = {"message": r.text.strip()[:500] or r.reason_phrase}
    raise ServerError(_error_text(error, r.status_code))


def _chat_piece(choice: dict[str, Any]) -> str | None:
    return (choice.get("delta") or {}).get("content")


def _completion_piece(choice: dict[str, Any]) -> str | None:
    return choice.get("text")


@dataclass
class Session:
    """One terminal session: the model, the sampling options, and (for chat) the conversation."""

    client: Client
    model: str
    sampling: dict[str, Any]
    chat: bool
    out: TextIO = sys.stdout
    err: TextIO = sys.stderr
    history: list[dict[str, str]] = field(default_factory=list)
    _told_undecoded: bool = field(default=False, init=False, repr=False)

    def clean(self, text: str) -> str:
        """`text` with each byte that was not UTF-8 replaced by U+FFFD (said once a session)."""
        cleaned, n = _UNDECODED.subn("\ufffd", text)
        if n and not self._told_undecoded:
            self._told_undecoded = True
            print("note: the input is not all UTF-8; each byte that is not was sent as U+FFFD",
                  file=self.err, flush=True)
        return cleaned

    def send(self, text: str) -> bool:
        """Send one message (chat) or prompt (complete) and stream the reply to `out`. False when the
        server answered an error (printed to `err`; the conversation is left as it was)."""
        body: dict[str, Any]
        text = self.clean(text)
        if self.chat:
            self.history.append({"role": "user", "content": text})
            route, body, piece = "/chat/completions", {"messages": self.history}, _chat_piece
        else:
            route, body, piece = "/completions", {"prompt": text}, _completion_piece
        reply: list[str] = []
        stream = self.client.stream(route, {"model": self.model, **body, **self.sampling}, piece)
        try:
            for p in stream:
                reply.append(p)
                self.out.write(p)
                self.out.flush()
        except KeyboardInterrupt:
            stream.close()  # closes the connection: the server stops generating
            self.out.write("\n[interrupted]")
        except ServerError as e:
            self.out.write("\n" if reply else "")
            self.out.flush()
            print(f"error: {e}", file=self.err, flush=True)
            if self.chat:
                self.history.pop()
            return False
        self.out.write("\n")
        self.out.flush()
        if self.chat:
            if reply:  # what was shown, interrupted or not, is the assistant's turn
                self.history.append({"role": "assistant", "content": "".join(reply)})
            else:
                self.history.pop()
        return True

    def loop(self, read_line: Any = input) -> int:
        """Read lines until end of input; each non-empty one is sent."""
        while True:
            try:
                line = read_line(PROMPT)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            if line.strip():
                self.send(line)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return {k: v for k, v in options.items() if v is not None}


def _read_undecodable_bytes() -> None:
    """Read standard input with bytes that are not UTF-8 kept (as surrogates, which `Session.clean`
    replaces) rather than failing the session on them."""
    stdin = sys.stdin
    if isinstance(stdin, io.TextIOWrapper):
        stdin.reconfigure(errors="surrogateescape")


def run(args: argparse.Namespace) -> int:
    chat = args.command == "chat"
    _read_undecodable_bytes()
    client = Client(args.url, args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None)
    try:
        model = args.model or client.first_model()
        session = Session(client, model, _sampling(args), chat)
        if chat and args.system_prompt:
            session.history.append({"role": "system", "content": session.clean(args.system_prompt)})
        if args.quick is not None:
            return 0 if session.send(args.quick) else 1
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print(f"Using model {model} at {args.url}; Ctrl-C stops a reply, Ctrl-D exits.", file=sys.stderr)
        return session.loop()
    except ServerError as e:
        print(f"cadence: error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _temperature(text: str) -> float:
    """A finite number >= 0 (nan and inf would only fail later, as a JSON error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _max_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


_COMMANDS = (  # name, what it does (help), and at more length (description)
    ("chat", "chat interactively with the model of a running server",
     "Chat interactively with the model of a running OpenAI-compatible server: each line is a turn of "
     "the conversation, and the whole conversation is sent with each."),
    ("complete", "complete prompts interactively on a running server",
     "Complete prompts interactively on a running OpenAI-compatible server: each line is a new prompt."),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    for name, what, description in _COMMANDS:
        p = subparsers.add_parser(
            name,
            help=f"{what} (as vllm {name})",
            description=f"{description} Replies stream as they are generated. Ctrl-C stops a reply, Ctrl-D exits.",
        )
        p.add_argument("--url", default=DEFAULT_URL,
                       help="the server's API base URL, with or without its /v1 (default %(default)s)")
        p.add_argument("--model", "--model-name", dest="model", default=None,
                       help="the model to ask (default: the first one the server's /models lists)")
        p.add_argument("--api-key", default=None,
                       help=f"sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} where set, else none)")
        if name == "chat":
            p.add_argument("--system-prompt", default=None,
                           help="a system message that opens the conversation (default: none, the template's own)")
        p.add_argument("--max-tokens", type=_max_tokens, default=None,
                       help="tokens to generate at most per reply (default: the server's)")
        p.add_argument("--temperature", type=_temperature, default=None,
                       help="sampling temperature; 0: greedy (default: the server's)")
        p.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                       help="send this one message, print the reply and exit")
        p.set_defaults(func=run)
