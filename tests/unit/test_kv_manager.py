"""KVCacheManager: allocation, prefix caching, eviction order, integrity."""

from __future__ import annotations

import pytest
from fakes import make_request

from cadence.kv.manager import KVBlocks, KVCacheManager
from cadence.request import Request

BS = 4


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """Allocate and 'run' n tokens of `req` as a scheduler would."""
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit with a prefix lookup, run the rest of the prompt; returns the cached tokens."""
    blocks, cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - cached, computed_blocks=blocks) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return cached


def test_allocate_rounds_up_to_blocks_and_grows_the_table() -> None:
    kv = KVCacheManager(8, BS)
    req = make_request(prompt_len=5)
    new = kv.allocate_slots(req, 5)
    assert new is not None and len(new) == 2
    assert kv.block_table(req.request_id) == new.block_ids
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3) == KVBlocks()  # fits in the second block
    more = kv.allocate_slots(req, 4)
    assert more is not None and len(more) == 1
    assert len(kv.block_table(req.request_id)) == 3
    kv.check_integrity([req])


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(3, BS)
    a, b = make_request(prompt_len=8), make_request(prompt_len=8)
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1
    assert kv.block_table(b.request_id) == ()
    kv.check_integrity([a])


def test_prefix_hit_reuses_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    a = make_request(prompt=prompt)
    assert admit(kv, a) == 0
    b = make_request(prompt=prompt)
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 8
    assert blocks.block_ids == kv.block_table(a.request_id)[:2]
    assert kv.allocate_slots(b, 2, computed_blocks=blocks) is not None
    assert kv.block_table(b.request_id)[:2] == kv.block_table(a.request_id)[:2]
    assert kv.pool.blocks[blocks.block_ids[0]].ref_cnt == 2
    b.num_computed_tokens = 8
    kv.check_integrity([a, b])
    stats = kv.pop_prefix_stats()
    assert (stats.queries, stats.hits) == (20, 8)
    assert kv.pop_prefix_stats().queries == 0  # popped


@pytest.mark.parametrize("prompt_len, expected", [(8, 4), (9, 8), (4, 0), (1, 0)])
def test_hit_never_covers_the_last_prompt_token(prompt_len: int, expected: int) -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(100, 100 + prompt_len))
    admit(kv, make_request(prompt=prompt))
    _, cached = kv.get_computed_blocks(make_request(prompt=prompt))
    assert cached == expected
    assert cached <= prompt_len - 1


def test_freed_blocks_stay_findable_and_are_reclaimed_on_hit() -> None:
    kv = KVCacheManager(4, BS)
    prompt = list(range(1, 10))
    a = make_request(prompt=prompt)
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request(prompt=prompt)
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 8
    assert kv.allocate_slots(b, 1, computed_blocks=blocks) is not None
    assert kv.num_free_blocks == 1  # two reclaimed from the free queue + one new
    b.num_computed_tokens = 8
    kv.check_integrity([b])


def test_hit_on_free_blocks_counts_them_against_room() -> None:
    kv = KVCacheManager(3, BS)
    prompt = list(range(1, 10))
    a = make_request(prompt=prompt)
    admit(kv, a)
    kv.free(a)
    filler = make_request(prompt_len=4)
    assert kv.allocate_slots(filler, 4) is not None  # evicts a's last (third) block
    b = make_request(prompt=prompt + [50, 51, 52, 53])
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 8
    # Needs both hit blocks out of the free queue plus 2 new ones: 4 > 2 free.
    assert kv.allocate_slots(b, 5, computed_blocks=blocks) is None
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in blocks.block_ids)  # untouched
    kv.check_integrity([filler])


def test_eviction_order_is_least_recently_freed_and_tail_blocks_first() -> None:
    kv = KVCacheManager(6, BS)
    first = make_request(prompt=list(range(1, 10)))  # 3 blocks, 2 full
    second = make_request(prompt=list(range(20, 29)))
    admit(kv, first)
    admit(kv, second)
    kv.free(first)
    kv.free(second)
    # Requests free tail first: the queue is first's blocks 2,1,0 then second's 5,4,3.
    assert kv.pool.free_block_ids() == [2, 1, 0, 5, 4, 3]
    filler = make_request(prompt_len=4)
    assert kv.allocate_slots(filler, 8) is not None  # evicts first's two last blocks
    assert kv.get_computed_blocks(make_request(prompt=list(range(1, 10))))[1] == 4  # head block survived
    assert kv.get_computed_blocks(make_request(prompt=list(range(20, 29))))[1] == 8  # untouched
    kv.check_integrity([filler])


def test_a_hit_refreshes_recency() -> None:
    kv = KVCacheManager(4, BS)
    old = make_request(prompt=list(range(1, 6)))  # 2 blocks, 1 full
    new = make_request(prompt=list(range(40, 45)))
    admit(kv, old)
    admit(kv, new)
    kv.free(old)
    kv.free(new)
    again = make_request(prompt=list(range(1, 6)))
    assert admit(kv, again) == 4  # old's prefix is used again ...
    kv.free(again)  # ... and freed last, so `new`'s blocks go first now
    filler = make_request(prompt_len=8)
    assert kv.allocate_slots(filler, 8) is not None
    assert kv.get_computed_blocks(make_request(prompt=list(range(1, 6))))[1] == 4
    assert kv.get_computed_blocks(make_request(prompt=list(range(40, 45))))[1] == 0


def test_salt_isolates_tenants() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(1, 10))
    admit(kv, make_request(prompt=prompt, cache_salt="a"))
    assert kv.get_computed_blocks(make_request(prompt=prompt, cache_salt="b"))[1] == 0
    assert kv.get_computed_blocks(make_request(prompt=prompt, cache_salt="a"))[1] == 8
    assert kv.get_computed_blocks(make_request(prompt=prompt))[1] == 0


def test_output_blocks_are_cached_as_they_fill() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request(prompt=[1, 2, 3])
    compute(kv, a, 3)
    for tok in (4, 5, 6):  # decode: the sampled token is computed on the next step
        a.output_token_ids.append(tok)
        compute(kv, a, 1)
    assert kv.pool.num_cached_blocks == 1
    follow_up = make_request(prompt=[1, 2, 3, 4, 5, 6, 7])  # a multi-turn continuation
    assert kv.get_computed_blocks(follow_up)[1] == 4


def test_disabled_prefix_caching_finds_nothing() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(1, 10))
    admit(kv, make_request(prompt=prompt))
    assert kv.get_computed_blocks(make_request(prompt=prompt)) == (KVBlocks(), 0)
    assert kv.pool.num_cached_blocks == 0


def test_integrity_catches_tables_that_disagree_with_running() -> None:
    kv = KVCacheManager(8, BS)
    a, b = make_request(prompt_len=4), make_request(prompt_len=4)
    compute(kv, a, 4)
    kv.check_integrity([a])
    with pytest.raises(AssertionError):
        kv.check_integrity([a, b])  # b holds no table
    with pytest.raises(AssertionError):
        kv.check_integrity([])  # a holds one but is not running
    kv.pool.blocks[kv.block_table(a.request_id)[0]].ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_integrity([a])


def test_free_is_idempotent_and_usage_tracks_blocks() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request(prompt_len=8)
    compute(kv, a, 8)
    assert kv.usage == pytest.approx(0.5)
    kv.free(a)
    kv.free(a)
    assert kv.usage == 0.0
    kv.check_integrity([])
    with pytest.raises(ValueError):
        kv.allocate_slots(a, -1)
