"""A replica sends the deltas its engine already has in one message (`Deltas`), and the ingress's
`FleetStream` hands them on one by one, in order, as if they had come one per message. No Ray:
the replica's `generate` runs on a real (tiny) engine, the stream reads a plain async generator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cadence.config import EngineConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.fleet.client import FleetStream
from cadence.fleet.protocol import Admitted, Deltas, GenerateCall
from cadence.fleet.replica import CadenceReplica
from cadence.request import SamplingParams

TINY = {"num_kv_blocks": 64, "max_model_len": 64, "max_num_seqs": 4, "device": "cpu", "dtype": "float32"}
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _replica(engine: AsyncEngine) -> CadenceReplica:
    replica = object.__new__(CadenceReplica)  # (its __init__ asks Serve for its name)
    replica.name, replica.engine = "r0", engine
    return replica


async def _messages(engine: AsyncEngine, read_late: bool) -> list[Any]:
    gen = _replica(engine).generate(GenerateCall(([5, 6, 7],), PARAMS, "req-1"))
    assert isinstance(await anext(gen), Admitted)
    if read_late:  # a reader that falls behind: the engine finishes before the first read
        while engine.core.has_unfinished_requests():
            await asyncio.sleep(0.005)
    return [m async for m in gen]


def _flat(messages: list[Any]) -> list[Any]:
    return [d for m in messages for d in (m.items if isinstance(m, Deltas) else (m,))]


def _run(read_late: bool) -> list[Any]:
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    try:
        return asyncio.run(_messages(engine, read_late))
    finally:
        engine.shutdown(timeout=10)


def test_a_late_reader_gets_the_ready_deltas_in_one_message() -> None:
    late, prompt = _run(read_late=True), _run(read_late=False)
    # Twelve tokens in one Ray message (two, when the last step's delivery was still on its way).
    assert len(late) <= 2 and isinstance(late[0], Deltas)
    tokens = [t for d in _flat(late) for t in d.token_ids]
    assert tokens == [t for d in _flat(prompt) for t in d.token_ids] and len(tokens) == 12
    assert [d.finished for d in _flat(late)] == [False] * 11 + [True]


class _Gen:
    """What Ray's streaming generator gives the ingress: an async iterator with `cancel()`."""

    def __init__(self, items: list[Any]) -> None:
        self._it = self._iterate(items)

    @staticmethod
    async def _iterate(items: list[Any]) -> AsyncIterator[Any]:
        for item in items:
            yield item

    def __anext__(self) -> Any:
        return self._it.__anext__()

    def cancel(self) -> None:
        pass


def test_the_ingress_stream_unpacks_batches_in_order() -> None:
    messages = _run(read_late=True)
    closed: list[FleetStream] = []

    async def read() -> list[Any]:
        stream = FleetStream(_Gen(messages), "req-1", ["req-1"], closed.append)
        return [d async for d in stream]

    got = asyncio.run(read())
    assert got == _flat(messages)
    assert closed  # the stream ended cleanly, every choice finished
