"""What the fast-forward (fast_forward.py) does to an engine core's parts for many steps at once,
each through the part's public interface: the KV manager's block operations (`step_blocks`,
through `KVCacheManager.take_and_publish`), the waiting queue's service accounting
(`account_decodes`, through `RequestQueue.account` or `FairQueue`'s counters) and whether the
queue's choice can move with service (`peek_is_stable`).

Each is the bulk form of what single steps do; tests/unit/test_kv_manager.py and
tests/unit/test_fast_forward.py compare them with the single-step calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from cadence.kv.manager import KVCacheManager
from cadence.request import Request
from cadence.sched.queue import FairQueue, RequestQueue


def step_blocks(kv: KVCacheManager, requests: Sequence[Request], starts: Sequence[int], widths: Sequence[int],
                events: list[tuple[int, int, int]], cap: tuple[int, int] | None = None) -> bool:
    """The block operations of consecutive steps in which row i of `requests` computes
    `widths[i]` tokens a step from `starts[i]` on (a decode 1, a prompt chunk more; with `cap`,
    (row, start), that row computes at most up to start + j + 1 by step j: a prompt whose last
    chunk is shorter and which then decodes, see fast_forward.py's join): `events` lists
    (step, 0 allocate | 1 publish, row) in the order single steps run them, and each does what
    `allocate_slots(request, width)` before the step (0) and `cache_computed_blocks(request)`
    after it (1) would. Done at once by `KVCacheManager.take_and_publish`, whose False (a
    published hash is cached already) it returns: the caller then makes the calls one by one."""
    bs = kv.block_size
    caching = kv.enable_prefix_caching
    takes: list[int]  # the row of each block taken, in order
    fills: list[tuple[int, int]]  # the row and block index of each block filled, in order
    if max(widths, default=1) == 1:
        # Decodes only: each event is one block, at a block boundary; step j fills block
        # (start + j + 1) // bs - 1 of its row.
        takes = [i for _, kind, i in events if not kind]
        fills = [(i, (starts[i] + j + 1) // bs - 1) for j, kind, i in events if kind] if caching else []
    else:
        takes, fills = [], []
        held = [len(kv.block_tables.get(r.request_id, ())) for r in requests]
        published = [kv.num_published(r.request_id) for r in requests]
        cap_row, cap_start = cap if cap is not None else (-1, 0)
        for j, kind, i in events:
            reach = starts[i] + (j + 1) * widths[i]  # tokens computed once step j has run
            if i == cap_row:
                reach = min(reach, cap_start + j + 1)
            if not kind:
                need = -(-reach // bs) - held[i]
                if need > 0:
                    takes += [i] * need
                    held[i] += need
            elif caching:
                n, full = published[i], reach // bs
                if full > n:
                    fills += [(i, k) for k in range(n, full)]
                    published[i] = full
    return kv.take_and_publish(requests, takes, fills)


def account_decodes(queue: RequestQueue, requests: Sequence[Request], num_steps: int) -> None:
    """Each of `requests` got one output token in each of `num_steps` steps: what that many
    `queue.account(request, 0, 1)` calls, request by request and step by step, do."""
    if not queue.tracks_service:
        return  # `account` is a no-op
    if type(queue) is not FairQueue:
        for _ in range(num_steps):
            for request in requests:
                queue.account(request, 0, 1)
        return
    # A tenant's counter only ever grows by the same amount per output token, so the calls, in
    # whatever order across tenants, come to one run of additions per tenant (`FairQueue.account`
    # adds output_weight / weight for each).
    for tenant, n in Counter(r.tenant for r in requests).items():
        cost = 0 + queue.output_weight * 1
        if not cost:
            continue
        step = cost / queue.weight(tenant)
        counter = queue.counters.get(tenant, 0.0)
        for _ in range(n * num_steps):
            counter += step  # one at a time: the same rounding as one account() per token
        queue.counters[tenant] = counter


def peek_is_stable(queue: RequestQueue) -> bool:
    """Whether the queue's `peek` keeps its answer while requests are only serviced (none added
    or removed): true unless its order follows service (`tracks_service`). Fair share's order
    between tenants follows their counters, so it holds there with one tenant waiting at most."""
    if not queue.tracks_service:
        return True
    return type(queue) is FairQueue and len(queue.tenants) <= 1
