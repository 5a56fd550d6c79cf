"""From generated text to tool calls, incrementally (streaming) or at once (the same code).

An extractor is fed the text as it is generated and returns `Piece`s: content to show, the start
of a call (its id and function name), or a fragment of a call's arguments (JSON text). Fed the
whole text at once it returns the same calls and content as fed piece by piece.

- `HermesExtractor` (`tool_choice: auto`): calls are `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks (Hermes' format, which the fallback prompt of tools.py asks for).
  A block whose JSON does not parse, is not an object, names a function that was not offered or
  has arguments that are not an object stays in the content as it was written, as does a block
  never closed. Whitespace between blocks and around them is dropped. With `parallel` off, blocks
  after the first call stay in the content.
- `NamedExtractor` (a named function): the whole output is that function's arguments.
- `ArrayExtractor` (`required`): the output is a JSON array of `{"name", "parameters"}` objects;
  each is a call once its closing brace arrives. Text left over (a cut-off element) is content.
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass
from typing import Any

from cadence.server.json_text import parse_json

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    """OpenAI's form: `call_` and 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str


Piece = Content | CallStart | CallArguments


class Extractor(abc.ABC):
    """Reads one output's calls: `feed` each new piece of text, then `finish` once at its end."""

    def __init__(self) -> None:
        self.num_calls = 0
        # False while a call that was begun is unfinished (its arguments not yet whole JSON):
        # an output that stops there has not made its calls.
        self.calls_complete = True

    def _call(self, name: str, arguments: str) -> list[Piece]:
        index = self.num_calls
        self.num_calls += 1
        return [CallStart(index, new_call_id(), name), CallArguments(index, arguments)]

    @abc.abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` completes (what may still turn out otherwise is held back)."""

    def finish(self) -> list[Piece]:
        """What was held back, at the end of the output."""
        return []


def _arguments_text(arguments: Any) -> str:
    return json.dumps(arguments, ensure_ascii=False)


class HermesExtractor(Extractor):
    def __init__(self, names: tuple[str, ...], parallel: bool = True) -> None:
        super().__init__()
        self.names = frozenset(names)
        self.parallel = parallel
        self._buf = ""  # text not looked at yet: a block being read, or what may start a tag
        self._in_block = False
        self._ws = ""  # whitespace after the last content: shown if content follows, dropped before a call
        self._after_call = False  # whitespace right after a call is dropped

    def _open(self) -> bool:
        return self.parallel or self.num_calls == 0

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    return out
                block, self._buf = self._buf[: end + len(CLOSE_TAG)], self._buf[end + len(CLOSE_TAG):]
                self._in_block = False
                out += self._block(block)
                continue
            start = self._buf.find(OPEN_TAG) if self._open() else -1
            if start >= 0:
                out += self._text(self._buf[:start])
                self._buf, self._in_block = self._buf[start:], True
                continue
            keep = _partial_tag_suffix(self._buf) if self._open() else 0
            out += self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def _text(self, text: str) -> list[Piece]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return [Content(body)] if body else []

    def _block(self, block: str) -> list[Piece]:
        inner = block[len(OPEN_TAG): -len(CLOSE_TAG)]
        try:
            call = parse_json(inner)
        except ValueError:
            call = None
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("name") in self.names and isinstance(arguments, dict)):
            # Malformed: the text stays as the model wrote it.
            text, self._ws, self._after_call = self._ws + block, "", False
            return [Content(text)]
        self._ws, self._after_call = "", True
        return self._call(call["name"], _arguments_text(arguments))

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if self._in_block:  # a block never closed
            self._in_block = False
            text, self._ws = self._ws + rest, ""
            return [Content(text)]
        out = self._text(rest)
        if self._ws:
            out.append(Content(self._ws))
            self._ws = ""
        return out


def _partial_tag_suffix(text: str) -> int:
    """Length of the longest end of `text` that could be the start of `<tool_call>`."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


class NamedExtractor(Extractor):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._arguments = ""

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.num_calls == 0:
            self.num_calls = 1
            out.append(CallStart(0, new_call_id(), self.name))
        if text:
            self._arguments += text
            out.append(CallArguments(0, text))
        return out

    def finish(self) -> list[Piece]:
        # The grammar forces whole arguments, but a stop string may end the output inside them.
        try:
            parse_json(self._arguments)
        except ValueError:
            self.calls_complete = False
        return []


class ArrayExtractor(Extractor):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._scanned = 0  # characters of _buf already scanned
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._element_start: int | None = None

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        i = self._scanned
        while i < len(self._buf):
            ch = self._buf[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                if self._depth == 1 and ch == "{":
                    self._element_start = i - 1
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._element_start is not None:
                    out += self._element(self._buf[self._element_start: i])
                    self._buf, i, self._element_start = self._buf[i:], 0, None
        self._scanned = i
        return out

    def _element(self, text: str) -> list[Piece]:
        try:
            call = parse_json(text)
        except ValueError:
            return [Content(text)]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return [Content(text)]
        return self._call(call["name"], _arguments_text(call.get("parameters", {})))

    def finish(self) -> list[Piece]:
        """The unfinished element, as text (separators and brackets are no content)."""
        start, self._element_start = self._element_start, None
        rest, self._buf = self._buf, ""
        if start is None:
            return []
        self.calls_complete = False  # the output ended inside a call (a stop string, max_tokens)
        return [Content(rest[start:])]


@dataclass
class Extracted:
    """All of one output's pieces gathered: the content and the calls (id, name, arguments)."""

    content: str
    calls: list[tuple[str, str, str]]


def gather(pieces: list[Piece]) -> Extracted:
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, Content):
            content.append(p.text)
        elif isinstance(p, CallStart):
            calls[p.index] = [p.id, p.name, ""]
        else:
            calls[p.index][2] += p.fragment
    return Extracted("".join(content), [(c[0], c[1], c[2]) for _, c in sorted(calls.items())])
