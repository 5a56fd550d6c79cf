"""A replica sends the deltas of a request that are ready at once as one stream item (`Deltas`),
and the ingress's `FleetStream` gives them back one by one, in order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")  # (the fleet's extra: `make serve` / `make test` install it)

from cadence.config import EngineConfig  # noqa: E402
from cadence.engine.output_processor import StreamDelta  # noqa: E402
from cadence.errors import CadenceError, ErrorKind  # noqa: E402
from cadence.fleet.client import FleetStream  # noqa: E402
from cadence.fleet.protocol import Admitted, Deltas, Failed, GenerateCall, deltas_of  # noqa: E402
from cadence.fleet.replica import CadenceReplica  # noqa: E402
from cadence.request import SamplingParams  # noqa: E402

TINY = {"num_kv_blocks": 128, "max_model_len": 256, "device": "cpu", "dtype": "float32", "num_threads": 1,
        "max_num_seqs": 8}


class _Gen:
    """A replica's stream as the ingress's handle gives it."""

    def __init__(self, items: list[Any]) -> None:
        self._items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


def _delta(rid: str, tokens: list[int], finished: bool = False) -> StreamDelta:
    return StreamDelta(rid, "".join(f"<{t}>" for t in tokens), tokens, finish_reason="length" if finished else None)


async def _read(stream: FleetStream) -> list[StreamDelta]:
    return [d async for d in stream]


def test_a_fleet_stream_unpacks_a_deltas_item_in_order() -> None:
    a1, b1 = _delta("r-0", [1]), _delta("r-1", [2])
    a2, b2 = _delta("r-0", [3], finished=True), _delta("r-1", [4], finished=True)
    closed: list[FleetStream] = []
    stream = FleetStream(_Gen([Deltas((a1, b1)), Deltas((a2, b2))]), "r", ["r-0", "r-1"], closed.append)
    assert asyncio.run(_read(stream)) == [a1, b1, a2, b2]
    assert closed == [stream]


def test_a_failure_after_a_deltas_item_still_gives_its_deltas_first() -> None:
    a1, b1 = _delta("r-0", [1]), _delta("r-1", [2])
    stream = FleetStream(_Gen([Deltas((a1, b1)), Failed("internal", "boom")]), "r", ["r-0", "r-1"], lambda s: None)
    got: list[StreamDelta] = []

    async def read() -> None:
        async for d in stream:
            got.append(d)

    with pytest.raises(CadenceError, match="boom"):
        asyncio.run(read())
    assert got == [a1, b1]


def test_a_failure_keeps_its_retry_after() -> None:
    # (a queued request dropped for another tenant's fair share: 429 with Retry-After, as on one server)
    stream = FleetStream(_Gen([Failed("fair_share", "dropped", 3.0)]), "r", ["r"], lambda s: None)

    async def read() -> None:
        async for _ in stream:
            pass

    with pytest.raises(CadenceError) as e:
        asyncio.run(read())
    assert e.value.kind is ErrorKind.FAIR_SHARE and e.value.retry_after == 3.0


def test_a_replica_sends_the_choices_of_a_step_together() -> None:
    replica = CadenceReplica(EngineConfig.from_options(**TINY), tiny=True)
    params = SamplingParams(n=4, max_tokens=5, ignore_eos=True, temperature=1.0, seed=7)
    call = GenerateCall(([5, 6, 7, 8],), params, "cmpl-n4")

    async def run() -> tuple[list[Any], list[StreamDelta]]:
        items = [item async for item in replica.generate(call)]
        assert isinstance(items[0], Admitted)
        stream = FleetStream(_Gen(items[1:]), "cmpl-n4", [f"cmpl-n4-{k}" for k in range(4)], lambda s: None)
        return items[1:], await _read(stream)

    try:
        items, deltas = asyncio.run(run())
    finally:
        replica.engine.shutdown(timeout=5.0)
    sent = [d for item in items for d in deltas_of(item)]
    # Each engine step delivers the four choices' tokens at once: they travel as one item.
    assert any(isinstance(item, Deltas) and len(item.items) > 1 for item in items), items
    assert len(items) < len(sent)
    assert deltas == sent  # the ingress reads every delta, in the order the engine gave them
    by_choice: dict[str, list[int]] = {}
    for d in deltas:
        by_choice.setdefault(d.request_id, []).extend(d.token_ids)
    assert sorted(by_choice) == [f"cmpl-n4-{k}" for k in range(4)]
    assert all(len(tokens) == 5 for tokens in by_choice.values())
    assert sum(d.finished for d in deltas) == 4
