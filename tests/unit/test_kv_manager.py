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


def _pool_state(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (dict(kv._table_ids), dict(kv._num_cached), {r: tuple(h) for r, h in kv._hashes.items()},
            pool.free_block_ids(), {h: b.block_id for h, b in pool._by_hash.items()}, [b.ref_cnt for b in pool.blocks])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("algo", ["sha256", "builtin"])
@pytest.mark.parametrize("same_leftovers", [True, False])
def test_step_blocks_equal_single_step_calls(seed: int, algo: str, same_leftovers: bool) -> None:
    """The fast-forward's `step_blocks` (through `take_and_publish`) leaves the pool as per-step `allocate_slots(r, 1)` + `cache_computed_blocks(r)`
    would: the same block ids, published hashes (a duplicate stays unhashed), evictions and queue.
    Identical prompts decode side by side (they fill equal blocks in the same step), and the free
    queue holds cached blocks of earlier requests, evicted mid-run: of the same prompts (so with
    the very hashes the run publishes: it declines and changes nothing, the calls go one by one)
    or of others (all at once)."""
    import random

    from cadence.sim.bulk_steps import step_blocks

    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(3, 14))] for _ in range(3)]
    old_prompts = prompts if same_leftovers else [[rng.randrange(50, 99) for _ in range(len(p))] for p in prompts]
    kvs = [KVCacheManager(52, BS, hash_algo=algo) for _ in range(2)]
    reqs: list[list[Request]] = [[], []]
    for k, kv in enumerate(kvs):
        # An earlier request of each prompt decodes 12 tokens and leaves: its blocks sit cached in the queue.
        for p in old_prompts:
            old = make_request(prompt=p, rid=f"old{len(reqs[k])}")
            admit(kv, old)
            for _ in range(12):
                old.output_token_ids.append(7)
                compute(kv, old, 1)
            kv.free(old)
            reqs[k].append(old)
    live = [[make_request(prompt=rng.choice(prompts), rid=f"r{i}") for i in range(5)] for _ in range(2)]
    live[1] = [make_request(prompt=r.prompt_token_ids, rid=r.request_id) for r in live[0]]
    for kv, rs in zip(kvs, live, strict=True):
        for r in rs:
            admit(kv, r)
            r.output_token_ids.append(7)  # the first token sampled at the prompt's last step
    steps = 30
    ref, fast = kvs
    starts = [r.num_computed_tokens for r in live[1]]
    events = []
    queued_hashed = [ref.pool.blocks[b].block_hash is not None for b in ref.pool.free_block_ids()]
    for j in range(steps):  # a step: every row's allocation, then every row's publication
        for i, r in enumerate(live[0]):
            if r.num_computed_tokens == len(ref.block_table(r.request_id)) * BS:
                events.append((j, 0, i))
            assert ref.allocate_slots(r, 1) is not None
        for i, r in enumerate(live[0]):
            r.num_computed_tokens += 1
            if r.num_computed_tokens % BS == 0:
                events.append((j, 1, i))
            ref.cache_computed_blocks(r)
            r.output_token_ids.append(7)
    for r in live[1]:
        r.output_token_ids.extend([7] * steps)
    before = _pool_state(fast)
    if not step_blocks(fast, live[1], starts, [1] * len(starts), events):
        assert same_leftovers
        assert _pool_state(fast)[:2] == before[:2] and _pool_state(fast)[3:] == before[3:]  # (hash memos aside)
        for j, kind, i in events:
            r = live[1][i]
            r.num_computed_tokens = starts[i] + j + kind
            assert fast.cache_computed_blocks(r) is None if kind else fast.allocate_slots(r, 1) is not None
    else:
        assert not same_leftovers
    for r, start in zip(live[1], starts, strict=True):
        r.num_computed_tokens = start + steps
    assert _pool_state(fast) == _pool_state(ref)
    assert sum(kind for _, kind, _ in events) > 10 and len(events) > 30
    num_allocated = sum(1 for _, kind, _ in events if not kind)
    assert any(queued_hashed[:num_allocated])  # allocations evicted cached blocks on the way
    # Equal blocks were published by more than one row: one answers for the hash, the rest stay unhashed.
    hashed = sum(b.block_hash is not None for b in fast.pool.blocks if b.ref_cnt)
    assert hashed < sum(len(fast.block_table(r.request_id)) for r in live[1])
    fast.check_integrity(live[1], published=True)
