"""Block hashes for automatic prefix caching.

A full block's hash chains its parent's hash with its own token ids, so equal hashes mean equal
whole prefixes, not just equal blocks. An optional salt (the tenant, when isolation is on) is
mixed into every block so two tenants never share cached KV. Only full blocks are hashed: a
partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import lru_cache

BlockHash = bytes  # a SHA-256 digest

# The parent of a request's first block; distinct from any digest (digests are 32 bytes).
_ROOT = b"cadence-kv-root"


@lru_cache(maxsize=4096)  # one salt per tenant, encoded for every block hashed
def _encode_salt(salt: str | None) -> bytes:
    # Length-prefixed, so "ab"+tokens and "a"+"b"... can never collide; None differs from "".
    if salt is None:
        return b"\x00"
    raw = salt.encode("utf-8")
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """SHA-256 over (parent hash, salt, token ids). `parent` is None for a request's first block."""
    h = hashlib.sha256()
    h.update(_ROOT if parent is None else parent)
    h.update(_encode_salt(salt))
    # Fixed-width 64-bit encoding: token lists of different lengths or values cannot alias.
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, reusing the first `len(known)` already computed."""
    if block_size < 1:
        raise ValueError("block_size: must be >= 1")
    num_full = len(token_ids) // block_size
    if len(known) > num_full:
        raise ValueError("known: more hashes than full blocks")
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
