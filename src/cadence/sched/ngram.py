"""n-gram (prompt lookup) drafts: guess a request's next tokens from its own context.

Text that quotes, edits or summarises its input, and code, repeats spans of what came before:
when the last n tokens occurred earlier, the tokens that followed them then are a good guess for
what follows now. The drafts are the tokens after the latest earlier occurrence of the last n
tokens, for the longest n in [min_n, max_n] that has one.

Pure, and cheap per step: a request's context is kept packed as 32-bit integers (`PackedTokens`,
extended by the tokens added since the last call), and the search is `bytearray.rfind`, in C,
rather than a Python loop over the context.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("I").itemsize  # bytes per packed token (token ids are vocabulary indices: >= 0)


class PackedTokens:
    """A token sequence packed as 32-bit integers, grown at the end."""

    __slots__ = ("data", "num_tokens")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.data = bytearray()
        self.num_tokens = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.data += array("I", tokens).tobytes()
        self.num_tokens += len(tokens)

    def continuation(self, min_n: int, max_n: int) -> int | None:
        """Where the continuation starts (the token index after the latest earlier occurrence of
        the last n tokens, for the longest n in [min_n, max_n] that occurs), or None."""
        lo, hi = min_n, min(max_n, self.num_tokens - 1)
        if hi < lo:
            return None
        # An occurrence of the last n tokens holds one of the last n - 1 (a token later), so the
        # lengths that occur are the first ones of [min_n, hi]: the longest is found by bisection,
        # a few searches however large prompt_lookup_max is, rather than one search per length.
        found = self._latest_match(hi)
        if found is not None:
            return found + hi
        found = self._latest_match(lo)
        if found is None:
            return None
        hi -= 1
        while lo < hi:  # lo occurs (at `found`); every length above hi does not
            mid = (lo + hi + 1) // 2
            start = self._latest_match(mid)
            if start is None:
                hi = mid - 1
            else:
                lo, found = mid, start
        return found + lo

    def _latest_match(self, n: int) -> int | None:
        """Token index of the latest occurrence of the last `n` tokens that starts before the
        suffix itself, or None. A byte match that is not token-aligned is skipped."""
        data = self.data
        pattern = bytes(data[(self.num_tokens - n) * _WIDTH :])
        end = (self.num_tokens - 1) * _WIDTH  # the occurrence must end before the last token: not the suffix
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                return None
            if at % _WIDTH == 0:
                return at // _WIDTH
            end = at + len(pattern) - 1  # a misaligned hit: look again, left of it


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to `k` draft tokens continuing `tokens` (see the module doc); () when none."""
    if k < 1 or len(tokens) < min_n + 1:
        return ()
    follow = PackedTokens(tokens).continuation(min_n, max_n)
    return () if follow is None else tuple(tokens[follow : follow + k])
