"""Block hashes for automatic prefix caching.

A full block's hash chains its parent's hash with its own token ids, so equal hashes mean equal
whole prefixes, not just equal blocks. An optional salt (the tenant, when isolation is on) is
mixed into every block so two tenants never share cached KV. Only full blocks are hashed: a
partial block's content is still changing.

Two algorithms, as vLLM's `prefix_caching_hash_algo`: `sha256` (the default), whose digests no
client can steer into a collision, so one tenant's prompt can never be served another's KV; and
`builtin`, Python's 64-bit `hash()` of a tuple, about 3x cheaper and collision-free only by
chance (about one in 10^6 over millions of blocks): for trusted traffic and for the simulator,
whose prompts are synthetic and whose decisions depend only on which blocks are equal.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import cast

from cadence.config import HASH_ALGOS

BlockHash = bytes | int  # a SHA-256 digest, or a `builtin` hash

# The parent of a request's first block; distinct from any digest (digests are 32 bytes).
_ROOT = b"cadence-kv-root"
_sha256 = hashlib.sha256


@lru_cache(maxsize=4096)  # one salt per tenant, encoded for every block hashed
def _encode_salt(salt: str | None) -> bytes:
    # Length-prefixed, so "ab"+tokens and "a"+"b"... can never collide; None differs from "".
    if salt is None:
        return b"\x00"
    raw = salt.encode("utf-8")
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def _encode(token_ids: Sequence[int]) -> bytes:
    """Token ids as native 64-bit integers: the bytes of `array("q", ids)`, packed by `struct` (about
    3x faster for a prompt's thousand ids, which every prefix lookup and publication encodes)."""
    return struct.pack(f"={len(token_ids)}q", *token_ids)


def _unhashed(token_ids: Sequence[int], block_size: int, known: Sequence[BlockHash]) -> tuple[list[BlockHash], Sequence[int]]:
    """A chain hasher's start: the known hashes (a new list) and the tokens of the full blocks
    after them; ValueError on a block size below 1 or more known hashes than full blocks."""
    if block_size < 1:
        raise ValueError("block_size: must be >= 1")
    num_full = len(token_ids) // block_size
    if len(known) > num_full:
        raise ValueError("known: more hashes than full blocks")
    return list(known), token_ids[len(known) * block_size : num_full * block_size]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """SHA-256 over (parent hash, salt, token ids). `parent` is None for a request's first block."""
    # Fixed-width 64-bit encoding: token lists of different lengths or values cannot alias.
    data = _encode(token_ids)
    # (A sha256 chain's parents are its own digests: bytes.)
    return _sha256((_ROOT if parent is None else cast(bytes, parent)) + _encode_salt(salt) + data).digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, reusing the first `len(known)` already computed."""
    hashes, todo = _unhashed(token_ids, block_size, known)
    if not todo:
        return hashes
    # hash_block for each block, with the tokens encoded once: a prompt is hashed block by block
    # at its first prefix lookup, and encoding each block apart took half the time.
    parent = cast(bytes, hashes[-1]) if hashes else _ROOT  # (a sha256 chain holds bytes)
    salt_bytes = _encode_salt(salt)
    data = _encode(todo)
    width = 8 * block_size
    for offset in range(0, len(data), width):
        parent = _sha256(parent + salt_bytes + data[offset : offset + width]).digest()
        hashes.append(parent)
    return hashes


# ------------------------------------------------------------------------------------------ builtin
_BUILTIN_ROOT = hash("cadence-kv-root")  # randomised per process with str hashing: only equality matters


def hash_block_builtin(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """`hash_block` with Python's tuple hash: of (parent, salt, the hash of the tokens' tuple)."""
    return hash((_BUILTIN_ROOT if parent is None else parent, salt, hash(tuple(token_ids))))


# (Its signature repeats hash_full_blocks's on purpose: `block_hashers` picks either one.)
def hash_full_blocks_builtin(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """`hash_full_blocks` with `hash_block_builtin`."""
    hashes, todo = _unhashed(token_ids, block_size, known)
    parent = hashes[-1] if hashes else _BUILTIN_ROOT
    # The blocks' token tuples and their hashes in C (zip of one iterator block_size times groups
    # the tokens); only the chain is a Python loop.
    tokens = iter(todo)
    for block in map(hash, zip(*[tokens] * block_size, strict=True)):
        parent = hash((parent, salt, block))
        hashes.append(parent)
    return hashes


BlockHasher = Callable[[BlockHash | None, Sequence[int], str | None], BlockHash]
ChainHasher = Callable[[Sequence[int], int, str | None, Sequence[BlockHash]], list[BlockHash]]


def block_hashers(algo: str) -> tuple[BlockHasher, ChainHasher]:
    """(hash one block, hash a chain of full blocks) for `algo` (one of HASH_ALGOS)."""
    if algo == "sha256":
        return hash_block, hash_full_blocks
    if algo == "builtin":
        return hash_block_builtin, hash_full_blocks_builtin
    raise ValueError(f"prefix_caching_hash_algo: must be one of {HASH_ALGOS}, got {algo!r}")
