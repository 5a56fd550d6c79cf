"""A fixed pool of KV blocks with reference counts, an LRU free queue and a hash index.

Every block is in exactly one of three states:

- used: `ref_cnt > 0`, held by one or more block tables;
- cached-free: `ref_cnt == 0`, holds a full hashed block, findable by hash, in the free queue;
- free: `ref_cnt == 0`, no hash, in the free queue.

Cached-free blocks count as free: allocation takes the least recently freed block from the head
of the queue and, if it still carried a hash, evicts that hash. A prefix-cache hit on a
cached-free block takes it out of the queue wherever it sits (O(1)), so hot prefixes survive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from itertools import islice

from cadence.kv.hashing import BlockHash


class Block:
    """One block of `block_size` token slots. Mutated by the pool only."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

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
        # block_id -> None, in LRU order (head = evicted first). An OrderedDict gives O(1)
        # removal from the middle, which a prefix hit on a free block needs.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[BlockHash, Block] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (free plus cached-free)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, used or free."""
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._by_hash.get(block_hash)

    def free_rank(self, block_ids: Collection[int], limit: int) -> int:
        """How many blocks allocations take before the first of `block_ids` in the free queue
        (`limit` if none is among the first `limit`)."""
        for rank, block_id in enumerate(islice(self._free, limit)):
            if block_id in block_ids:
                return rank
        return limit

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first = next evicted). For tests and debugging."""
        return list(self._free)

    # --------------------------------------------------------------- mutations
    def allocate(self, n: int) -> list[Block] | None:
        """Take `n` blocks from the head of the free queue (ref 1 each), or None if fewer are free."""
        if n < 0:
            raise ValueError("n: must be >= 0")
        free = self._free
        if n > len(free):
            return None
        blocks, by_hash, pop = self.blocks, self._by_hash, free.popitem
        out: list[Block] = []
        for _ in range(n):
            block = blocks[pop(last=False)[0]]
            if block.block_hash is not None:
                # Reused for other content: it can no longer answer for this hash.
                del by_hash[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def allocate_one(self) -> Block | None:
        """`allocate(1)` without the list: the block, or None if none is free."""
        free = self._free
        if not free:
            return None
        block = self.blocks[free.popitem(last=False)[0]]
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take another reference (a prefix hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; a block reaching zero joins the tail of the free queue.

        Callers pass a request's blocks tail first, so a request's last blocks (the least
        likely to be shared) are evicted before its first ones.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

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
        for block in self.blocks:
            in_queue = block.block_id in self._free
            if block.ref_cnt < 0:
                raise AssertionError(f"negative refcount: {block}")
            if block.ref_cnt == 0:
                if not in_queue:
                    raise AssertionError(f"unreferenced block not in the free queue: {block}")
                if block.block_hash is None:
                    free += 1
                else:
                    cached_free += 1
            else:
                if in_queue:
                    raise AssertionError(f"referenced block in the free queue: {block}")
                used += 1
            if block.block_hash is not None and self._by_hash.get(block.block_hash) is not block:
                raise AssertionError(f"hash index does not point back at {block}")
        if free + cached_free + used != self.num_blocks:
            raise AssertionError(f"free {free} + cached {cached_free} + used {used} != {self.num_blocks}")
        if len(self._free) != free + cached_free:
            raise AssertionError("free queue holds unknown or duplicate block ids")
        for block_hash, block in self._by_hash.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"hash index entry is stale for {block}")
