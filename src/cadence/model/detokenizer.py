"""Streaming text out of token ids: the incremental detokenizer and the stop-string checker.

Streaming never shows a half character: bytes of a multi-byte UTF-8 character split across tokens
are held back until the character is complete, and text that might become a stop string is held
back until it cannot. Both work in O(1) amortised time per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = ["Decoder", "IncrementalDetokenizer", "StopChecker"]


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals decoding them all.

    Each step decodes a short window: the tokens already shown last time (context for decoders that
    depend on neighbours, like a leading-space rule) plus the new ones. Text that ends in U+FFFD is
    an unfinished UTF-8 character and is held back until more bytes arrive or `flush()`.
    """

    HOLD_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so it spans at most 4 tokens

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self.HOLD_TOKENS :])  # context only, never emitted
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this have been emitted
        self._prefix_text = self._decode(0, self._read)

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed this step's new token(s); returns the text that became final."""
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        end = len(self._ids)
        if end == self._read:
            return ""
        text = self._decode(self._prefix, end)
        pending = end - self._read
        if not text.endswith("\ufffd"):
            # Advance on new text, or when a run of tokens that decode to nothing (skipped specials) grows.
            if len(text) > len(self._prefix_text) or pending > self.HOLD_TOKENS:
                return self._advance(text, end)
            return ""
        if pending > self.HOLD_TOKENS:
            # Bytes that will never form a character: emit up to a cut whose text cannot change,
            # since any character crossing the cut would end within the HOLD_TOKENS tokens after it.
            cut = end - self.HOLD_TOKENS
            head = self._decode(self._prefix, cut)
            if text.startswith(head) and len(head) >= len(self._prefix_text):
                return self._advance(head, cut)
        return ""

    def _advance(self, text: str, upto: int) -> str:
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, upto
        del self._ids[: self._prefix]  # keep memory bounded: nothing before the window is read again
        self._read -= self._prefix
        self._prefix = 0
        self._prefix_text = self._decode(0, self._read)
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is held back (an unfinished character decodes as U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        return self._advance(self._decode(self._prefix, len(self._ids)), len(self._ids))


class StopChecker:
    """Finds stop strings in streamed text, across delta boundaries.

    `add(delta)` returns (text safe to emit now, the stop string that matched or None). Text that
    could still grow into a stop string is held back; on a match the output ends at the stop string
    (or after it with include_stop_str_in_output) and nothing more is emitted. The result does not
    depend on how the text was cut into deltas.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        self._stops = list(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._held = ""
        self.matched: str | None = None

    def add(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", None
        buf = self._held + delta
        hit = self._earliest(buf)
        if hit is not None:
            at, stop = hit
            self.matched, self._held = stop, ""
            return buf[: at + len(stop)] if self._include else buf[:at], stop
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """The held-back tail, when the stream ends without a match."""
        held, self._held = self._held, ""
        return held

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        """The stop that completes first (what a token-by-token stream would see first); at the
        same end, the one starting earlier; then the first listed."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return (best[1], best[2]) if best else None

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
