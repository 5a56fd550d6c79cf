"""Turn the engine core's token deltas into text deltas: incremental detokenization and stop strings.

Lives outside the core (the core knows token ids only), on whichever side consumes the stream: the
offline `LLM` calls it in its loop, the `AsyncEngine` in its engine thread. A stop string found here
ends the request in the core too: `process` returns those ids for `core.finish_requests`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cadence.boundary import RequestDelta, RequestMetrics, TokenLogprobs
from cadence.engine.events import EngineEvent
from cadence.model.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from cadence.request import FinishReason, SamplingParams


@dataclass
class StreamDelta:
    """New text and tokens of one request after one step; the last one carries finish reason and metrics."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_by_request: bool = False  # the error is the request's own: a 400, not a 500
    retry_after: float | None = None  # seconds, when the request ended refused (evicted from the queue)
    events: tuple[EngineEvent, ...] = ()  # on the last delta, when the engine records events (events.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _State:
    params: SamplingParams
    num_prompt_tokens: int
    detok: IncrementalDetokenizer
    stops: StopChecker | None
    num_output_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    emitted: int = 0) -> None:
        """`emitted`: the prompt's last tokens are output another engine streamed already (the first
        token of a request handed from prefill to decode), showing `shown_text` of them. They are
        replayed here silently, so the text goes on from theirs: a character split across them and
        the next token, a stop string that begins in their text."""
        st = _new_state(self.tokenizer, params, len(prompt_token_ids))
        if emitted:
            _show(st, prompt_token_ids[-emitted:])
        self._states[request_id] = st

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def num_output_tokens(self, request_id: str) -> int:
        """Tokens the request has streamed so far (0 once it has ended here)."""
        st = self._states.get(request_id)
        return st.num_output_tokens if st is not None else 0

    def __len__(self) -> int:
        return len(self._states)

    def process(self, deltas: Iterable[RequestDelta]) -> tuple[list[StreamDelta], list[str]]:
        """Detokenize each delta; returns the stream deltas and the ids stopped by a stop string."""
        out: list[StreamDelta] = []
        stopped: list[str] = []
        for d in deltas:
            st = self._states.get(d.request_id)
            if st is None:  # already ended here (stop string), the core's own final delta is moot
                continue
            sd = self._one(st, d)
            if sd.finish_reason == FinishReason.STOP.value and d.finish_reason is None:
                stopped.append(d.request_id)
            if sd.finished:
                del self._states[d.request_id]
            out.append(sd)
        return out, stopped

    def _one(self, st: _State, d: RequestDelta) -> StreamDelta:
        if st.stops is not None and len(d.new_token_ids) > 1:
            return self._several(st, d)
        st.num_output_tokens += len(d.new_token_ids)
        ending = d.finish_reason is not None
        text = st.detok.add(d.new_token_ids)
        if ending:
            text += st.detok.flush()  # bytes held back for an unfinished character can no longer complete
        finish = d.finish_reason.value if d.finish_reason else None
        stop_reason = d.stop_reason
        if st.stops is not None:
            text, matched = st.stops.add(text)
            if matched is not None:
                finish, stop_reason = FinishReason.STOP.value, matched
            elif ending:
                text += st.stops.flush()  # held back as a possible stop string; the request ended first
        return self._delta(st, d, text, list(d.new_token_ids), finish, stop_reason)

    def _several(self, st: _State, d: RequestDelta) -> StreamDelta:
        """Several tokens in one delta (speculative decoding) under stop strings: checked a token at
        a time, so the tokens after the one that completes a stop string are dropped, as they
        would never have been generated one step at a time."""
        stops = st.stops
        assert stops is not None
        tokens = list(d.new_token_ids)
        pieces: list[str] = []
        for i, token in enumerate(tokens):
            text, matched = stops.add(st.detok.add((token,)))
            pieces.append(text)
            if matched is not None:
                st.num_output_tokens += i + 1
                return self._delta(st, d, "".join(pieces), tokens[: i + 1], FinishReason.STOP.value, matched)
        st.num_output_tokens += len(tokens)
        ending = d.finish_reason is not None
        if ending:
            text, matched = stops.add(st.detok.flush())
            pieces.append(text)
            if matched is not None:
                return self._delta(st, d, "".join(pieces), tokens, FinishReason.STOP.value, matched)
            pieces.append(stops.flush())
        finish = d.finish_reason.value if d.finish_reason else None
        return self._delta(st, d, "".join(pieces), tokens, finish, d.stop_reason)

    def _delta(self, st: _State, d: RequestDelta, text: str, tokens: list[int], finish: str | None,
               stop_reason: str | int | None) -> StreamDelta:
        return StreamDelta(
            request_id=d.request_id,
            text=text,
            token_ids=tokens,
            logprobs=list(d.new_logprobs[: len(tokens)]) if st.params.logprobs is not None else None,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=st.num_prompt_tokens,
            num_cached_tokens=d.num_cached_tokens,
            num_output_tokens=st.num_output_tokens,
            metrics=d.metrics,
            error=d.error,
            error_by_request=d.error_by_request,
            retry_after=d.retry_after,
        )


def shown_text(tokenizer: Tokenizer, params: SamplingParams, token_ids: list[int]) -> str:
    """The text a request's stream shows for its first output `token_ids` while it has not ended
    (text that may still become a character or a stop string held back): what an engine handing the
    request on shows, and what the next one starts from (`add_request(emitted=...)`)."""
    return _show(_new_state(tokenizer, params, 0), token_ids)


def _new_state(tokenizer: Tokenizer, params: SamplingParams, num_prompt_tokens: int) -> _State:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
    stops = StopChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
    return _State(params, num_prompt_tokens, detok, stops)


def _show(st: _State, token_ids: list[int]) -> str:
    text = st.detok.add(token_ids)
    return st.stops.add(text)[0] if st.stops is not None else text


def attach_final_metrics(stream: list[StreamDelta], final: Iterable[RequestDelta]) -> None:
    """Requests ended here by a stop string: their last stream delta came from a token delta, which
    carries no metrics; `final` (what the core returned when told to finish them) has them."""
    ended = {d.request_id: d.metrics for d in final}
    for sd in stream:
        if sd.finished and sd.metrics is None and sd.request_id in ended:
            sd.metrics = ended[sd.request_id]
