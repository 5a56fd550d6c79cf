"""BlockPool and the block hash chain."""

from __future__ import annotations

import pytest

from cadence.config import HASH_ALGOS
from cadence.kv.block_pool import BlockPool
from cadence.kv.hashing import block_hashers, hash_block


def test_allocate_gives_distinct_referenced_blocks_and_none_when_short() -> None:
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert got is not None
    assert len({b.block_id for b in got}) == 3
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1  # a refused allocation changes nothing
    pool.check_integrity()


def test_free_queue_is_lru_with_freed_blocks_at_the_tail() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.free([blocks[2], blocks[0]])
    assert pool.free_block_ids() == [2, 0]
    again = pool.allocate(1)
    assert again is not None and again[0].block_id == 2  # least recently freed goes first
    pool.check_integrity()


def test_cached_block_survives_free_until_reused() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    h = hash_block(None, [1, 2, 3, 4])
    assert pool.cache(a, h)
    pool.free([a])
    assert pool.lookup(h) is a  # cached-free: still findable
    assert pool.num_free_blocks == 1
    pool.check_integrity()
    reused = pool.allocate(1)
    assert reused == [a]
    assert pool.lookup(h) is None  # evicted when allocated for something else
    assert a.block_hash is None
    pool.check_integrity()


def test_touch_takes_a_free_block_out_of_the_middle_of_the_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3) or []
    pool.free(blocks)
    assert pool.free_block_ids() == [0, 1, 2]
    pool.touch([blocks[1]])
    assert pool.free_block_ids() == [0, 2]
    assert blocks[1].ref_cnt == 1
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 2
    pool.check_integrity()


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    h = hash_block(None, [7])
    assert pool.cache(a, h)
    assert not pool.cache(b, h)
    assert b.block_hash is None
    assert pool.lookup(h) is a
    pool.check_integrity()


def test_integrity_check_catches_a_broken_refcount() -> None:
    pool = BlockPool(2)
    a, _ = pool.allocate(2) or []
    a.ref_cnt = 0  # not in the free queue, yet unreferenced
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(1).allocate(-1)


def test_an_unknown_hash_algo_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        block_hashers("md5")


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hash_chain_depends_on_parent_tokens_and_salt(algo: str) -> None:
    hash_block, hash_full_blocks = block_hashers(algo)
    base = hash_block(None, [1, 2])
    assert base == hash_block(None, [1, 2])
    assert base != hash_block(None, [2, 1])
    assert base != hash_block(hash_block(None, [9, 9]), [1, 2])
    assert base != hash_block(None, [1, 2], salt="tenant-a")
    assert hash_block(None, [1, 2], salt="a") != hash_block(None, [1, 2], salt="b")
    assert hash_block(None, [1, 2], salt="") != base  # an empty salt is still a salt


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hash_full_blocks_hashes_only_full_blocks_and_reuses_known(algo: str) -> None:
    hash_block, hash_full_blocks = block_hashers(algo)
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert hash_full_blocks(tokens + [10, 11], 4, known=hashes)[:2] == hashes
    assert len(hash_full_blocks(tokens + [10, 11], 4, known=hashes)) == 3
    with pytest.raises(ValueError):
        hash_full_blocks(tokens[:3], 4, known=hashes)


def test_hit_blocks_leave_stale_entries_that_allocation_skips() -> None:
    """A hit takes a queued block out of the LRU order in place; freed again, it joins the tail.
    Allocation then skips its old entry, and the order stays that of an ordered set."""
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    assert blocks is not None
    for i, b in enumerate(blocks):
        pool.cache(b, hash_block(None, [i]))
    pool.free(blocks)  # queue: 0 1 2 3 4
    pool.touch([blocks[1], blocks[3]])  # hits: 0 2 4
    pool.check_integrity()
    assert pool.free_block_ids() == [0, 2, 4] and pool.num_free_blocks == 3
    assert pool.free_rank({4}, 10) == 2 and pool.free_rank({3}, 10) == 10
    pool.free([blocks[3]])  # 0 2 4 3
    pool.check_integrity()
    assert pool.free_block_ids() == [0, 2, 4, 3]
    got = pool.allocate(3)
    assert got is not None and [b.block_id for b in got] == [0, 2, 4]
    pool.check_integrity()
    assert pool.lookup(hash_block(None, [3])) is blocks[3]  # still cached and findable
    assert pool.lookup(hash_block(None, [0])) is None  # evicted by reuse
    one = pool.allocate_one()
    assert one is blocks[3] and pool.num_free_blocks == 0 and pool.allocate_one() is None
    pool.free([blocks[1]])
    pool.free(got + [one])
    pool.check_integrity()
    assert pool.free_block_ids() == [1, 0, 2, 4, 3]


def test_a_hot_block_hit_and_freed_again_and_again_keeps_the_queue_bounded() -> None:
    pool = BlockPool(4)
    hot = pool.allocate_one()
    assert hot is not None
    pool.cache(hot, hash_block(None, [1]))
    pool.free([hot])
    for _ in range(1000):  # a shared prefix: hit, then freed, with nothing allocated in between
        pool.touch([hot])
        pool.free([hot])
    pool.check_integrity()
    assert len(pool._queue) - pool._head <= 2 * pool.num_blocks + 1
    assert pool.free_block_ids() == [1, 2, 3, 0] and pool.lookup(hash_block(None, [1])) is hot
