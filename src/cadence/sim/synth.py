"""Deterministic prompt token ids for simulated requests.

The simulator runs the real KV cache manager, so prefix-cache hits happen only where token ids
really are equal. Requests that share leading prefix-group ids (Mooncake hash ids, a built-in
system prompt) get identical tokens for those blocks; everything else is unique to the request.
Each segment opens with a tag (kind, id) so two different segments can never start alike, and
is filled from one seeded pool of tokens, so building a prompt is a few list slices.
"""

from __future__ import annotations

import random
from array import array

from cadence.workload import WorkloadRequest

VOCAB_BASE = 32000  # every id stays below this: any real vocabulary of the supported models covers it
_POOL_SIZE = 1 << 18
_TAG_BLOCK = 1  # segment kinds; both below the pool's smallest token
_TAG_REQUEST = 2
_TAG_LEN = 3
_MIX = 0x9E3779B1  # Knuth's multiplicative hash: spreads consecutive ids across the pool


class PromptSynth:
    """Token ids for `WorkloadRequest`s; `block_tokens` is the workload's prefix block size."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens: must be >= 1")
        self.block_tokens = block_tokens
        rng = random.Random(f"cadence-sim-prompts:{seed}")
        # Tokens in [100, VOCAB_BASE) from seeded bytes: stdlib-only and fast (randrange per token is not).
        raw = array("I", rng.randbytes(4 * _POOL_SIZE))
        pool = [100 + x % (VOCAB_BASE - 100) for x in raw]
        self._pool = pool + pool  # doubled: any slice of up to _POOL_SIZE tokens is contiguous

    def _fill(self, key: int, n: int, out: list[int]) -> list[int]:
        """Append n pool tokens for `key` to `out` (each slice is copied once, straight into it)."""
        off = (key * _MIX) % _POOL_SIZE
        while n > 0:
            take = min(n, _POOL_SIZE)
            out += self._pool[off : off + take]
            n -= take
            off = (off + 7919) % _POOL_SIZE  # a long prompt wraps onto a shifted copy, not a repeat
        return out

    def _segment(self, kind: int, key: int, n: int) -> list[int]:
        tag = [kind, key % VOCAB_BASE, (key // VOCAB_BASE) % VOCAB_BASE]
        if n <= _TAG_LEN:
            return tag[:n]
        return self._fill(key * 4 + kind, n - _TAG_LEN, tag)

    def block(self, block_id: int, n: int) -> list[int]:
        """The first n tokens of shared block `block_id` (n <= block_tokens)."""
        return self._segment(_TAG_BLOCK, block_id, n)

    def prompt(self, index: int, req: WorkloadRequest) -> list[int]:
        """`req.prompt_tokens` ids: its prefix-group blocks, then a tail unique to `index`."""
        total, b = req.prompt_tokens, self.block_tokens
        out: list[int] = []
        for j, block_id in enumerate(req.prefix_group):
            start = j * b
            if start >= total:
                break
            out += self.block(block_id, min(b, total - start))
        if len(out) < total:
            tail = self._segment(_TAG_REQUEST, index, total - len(out))
            if not out:
                return tail  # (no prefix blocks, the usual case: no copy)
            out += tail
        return out
