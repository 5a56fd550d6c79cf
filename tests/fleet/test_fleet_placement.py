"""Placement on a fresh least-loaded fleet: a burst spreads by load. (The retry of a replica's
full-queue refusal on another replica: tests/unit/test_fleet_admission.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fleet_helpers import Fleet, running_fleet

pytestmark = pytest.mark.slow

# One request runs on each replica at a time; the rest of a burst waits (room for all of it).
ENGINE = {"max_num_seqs": 1, "max_queue_len": 24, "max_queued_tokens": 400, "max_model_len": 2048,
          "num_kv_blocks": 512}


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
