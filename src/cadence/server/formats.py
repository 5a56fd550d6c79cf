"""Response bodies and SSE events in OpenAI's shapes, built as plain dicts (the hot path of streaming).

`protocol.py` holds the same shapes as pydantic models for the OpenAPI schema; the tests check real
responses against them.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cadence.boundary import TokenLogprobs
from cadence.engine.output_processor import StreamDelta
from cadence.server.tool_parser import CallArguments, CallStart, Content, Extractor, Piece, gather

DONE_EVENT = b"data: [DONE]\n\n"


def queue_comment(position: int | None, predicted_ttft: float | None, state: str) -> bytes:
    """The SSE comment that opens a stream with stream_options.include_queue_status: a line that
    starts with ':' is ignored by SSE parsers, OpenAI's clients among them."""
    ttft = "unknown" if predicted_ttft is None else f"{predicted_ttft:.3f}"
    return f": queued position={position if position is not None else 0} predicted_ttft_s={ttft} state={state}\n\n".encode()


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: {json}\\n\\n` (compact JSON, never a raw newline inside)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class TokenStrings:
    """Token id -> its text, for logprobs; cached because the same ids recur constantly."""

    def __init__(self, tokenizer: Any, limit: int = 65536) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._limit = limit

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._limit:
                self._cache[token_id] = s
        return s


@dataclass
class ChoiceState:
    """What one choice has produced so far (all of it when not streaming; offsets when streaming)."""

    text: list[str] = field(default_factory=list)
    num_chars: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class UsageTracker:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI counts them."""

    n: int
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0
    choice_tokens: dict[int, int] = field(default_factory=dict)  # choice -> its tokens so far
    queue_time: float | None = None  # longest wait in the engine's queue among the choices (seconds)
    finals: dict[int, StreamDelta] = field(default_factory=dict)  # choice -> its last delta (metrics)

    def add(self, index: int, delta: StreamDelta) -> None:
        p = index // self.n
        self.prompt_tokens[p] = max(self.prompt_tokens.get(p, 0), delta.num_prompt_tokens)
        self.cached_tokens[p] = max(self.cached_tokens.get(p, 0), delta.num_cached_tokens)
        self.completion_tokens += len(delta.token_ids)
        self.choice_tokens[index] = self.choice_tokens.get(index, 0) + len(delta.token_ids)
        m = delta.metrics
        if m is not None:  # a choice's last delta
            self.finals[index] = delta
            q = m.queue_time
            if q is not None:
                self.queue_time = max(self.queue_time or 0.0, q)

    def choice_dict(self, index: int, prompt_tokens: int) -> dict[str, int]:
        """One choice's usage so far (stream_options.continuous_usage_stats)."""
        done = self.choice_tokens.get(index, 0)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
            # A cadence extension (OpenAI clients ignore unknown usage fields): benchmarks read it.
            "queue_time": self.queue_time,
        }


class Formatter(abc.ABC):
    """Builds one API's chunks and final body; subclasses: completions and chat completions."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        num_choices: int,
        tokens: TokenStrings,
        want_logprobs: bool,
    ) -> None:
        self.request_id = request_id
        self.want_logprobs = want_logprobs
        self.model = model
        self.created = created
        self.choices = [ChoiceState() for _ in range(num_choices)]
        self.tokens = tokens

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def accumulate(self, index: int, d: StreamDelta) -> None:
        st = self.choices[index]
        st.text.append(d.text)
        if d.logprobs:
            st.logprobs.extend(d.logprobs)
        if d.finished:
            st.finish_reason, st.stop_reason = d.finish_reason, d.stop_reason

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, index: int, d: StreamDelta) -> list[dict[str, Any]]:
        """The SSE chunks for a delta: one, or none when it carries nothing to send."""
        if not d.text and not d.finished and not d.logprobs:
            return []  # nothing a client could see (bytes of a character, or a possible stop string)
        return [self._chunk(index, self._delta(index, d), d)]

    def _chunk(self, index: int, fields: dict[str, Any], d: StreamDelta) -> dict[str, Any]:
        """A chunk of `fields`, ending the choice when `d` is its last delta."""
        choice = {"index": index, **fields, "finish_reason": self._finish_reason(index, d.finish_reason)}
        if d.finished:
            choice["stop_reason"] = d.stop_reason
        return self._envelope(self.chunk_object_name, [choice])

    @abc.abstractmethod
    def _delta(self, index: int, d: StreamDelta) -> dict[str, Any]:
        """A chunk's choice fields between its index and its finish reason: the text and logprobs."""

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        return reason

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage
        return body

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming body."""
        choices = [{"index": i, **self._final(st), "finish_reason": self._finish_reason(i, st.finish_reason),
                    "stop_reason": st.stop_reason} for i, st in enumerate(self.choices)]
        body = self._envelope(self.object_name, choices)
        body["usage"] = usage
        return body

    @abc.abstractmethod
    def _final(self, st: ChoiceState) -> dict[str, Any]:
        """A whole choice's fields between its index and its finish reason: the text and logprobs."""


class CompletionFormatter(Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _logprobs(self, st: ChoiceState, lps: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in lps:
            s = self.tokens(lp.token_id)
            tokens.append(s)
            offsets.append(st.num_chars)
            st.num_chars += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [self._top(lp) for lp in lps],
            "text_offset": offsets,
        }

    def _top(self, lp: TokenLogprobs) -> dict[str, float]:
        """The sampled token, then the top N without it: N entries when the sampled token is among
        the top N, N + 1 when it is not (OpenAI's legacy completions and vLLM; `logprobs: 0` gives
        the sampled token's entry alone)."""
        top = {self.tokens(lp.token_id): lp.logprob}
        for t, v in lp.top:
            top.setdefault(self.tokens(t), v)
        return top

    def _delta(self, index: int, d: StreamDelta) -> dict[str, Any]:
        lp = self._logprobs(self.choices[index], d.logprobs) if d.logprobs is not None else None
        return {"text": d.text, "logprobs": lp}

    def _final(self, st: ChoiceState) -> dict[str, Any]:
        lp = self._logprobs(ChoiceState(), st.logprobs) if self.want_logprobs else None
        return {"text": "".join(st.text), "logprobs": lp}


class ChatFormatter(Formatter):
    """Chat chunks and bodies. With `extractor` (a factory, one extractor per choice), the text is
    read for tool calls (tool_parser.py): calls go out as `tool_calls` (streamed as OpenAI streams
    them: the call's index, id, type and function name first, then its arguments in fragments),
    the rest as `content`, and a choice that made whole calls and stopped finishes with "tool_calls"."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, extractor: Callable[[], Extractor] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._make_extractor = extractor
        self._extractors = [extractor() for _ in self.choices] if extractor is not None else None

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        ext = self._extractors[index] if self._extractors is not None else None
        if reason == "stop" and ext is not None and ext.num_calls and ext.calls_complete:
            return "tool_calls"
        return reason

    def _logprobs(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        content = []
        for lp in lps:
            s = self.tokens(lp.token_id)
            content.append({**self._entry(lp.token_id, lp.logprob, s), "top_logprobs": self._top(lp, s)})
        return {"content": content}

    def _top(self, lp: TokenLogprobs, s: str) -> list[dict[str, Any]]:
        """N entries for `top_logprobs: N`, as vLLM lists them: the sampled token first, then the
        likeliest others. The same N tokens as OpenAI's top N when the sampled token is among them;
        when it is not, it takes the place of the N-th."""
        others = [self._entry(t, v) for t, v in lp.top if t != lp.token_id]
        return [self._entry(lp.token_id, lp.logprob, s), *others][: len(lp.top)]

    def _entry(self, token_id: int, logprob: float, s: str | None = None) -> dict[str, Any]:
        s = self.tokens(token_id) if s is None else s
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def start_chunks(self) -> list[dict[str, Any]]:
        # OpenAI opens every choice with the role before any content.
        return [
            self._envelope(
                self.chunk_object_name,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in range(len(self.choices))
        ]

    def _delta(self, index: int, d: StreamDelta) -> dict[str, Any]:
        lp = self._logprobs(d.logprobs) if d.logprobs is not None else None
        return {"delta": {"content": d.text} if d.text else {}, "logprobs": lp}

    def chunks(self, index: int, d: StreamDelta) -> list[dict[str, Any]]:
        """With tools, a call's opening (index, id, type, name, empty arguments) gets a chunk of its
        own, as OpenAI streams it; what the parser holds back waits for a later delta."""
        if self._extractors is None or (not d.text and not d.finished and not d.logprobs):
            return super().chunks(index, d)
        ext = self._extractors[index]
        deltas = [_tool_delta(g) for g in _split_at_calls(ext.feed(d.text) + (ext.finish() if d.finished else []))]
        lp = self._logprobs(d.logprobs) if d.logprobs is not None else None
        if not deltas:
            if not d.finished and lp is None:
                return []
            deltas = [{}]
        last = len(deltas) - 1
        out = [self._envelope(self.chunk_object_name, [{"index": index, "delta": delta, "logprobs": None,
                                                        "finish_reason": None}]) for delta in deltas[:last]]
        return [*out, self._chunk(index, {"delta": deltas[last], "logprobs": lp}, d)]

    def _final(self, st: ChoiceState) -> dict[str, Any]:
        lp = self._logprobs(st.logprobs) if self.want_logprobs else None
        text = "".join(st.text)
        if self._make_extractor is None:
            return {"message": {"role": "assistant", "content": text}, "logprobs": lp}
        ext = self._make_extractor()
        got = gather(ext.feed(text) + ext.finish())
        message: dict[str, Any] = {"role": "assistant", "content": got.content}
        if got.calls:
            message["content"] = got.content or None
            message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                     for i, n, a in got.calls]
        index = next(i for i, c in enumerate(self.choices) if c is st)
        self._extractors[index] = ext  # type: ignore[index]  # its calls decide the finish reason
        return {"message": message, "logprobs": lp}


def _split_at_calls(pieces: list[Piece]) -> list[list[Piece]]:
    """The pieces in groups, each call's start alone in its own."""
    groups: list[list[Piece]] = [[]]
    for p in pieces:
        if isinstance(p, CallStart):
            groups += [[p], []]
        else:
            groups[-1].append(p)
    return [g for g in groups if g]


def _tool_delta(pieces: list[Piece]) -> dict[str, Any]:
    """One delta from a group of pieces: content joined, arguments fragments joined per call."""
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    calls: list[dict[str, Any]] = []
    for p in pieces:
        if isinstance(p, CallStart):
            calls.append({"index": p.index, "id": p.id, "type": "function",
                          "function": {"name": p.name, "arguments": ""}})
        elif isinstance(p, CallArguments):
            if calls and calls[-1]["index"] == p.index:
                calls[-1]["function"]["arguments"] += p.fragment
            else:
                calls.append({"index": p.index, "function": {"arguments": p.fragment}})
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta
