"""KV blocks moved between engines of one model: a prefill engine exports a prompt's blocks, a decode
engine imports them as prefix-cache entries, so the request it then admits finds them as hits.

Everything here runs on the engine thread (through `AsyncEngine.run_in_engine`), between steps:
the block bookkeeping is the KV manager's and the bytes are the executor's cache tensors, neither
thread-safe. Each side hashes the prompt itself (the `builtin` hash differs between processes), so
what travels is the prompt's tokens, its cache salt and the blocks' K and V, by chain position.

The decode side reserves a block for every full prompt block before the bytes leave the prefill
side (`reserve`): blocks it holds already are pinned, the rest allocated, so arriving KV never
overruns its cache and is never evicted before its request takes it. A reservation ends when its
request has taken the blocks (a prefix hit at its first step), ends, or was never bound to a
request within its time to live.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cadence.kv.hashing import BlockHash, block_hashers


@dataclass(frozen=True)
class KVExport:
    """A prompt's blocks as a prefill engine sends them: `positions` (in the prompt's chain of full
    blocks) of the blocks in `data` (`[num_layers, 2, num_kv_heads, len(positions), block_size,
    head_dim]`, None when empty); `num_cached`: the leading full blocks the prefill side held."""

    positions: tuple[int, ...]
    data: Any  # torch.Tensor | None
    num_cached: int
    sent_at: float  # time.time() when read, for the transfer time

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else int(self.data.numel() * self.data.element_size())


@dataclass
class _Reservation:
    hashes: list[BlockHash]
    expires: float  # monotonic time; the reservation is dropped then unless a request is bound
    request_id: str | None = None


class KVTransfer:
    """One engine's side of KV transfer (its core's KV manager and executor)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.kv = core.kv
        cache = core.config.cache
        self.block_size = cache.block_size
        self._chain = block_hashers(cache.prefix_caching_hash_algo)[1]
        self._reservations: dict[str, _Reservation] = {}

    def chain(self, prompt: Sequence[int], salt: str | None) -> list[BlockHash]:
        """The hashes of the prompt's full blocks."""
        return self._chain(prompt, self.block_size, salt, ())

    # -- the prefill side --------------------------------------------------------------------------

    def export(self, prompt: Sequence[int], salt: str | None, positions: Sequence[int] | None) -> KVExport:
        """The cached blocks of `prompt` at `positions` (None: all), among its leading cached ones."""
        found = self.kv.prefix_block_ids(self.chain(prompt, salt))
        wanted = tuple(p for p in (range(len(found)) if positions is None else positions) if p < len(found))
        data = self.core.executor.read_blocks([found[p] for p in wanted]) if wanted else None
        return KVExport(wanted, data, len(found), time.time())

    # -- the decode side ---------------------------------------------------------------------------

    def reserve(self, key: str, prompt: Sequence[int], salt: str | None, ttl: float) -> list[int] | None:
        """Hold blocks for the prompt's full blocks under `key`; the positions whose KV must come
        (the others are cached here), or None when too few blocks are free."""
        self.expire()
        hashes = self.chain(prompt, salt)
        missing = self.kv.reserve_import(key, hashes)
        if missing is not None:
            self._reservations[key] = _Reservation(hashes, time.monotonic() + ttl)
        return missing

    def write(self, key: str, export: KVExport) -> int:
        """Write the arrived blocks into the reservation and publish the leading run whose KV is here
        (cached before, or arrived); the rest stay unpublished (the request recomputes them).
        Returns the blocks published."""
        res = self._reservations.get(key)
        if res is None:
            raise KeyError(f"no KV reservation {key!r} (expired?)")
        ids = self.kv.import_block_ids(key)
        arrived = {p: i for i, p in enumerate(export.positions) if p < len(ids)}
        if arrived:
            order = sorted(arrived)
            index = [arrived[p] for p in order]
            data = export.data if index == list(range(len(export.positions))) else export.data[:, :, :, index]
            self.core.executor.write_blocks([ids[p] for p in order], data)
        upto = 0
        while upto < len(ids) and (upto in arrived or self.kv.pool.lookup(res.hashes[upto]) is not None):
            upto += 1
        self.kv.publish_import(key, res.hashes[:upto])
        return upto

    def bind(self, key: str, request_id: str) -> None:
        """The request these blocks are for was admitted: hold them until it has taken them."""
        res = self._reservations.get(key)
        if res is not None:
            res.request_id = request_id

    def holds(self, key: str) -> bool:
        """Whether the reservation `key` is here (not released nor expired)."""
        return key in self._reservations

    def release(self, key: str) -> bool:
        self._reservations.pop(key, None)
        return self.kv.release_import(key)

    def settle(self, live: Any) -> None:
        """Drop the reservations whose request has taken its blocks or is gone (`live(request_id)`:
        whether it is still in the engine), and the expired unbound ones. Once per engine turn."""
        if not self._reservations:
            return
        for key, res in list(self._reservations.items()):
            rid = res.request_id
            if rid is not None and (self.kv.block_table(rid) or not live(rid)):
                self.release(key)
        self.expire()

    def expire(self) -> None:
        now = time.monotonic()
        for key, res in list(self._reservations.items()):
            if res.request_id is None and now >= res.expires:
                self.release(key)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)
