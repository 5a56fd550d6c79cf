"""What an abort hands back for a request's trace: each aborted choice's last record (finish reason
`abort`, its metrics, its events up to the abort) ahead of the stream's terminal error, and only
while the engine records request events."""

from __future__ import annotations

import asyncio

from cadence.config import EngineConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.request import SamplingParams

# One seat: of two choices, the first runs and the second waits for the seat.
TINY = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64, "max_num_seqs": 1}
LONG = SamplingParams(max_tokens=200, ignore_eos=True, n=2)


async def _abort_after_first_token(engine: AsyncEngine) -> list:
    stream = await engine.submit([[1, 2, 3, 4]], LONG, request_id="r")
    first = await anext(stream)
    assert first.token_ids and not first.finished
    await stream.aclose()
    return await stream.last_records(30)


def test_an_abort_hands_back_how_far_each_choice_got():
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    engine.enable_request_events()
    try:
        records = {d.request_id: d for d in asyncio.run(_abort_after_first_token(engine))}
    finally:
        engine.shutdown()
    assert set(records) == {"r-0", "r-1"}
    running, queued = records["r-0"], records["r-1"]
    assert running.finish_reason == queued.finish_reason == "abort"
    assert running.num_output_tokens >= 1 and running.metrics.first_token_time is not None
    assert "prefill_chunk" in [e.name for e in running.events]
    # The second never got the seat: no first step, and why it waited.
    assert queued.metrics.first_scheduled_time is None and queued.metrics.finished_time is not None
    assert [dict(e.attributes)["cadence.wait_reason"] for e in queued.events if e.name == "waiting"] == ["max_num_seqs"]


def test_without_request_events_an_abort_hands_back_nothing():
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    try:
        records = asyncio.run(_abort_after_first_token(engine))
    finally:
        engine.shutdown()
    assert records == []  # the abort's error came, and nothing before it
