"""KV cache manager: per-request block tables over a `BlockPool`, with automatic prefix caching.

Contract with the scheduler:

- `get_computed_blocks(request)` finds the longest cached prefix of a request not yet holding
  blocks. It never covers the request's last known token (its logits are needed), and it
  changes nothing: the hit is only taken by the `allocate_slots` that follows.
- `allocate_slots(request, n, computed_blocks=...)` makes room for `n` more tokens after
  `request.num_computed_tokens` (plus the computed blocks, at admission). It returns the newly
  allocated blocks, or None with nothing changed when the pool is short.
- `cache_computed_blocks(request)` is called once a step has written KV: every block that is
  now full is hashed and made findable. Caching after execution (not at allocation) means a
  hit never points at a block whose KV has not been written yet.
- `free(request)` drops the request's table; its full blocks stay findable until reused.

This module logs nothing; the engine logs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

from cadence.kv.block_pool import Block, BlockPool
from cadence.kv.hashing import BlockHash, block_hashers
from cadence.request import Request


@dataclass(frozen=True)
class KVBlocks:
    """A run of blocks handed across the manager's boundary, by id."""

    block_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache at admission, and how many were found."""

    queries: int = 0
    hits: int = 0


_EMPTY = KVBlocks()
_block_id = attrgetter("block_id")  # tuple(map(...)) is a C loop; a generator costs more than the ids


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256") -> None:
        if block_size < 1:
            raise ValueError("block_size: must be >= 1")
        self._hash_block, self._hash_full_blocks = block_hashers(hash_algo)
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[Block]] = {}
        # The same tables by id, as the executor gets them: extended (not rebuilt) when a table grows,
        # so the per-request, per-step lookup costs no work proportional to the context.
        self._table_ids: dict[str, tuple[int, ...]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # full-block hash chain per request
        self._num_cached: dict[str, int] = {}  # leading blocks of the table already hashed
        self._queries = 0
        self._hits = 0
        # Blocks held for KV arriving from another engine (see `reserve_import`), by reservation key.
        self._imports: dict[str, list[Block]] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def count_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (see `BlockPool.count_cached_free_blocks`)."""
        return self.pool.count_cached_free_blocks()

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-free blocks count as free)."""
        return self.pool.usage

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return self._table_ids.get(request_id, ())

    @property
    def block_tables(self) -> Mapping[str, tuple[int, ...]]:
        """Every request's block-id table (read only; kept up to date in place). For per-step
        loops: `block_tables.get` costs less than a `block_table` call."""
        return self._table_ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_hashes(self, limit: int) -> list[BlockHash]:
        """Up to `limit` hashes of the prefix blocks it can serve from cache, the most recently cached
        first (a fleet router's view of this cache)."""
        return self.pool.recent_hashes(limit)

    def pop_prefix_stats(self) -> PrefixCacheStats:
        """Counts since the previous call (the scheduler folds them into each step's stats)."""
        out = PrefixCacheStats(self._queries, self._hits)
        self._queries = self._hits = 0
        return out

    # ------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[KVBlocks, int]:
        """The cached blocks matching the request's prefix, and the tokens they cover."""
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return _EMPTY, 0
        hashes = self._request_hashes(request)
        # Cap at (num_tokens - 1) rounded down: the last token must be computed for its logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block.block_id)
        return KVBlocks(tuple(found)), len(found) * self.block_size

    def _request_hashes(self, request: Request) -> list[BlockHash]:
        rid = request.request_id
        known = self._hashes.get(rid, [])
        if len(known) < request.num_tokens // self.block_size:
            # (A request with no outputs yet, the usual case, hashes its prompt list without a copy.)
            tokens = request.all_token_ids if request.output_token_ids else request.prompt_token_ids
            known = self._hash_full_blocks(tokens, self.block_size, request.cache_salt, known)
            self._hashes[rid] = known
        return known

    # -------------------------------------------------------------- allocation
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: KVBlocks = _EMPTY
    ) -> KVBlocks | None:
        """Room for `num_new_tokens` after the computed ones; None (nothing changed) if short."""
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens: must be >= 0")
        rid = request.request_id
        table = self._tables.get(rid)
        if table is not None and computed_blocks is _EMPTY:
            # Fast path, once per running request per step: the table already has room.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(table) * self.block_size:
                return _EMPTY
            # A table growing without a prefix hit (a decode entering a block, a prompt's next
            # chunk): the general path below, with the terms that are zero here left out.
            if num_tokens <= (len(table) + 1) * self.block_size:  # one block: most often a decode
                block = self.pool.allocate_one()
                if block is None:
                    return None
                table.append(block)
                new_ids = (block.block_id,)
                self._table_ids[rid] = self._table_ids.get(rid, ()) + new_ids
                return KVBlocks(new_ids)
            new_blocks = self.pool.allocate(self.num_blocks_needed(num_tokens) - len(table))
            if new_blocks is None:
                return None
            table.extend(new_blocks)
            new_ids = tuple(map(_block_id, new_blocks))
            self._table_ids[rid] = self._table_ids.get(rid, ()) + new_ids
            return KVBlocks(new_ids)
        if computed_blocks and table:
            raise ValueError("computed_blocks: only a request without blocks can take a prefix hit")
        hit = [self.pool.blocks[i] for i in computed_blocks.block_ids]
        num_new_blocks, num_reclaimed = self._blocks_to_take(request, num_new_tokens, hit, table)
        if num_new_blocks + num_reclaimed > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._tables[rid] = []
            self._num_cached[rid] = 0
            if self.enable_prefix_caching:
                self._queries += request.num_tokens
                self._hits += len(hit) * self.block_size
        if hit:
            self.pool.touch(hit)
            table.extend(hit)
            self._num_cached[rid] = len(hit)
        new_blocks = self.pool.allocate(num_new_blocks)
        assert new_blocks is not None, "free count checked above"
        new_ids = tuple(map(_block_id, new_blocks))
        if new_blocks or hit:
            table.extend(new_blocks)
            self._table_ids[rid] = self._table_ids.get(rid, ()) + computed_blocks.block_ids + new_ids
        return KVBlocks(new_ids) if new_blocks else _EMPTY

    def blocks_to_take(self, request: Request, num_new_tokens: int, computed_blocks: KVBlocks = _EMPTY) -> int:
        """Free-queue blocks `allocate_slots` with these arguments would take (it fails when fewer are free)."""
        hit = [self.pool.blocks[i] for i in computed_blocks.block_ids]
        return sum(self._blocks_to_take(request, num_new_tokens, hit, self._tables.get(request.request_id)))

    def _blocks_to_take(self, request: Request, num_new_tokens: int, hit: list[Block],
                        table: list[Block] | None) -> tuple[int, int]:
        """New blocks, and hit blocks reclaimed from the free queue, that an allocation needs."""
        held = len(table) if table else 0
        num_computed = request.num_computed_tokens + len(hit) * self.block_size
        num_new_blocks = max(0, self.num_blocks_needed(num_computed + num_new_tokens) - held - len(hit))
        # Hit blocks sitting in the free queue leave it, so they compete with new ones for room.
        num_reclaimed = sum(1 for b in hit if b.ref_cnt == 0)
        return num_new_blocks, num_reclaimed

    def cache_computed_blocks(self, request: Request) -> None:
        """Hash and publish every block that `request.num_computed_tokens` has filled."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_cached.get(rid)
        # Called per request per step: most steps fill no block, so test that first.
        if start is None or request.num_computed_tokens // self.block_size <= start:
            return
        table = self._tables[rid]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        hashes = self._hashes.setdefault(rid, [])
        if num_full == start + 1 == len(hashes) + 1:  # one block just filled (a decode, most often)
            bs = self.block_size
            block_hash = self._hash_block(hashes[-1] if hashes else None,
                                         request.token_ids_slice(start * bs, num_full * bs), request.cache_salt)
            hashes.append(block_hash)
            self.pool.cache(table[start], block_hash)
            self._num_cached[rid] = num_full
            return
        self._extend_chain(request, hashes, num_full)
        # A duplicate (the same prefix computed twice at once) stays unhashed: harmless.
        self.pool.cache_blocks(table[start:num_full], hashes[start:num_full])
        self._num_cached[rid] = num_full

    def release_tail(self, request: Request) -> int:
        """Give back the blocks past `request.num_computed_tokens` (slots allocated for tokens that
        were not kept: rejected speculative drafts); returns how many. Those blocks hold no
        kept token, so none is published."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return 0
        keep = self.num_blocks_needed(request.num_computed_tokens)
        if len(table) <= keep:
            return 0
        assert self._num_cached.get(rid, 0) <= keep, f"{rid}: a published block past its computed tokens"
        tail = table[keep:]
        del table[keep:]
        self._table_ids[rid] = self._table_ids[rid][:keep]
        self.pool.free(reversed(tail))
        return len(tail)

    def num_published(self, request_id: str) -> int:
        """How many of the request's blocks are published (hashed and findable); 0 if it holds none."""
        return self._num_cached.get(request_id, 0)

    def take_and_publish(self, requests: Sequence[Request], takes: Sequence[int],
                         fills: Sequence[tuple[int, int]]) -> bool:
        """Several steps' block operations at once, for a caller that knows them ahead: `takes`
        lists the request (its index in `requests`) of each new block, in the order the
        `allocate_slots` calls would take them; `fills` lists each (request, block index) that
        becomes full, in the order `cache_computed_blocks` would publish them (each request's
        blocks in increasing order, none before it is taken). Done as one `allocate` of every
        block, handed out in that order, then one publication of every filled block; each
        table's id tuple is extended once. Reads the requests' tokens, not their
        `num_computed_tokens` (the caller sets those).

        That is the outcome of the interleaved calls unless a block it publishes has the hash of
        a cached block that one of its allocations evicts later (published first, it would stay
        unhashed as a duplicate). So where any hash it would publish is cached already, it
        returns False having changed nothing (but for extending the requests' hash memos): the
        caller then makes the calls one by one.

        Its one caller is the simulator's fast-forward (sim/bulk_steps.py). It stays here because
        it changes the block tables, the hash chains and the pool together, whose agreement is
        this class's to keep (`check_integrity`)."""
        tables = [self._tables[r.request_id] for r in requests]
        caching = self.enable_prefix_caching and bool(fills)
        if fills and not self.enable_prefix_caching:
            raise ValueError("fills: prefix caching is off, nothing is published")
        first = [self._num_cached[r.request_id] for r in requests] if caching else []
        published = list(first)
        for i, n in fills:
            published[i] = n + 1
        chains = self._extend_hashes(requests, first, published) if caching else []
        fill_hashes = [chains[i][n] for i, n in fills]
        if fill_hashes and self.pool.holds_any(fill_hashes):
            return False
        blocks = self.pool.allocate(len(takes))
        if blocks is None:
            raise AssertionError("the steps ran out of blocks")
        new_ids: list[list[int]] = [[] for _ in requests]
        for i, block in zip(takes, blocks, strict=True):
            tables[i].append(block)
            new_ids[i].append(block.block_id)
        if fills:
            self.pool.cache_blocks([tables[i][n] for i, n in fills], fill_hashes)
        for k, req in enumerate(requests):
            rid = req.request_id
            if new_ids[k]:
                self._table_ids[rid] += tuple(new_ids[k])
            if caching:
                self._num_cached[rid] = published[k]
        return True

    def _extend_hashes(self, requests: Sequence[Request], first: list[int], upto: list[int]) -> list[list[BlockHash]]:
        """Each request's hash chain, extended to cover its blocks below `upto` (from its first
        unhashed one; `first`: its published blocks, which are hashed)."""
        chains = []
        for req, n0, n1 in zip(requests, first, upto, strict=True):
            hashes = self._hashes.setdefault(req.request_id, [])
            assert len(hashes) >= n0, "published blocks are hashed"
            self._extend_chain(req, hashes, n1)
            chains.append(hashes)
        return chains

    def _extend_chain(self, request: Request, hashes: list[BlockHash], upto: int) -> None:
        """Hash `request`'s blocks from `len(hashes)` to `upto` onto its chain `hashes`, reading only
        their tokens (a decode fills a block every `block_size` steps: copying the whole context
        each time would be quadratic)."""
        have = len(hashes)
        if have >= upto:
            return
        bs, hash_block, salt = self.block_size, self._hash_block, request.cache_salt
        tokens = request.token_ids_slice(have * bs, upto * bs)  # one copy for all the new blocks
        parent = hashes[-1] if hashes else None
        for k in range(0, len(tokens), bs):
            parent = hash_block(parent, tokens[k : k + bs], salt)
            hashes.append(parent)

    def free(self, request: Request, *, keep_hashes: bool = False) -> None:
        """Release the request's blocks, tail first. Safe to call for a request holding none.

        `keep_hashes` keeps the request's block hashes (a preempted request comes back with the
        same tokens and more: its next prefix lookup would otherwise hash its whole context again)."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._table_ids.pop(rid, None)
        self._num_cached.pop(rid, None)
        if not keep_hashes:
            self._hashes.pop(rid, None)
        if table:
            self.pool.free(reversed(table))

    # ------------------------------------------------------- blocks from another engine
    def prefix_block_ids(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks caching the longest prefix of `hashes` (a chain), by id."""
        found = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block.block_id)
        return found

    def reserve_import(self, key: str, hashes: Sequence[BlockHash]) -> list[int] | None:
        """Hold a block for each hash of the chain `hashes` under `key`: the cached ones (their KV is
        here already) and a newly allocated one for each other, which the caller fills and then
        publishes (`publish_import`). Returns the positions in `hashes` that need filling, or None
        (nothing changed) when too few blocks are free. Held blocks count as used until
        `release_import`, so arriving KV never overruns the cache and is not evicted before the
        request it is for takes it as a prefix hit."""
        if key in self._imports:
            raise ValueError(f"reservation {key!r} exists")
        cached = [self.pool.lookup(h) for h in hashes]
        missing = [i for i, b in enumerate(cached) if b is None]
        reclaimed = sum(1 for b in cached if b is not None and b.ref_cnt == 0)
        if len(missing) + reclaimed > self.pool.num_free_blocks:
            return None
        held = [b for b in cached if b is not None]
        self.pool.touch(held)  # (before allocating: an allocation could evict them)
        new = self.pool.allocate(len(missing))
        assert new is not None, "free count checked above"
        blocks: list[Block] = []
        fresh = iter(new)
        for b in cached:
            blocks.append(b if b is not None else next(fresh))
        self._imports[key] = blocks
        return missing

    def import_block_ids(self, key: str) -> tuple[int, ...]:
        """The blocks reserved under `key`, in chain order."""
        return tuple(b.block_id for b in self._imports.get(key, ()))

    def publish_import(self, key: str, hashes: Sequence[BlockHash]) -> None:
        """Make the reservation's first `len(hashes)` blocks findable by these hashes (their KV has
        been written)."""
        if self.enable_prefix_caching:
            self.pool.cache_blocks(self._imports[key][: len(hashes)], hashes)

    def release_import(self, key: str) -> bool:
        """Drop the reservation's hold (its published blocks stay cached); False if there is none."""
        blocks = self._imports.pop(key, None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    @property
    def num_import_blocks(self) -> int:
        """Blocks held by reservations for arriving KV."""
        return sum(len(b) for b in self._imports.values())

    # ---------------------------------------------------------------- checking
    def check_integrity(
        self, running_requests: list[Request] | tuple[Request, ...] = (), *, published: bool = False
    ) -> None:
        """Raise AssertionError unless the pool is consistent and refcounts equal table membership.

        `running_requests` are the requests that should hold tables; each must hold one that
        covers its computed tokens, and no other request may hold blocks. With `published` (true
        between scheduler steps), every block their computed tokens fill must also have been
        through `cache_computed_blocks`: the scheduler calls it only on steps that fill a block.
        """
        self.pool.check_integrity()
        expected = [0] * self.pool.num_blocks
        for block in (b for held in self._imports.values() for b in held):
            expected[block.block_id] += 1
        for rid, table in self._tables.items():
            for block in table:
                expected[block.block_id] += 1
            if len({b.block_id for b in table}) != len(table):
                raise AssertionError(f"{rid}: a block appears twice in one table")
        for block in self.pool.blocks:
            if block.ref_cnt != expected[block.block_id]:
                raise AssertionError(f"{block}: refcount {block.ref_cnt} != {expected[block.block_id]} tables")
        running_ids = {r.request_id for r in running_requests}
        if running_ids != set(self._tables):
            raise AssertionError(
                f"tables held by {sorted(set(self._tables) - running_ids)}, "
                f"missing for {sorted(running_ids - set(self._tables))}"
            )
        for req in running_requests:
            rid = req.request_id
            table = self._tables[rid]
            if len(table) * self.block_size < req.num_computed_tokens:
                raise AssertionError(f"{rid}: table too short for its computed tokens")
            if self._table_ids.get(rid, ()) != tuple(b.block_id for b in table):
                raise AssertionError(f"{rid}: block-id table out of step with its blocks")
            full = min(req.num_computed_tokens // self.block_size, len(table))
            if published and self.enable_prefix_caching and self._num_cached[rid] != full:
                raise AssertionError(f"{rid}: {full} full blocks but {self._num_cached[rid]} published")
