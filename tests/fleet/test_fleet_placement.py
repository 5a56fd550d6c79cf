"""Placement on a least-loaded fleet of two one-seat replicas: a burst spreads by load, and a
replica's full-queue refusal is tried on the other replica before the client sees a 429
(tests/unit/test_fleet_admission.py: the 429 once every replica refused)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fleet_helpers import Fleet, running_fleet

pytestmark = pytest.mark.slow

# One request runs on each replica at a time; up to 24 wait, holding at most 400 prompt tokens.
ENGINE = {"max_num_seqs": 1, "max_queue_len": 24, "max_queued_tokens": 400, "max_model_len": 2048,
          "num_kv_blocks": 512}
BIG_PROMPT = [7] * 280  # one fits in a replica's waiting queue, two do not
LONG_PER_REPLICA = 10  # long requests queued on each replica first: its seat stays taken for the test


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with running_fleet("least-loaded", engine_options=ENGINE) as f:
        yield f


def _body(prompt: object, max_tokens: int) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0, "stream": True}


async def _open(c: httpx.AsyncClient, prompt: object, max_tokens: int) -> httpx.Response:
    """A streamed completion, its headers read (the replica admitted or refused it) and its body not."""
    return await c.send(c.build_request("POST", "/v1/completions", json=_body(prompt, max_tokens)), stream=True)


@contextlib.asynccontextmanager
async def _client(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30, limits=httpx.Limits(max_connections=None)) as c:
        yield c


def test_a_burst_on_a_fresh_fleet_spreads_evenly(fleet: Fleet) -> None:
    async def burst() -> list[httpx.Response]:
        async with _client(fleet) as c:
            opened = await asyncio.gather(*(_open(c, f"burst {i}", 48) for i in range(8)))
            for r in opened:
                await r.aread()
            return list(opened)

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    placed = Counter(r.headers["x-cadence-replica"] for r in responses)
    assert len(placed) == 2 and max(placed.values()) - min(placed.values()) <= 1, placed


def test_a_full_replicas_refusal_is_served_by_the_other(fleet: Fleet) -> None:
    async def scenario() -> None:
        async with _client(fleet) as c:
            held: list[httpx.Response] = []
            try:
                # Long requests on each replica: everything after them waits there.
                for i in range(2 * LONG_PER_REPLICA):
                    held.append(await _open(c, f"long {i}", 2000))
                assert [r.status_code for r in held] == [200] * 2 * LONG_PER_REPLICA
                assert len({r.headers["x-cadence-replica"] for r in held}) == 2
                big = await _open(c, BIG_PROMPT, 4)  # fills one replica's queue (in tokens)
                held.append(big)
                full = big.headers["x-cadence-replica"]
                # Short requests until the other replica holds more: least-loaded then picks `full`.
                per: Counter[str] = Counter(r.headers["x-cadence-replica"] for r in held)
                while per[full] >= sum(per.values()) - per[full]:
                    r = await _open(c, "short", 4)
                    assert r.status_code == 200, await r.aread()
                    held.append(r)
                    per[r.headers["x-cadence-replica"]] += 1
                # Refused by `full` (its waiting prompts would exceed 400 tokens), served by the other.
                moved = await _open(c, BIG_PROMPT, 4)
                held.append(moved)
                assert moved.status_code == 200, await moved.aread()
                assert moved.headers["x-cadence-replica"] != full, per
            finally:
                for r in held:
                    await r.aclose()

    asyncio.run(scenario())
