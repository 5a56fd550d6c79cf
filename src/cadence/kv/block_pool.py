"""A fixed pool of KV blocks with reference counts, an LRU free queue and a hash index.

Every block is in exactly one of three states:

- used: `ref_cnt > 0`, held by one or more block tables;
- cached-free: `ref_cnt == 0`, holds a full hashed block, findable by hash, in the free queue;
- free: `ref_cnt == 0`, no hash, in the free queue.

Cached-free blocks count as free: allocation takes the least recently freed block from the head
of the queue and, if it still carried a hash, evicts that hash. A prefix-cache hit on a
cached-free block takes it out of the queue wherever it sits (O(1)), so hot prefixes survive.

The queue is a list read from a moving head, not a linked structure: allocation takes a slice,
freeing appends. A hit on a queued block leaves its entry in place, stale: each block counts its
entries (`queued`), and an entry is live only if it is the block's last one and the block is
unreferenced. While no entry is stale, allocation takes its slice without looking. (The simulator
runs a pool per replica, and an ordered dict's nodes and hash table cost it a cache miss per block:
the list is a third faster there.)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from itertools import islice

from cadence.kv.hashing import BlockHash


class Block:
    """One block of `block_size` token slots. Mutated by the pool only."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "queued")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.queued = 1  # its entries in the pool's free queue (all but the last are stale)

    def __repr__(self) -> str:
        h = self.block_hash
        if h is None:
            cached = ""
        else:  # the first 4 bytes of a digest, the low 32 bits of a builtin hash
            cached = f", hash={h[:4].hex() if isinstance(h, bytes) else format(h & 0xFFFFFFFF, '08x')}"
        return f"Block({self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    """`num_blocks` blocks; free ones queued least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The free queue: live entries from `_head` on, in LRU order (first = evicted first).
        self._queue: list[Block] = list(self.blocks)
        self._head = 0
        self._num_free = num_blocks
        self._num_stale = 0  # entries of blocks taken by a hit, or queued again since
        self._by_hash: dict[BlockHash, Block] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (free plus cached-free)."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, used or free."""
        return len(self._by_hash)

    def count_cached_free_blocks(self) -> int:
        """Free blocks still findable by hash (a prefix hit would take them back before they are
        reused). Walks the hash index: for an occasional read, not for every step."""
        return sum(1 for block in self._by_hash.values() if block.ref_cnt == 0)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._by_hash.get(block_hash)

    def recent_hashes(self, limit: int) -> list[BlockHash]:
        """Up to `limit` hashes of cached blocks (used or free), the most recently cached first: what
        a replica tells a fleet's router it holds."""
        return list(islice(reversed(self._by_hash), limit))

    def holds_any(self, hashes: Iterable[BlockHash]) -> bool:
        """Whether any of `hashes` is cached (in a used or a free block)."""
        return not self._by_hash.keys().isdisjoint(hashes)

    def _live_queue(self, limit: int | None = None) -> list[Block]:
        """The free queue's live entries in order (the first `limit` of them)."""
        if not self._num_stale:
            entries = self._queue[self._head :]
            return entries if limit is None else entries[:limit]
        later: dict[int, int] = {}  # entries of each block seen so far, from the tail
        live: list[Block] = []
        for block in reversed(self._queue[self._head :]):
            n = later.get(block.block_id, 0)
            later[block.block_id] = n + 1
            if n == 0 and block.ref_cnt == 0:
                live.append(block)
        live.reverse()
        return live if limit is None else live[:limit]

    def free_rank(self, block_ids: Collection[int], limit: int) -> int:
        """How many blocks allocations take before the first of `block_ids` in the free queue
        (`limit` if none is among the first `limit`)."""
        for rank, block in enumerate(self._live_queue(limit)):
            if block.block_id in block_ids:
                return rank
        return limit

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first = next evicted). For tests and debugging."""
        return [b.block_id for b in self._live_queue()]

    # --------------------------------------------------------------- mutations
    def allocate(self, n: int) -> list[Block] | None:
        """Take `n` blocks from the head of the free queue (ref 1 each), or None if fewer are free."""
        if n < 0:
            raise ValueError("n: must be >= 0")
        if n > self._num_free:
            return None
        queue, head, by_hash = self._queue, self._head, self._by_hash
        if not self._num_stale:  # every entry is live: the next n are the blocks
            out = queue[head : head + n]
            head += n
            for block in out:
                block.queued = 0
                if block.block_hash is not None:
                    # Reused for other content: it can no longer answer for this hash.
                    del by_hash[block.block_hash]
                    block.block_hash = None
                block.ref_cnt = 1
        else:
            out = []
            while len(out) < n:
                block = queue[head]
                head += 1
                block.queued -= 1
                if block.queued or block.ref_cnt:  # a later entry is its live one, or it is in use
                    self._num_stale -= 1
                    continue
                if block.block_hash is not None:
                    del by_hash[block.block_hash]
                    block.block_hash = None
                block.ref_cnt = 1
                out.append(block)
        self._num_free -= n
        self._head = head
        if head > 1024 and 2 * head > len(queue):  # drop the consumed front, amortised O(1)
            del queue[:head]
            self._head = 0
        return out

    def allocate_one(self) -> Block | None:
        """`allocate(1)` without the list: the block, or None if none is free."""
        if not self._num_free:
            return None
        if self._num_stale:
            blocks = self.allocate(1)
            return blocks[0] if blocks else None  # (one is free: checked above)
        block = self._queue[self._head]
        self._head += 1
        self._num_free -= 1
        block.queued = 0
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take another reference (a prefix hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:  # its queue entry goes stale
                self._num_free -= 1
                self._num_stale += 1
            block.ref_cnt += 1
        if self._num_stale > self.num_blocks:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the queue from its live entries. A hot prefix's blocks, hit and freed again and
        again, would otherwise leave a stale entry per hit wherever allocation is rare."""
        live = self._live_queue()
        for block in self.blocks:
            block.queued = 0
        for block in live:
            block.queued = 1
        self._queue, self._head, self._num_stale = live, 0, 0

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; a block reaching zero joins the tail of the free queue.

        Callers pass a request's blocks tail first, so a request's last blocks (the least
        likely to be shared) are evicted before its first ones.
        """
        append = self._queue.append
        n = 0
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.queued += 1  # (an entry left from before a hit was counted stale by `touch`)
                append(block)
                n += 1
        self._num_free += n

    def cache(self, block: Block, block_hash: BlockHash) -> bool:
        """Make a full block findable by `block_hash`. False if another block already answers for it
        (two requests computed the same prefix at once): this one then stays unhashed."""
        assert block.ref_cnt > 0, "only a block in use can be cached"
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        return True

    def cache_blocks(self, blocks: Iterable[Block], hashes: Iterable[BlockHash]) -> None:
        """`cache` each block with its hash, in order (a request's newly filled blocks)."""
        by_hash = self._by_hash
        for block, block_hash in zip(blocks, hashes, strict=True):
            assert block.ref_cnt > 0, "only a block in use can be cached"
            if block.block_hash is None and block_hash not in by_hash:
                block.block_hash = block_hash
                by_hash[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after new weights are loaded); blocks in use are unaffected."""
        for block in self._by_hash.values():
            block.block_hash = None
        self._by_hash.clear()

    # ---------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """Raise AssertionError if free + cached-free + used != total or the indexes disagree."""
        free = cached_free = used = 0
        entries: dict[int, int] = {}
        for block in self._queue[self._head :]:
            entries[block.block_id] = entries.get(block.block_id, 0) + 1
        live = {b.block_id for b in self._live_queue()}
        for block in self.blocks:
            if block.queued != entries.get(block.block_id, 0):
                raise AssertionError(f"{block}: counts {block.queued} queue entries, the queue holds "
                                     f"{entries.get(block.block_id, 0)}")
            if block.ref_cnt < 0:
                raise AssertionError(f"negative refcount: {block}")
            if block.ref_cnt == 0:
                if block.block_id not in live:
                    raise AssertionError(f"unreferenced block not in the free queue: {block}")
                if block.block_hash is None:
                    free += 1
                else:
                    cached_free += 1
            else:
                if block.block_id in live:
                    raise AssertionError(f"referenced block in the free queue: {block}")
                used += 1
            if block.block_hash is not None and self._by_hash.get(block.block_hash) is not block:
                raise AssertionError(f"hash index does not point back at {block}")
        if free + cached_free + used != self.num_blocks:
            raise AssertionError(f"free {free} + cached {cached_free} + used {used} != {self.num_blocks}")
        if self._num_free != free + cached_free:
            raise AssertionError(f"free count {self._num_free} != {free + cached_free} free blocks")
        if self._num_stale != len(self._queue) - self._head - len(live):
            raise AssertionError(f"stale count {self._num_stale} != {len(self._queue) - self._head - len(live)}")
        for block_hash, block in self._by_hash.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"hash index entry is stale for {block}")
