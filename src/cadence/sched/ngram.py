"""n-gram (prompt lookup) drafts: guess a request's next tokens from its own context.

Text that quotes, edits or summarises its input, and code, repeats spans of what came before:
when the last n tokens occurred earlier, the tokens that followed them then are a good guess for
what follows now. `propose` returns up to k such tokens for the longest n in [min_n, max_n] whose
n-gram occurs earlier (the latest such occurrence), or nothing. Pure: the scheduler calls it per
speculating request per step, so the search runs in C (`bytes.rfind` over the context packed as
32-bit integers) rather than a Python loop over the context.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("I").itemsize  # bytes per packed token (token ids are vocabulary indices: >= 0)


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to `k` draft tokens continuing `tokens`: those after the latest earlier occurrence of its
    last n tokens, for the longest n in [min_n, max_n] that has one; () when none occurs."""
    num = len(tokens)
    if k < 1 or num < min_n + 1:
        return ()
    packed = array("I", tokens).tobytes()
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        start = _latest_match(packed, num, n)
        if start is not None:
            follow = start + n
            return tuple(tokens[follow : min(follow + k, num)])
    return ()


def _latest_match(packed: bytes, num: int, n: int) -> int | None:
    """Token index of the latest occurrence of the last `n` tokens that starts before the suffix
    itself, or None. A byte match that is not token-aligned is skipped."""
    pattern = packed[(num - n) * _WIDTH :]
    end = (num - 1) * _WIDTH  # the occurrence must end before the last token: not the suffix itself
    while True:
        at = packed.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % _WIDTH == 0:
            return at // _WIDTH
        end = at + len(pattern) - 1  # a misaligned hit: look again, left of it
