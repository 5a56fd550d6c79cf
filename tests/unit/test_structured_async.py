"""A constrained request whose grammar is still compiling waits outside the engine: other requests
run to the end meanwhile, and its status says why it waits."""

import asyncio
import re
import threading

import pytest

from cadence.boundary import WaitReason
from cadence.config import EngineConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.errors import CadenceError, ErrorKind
from cadence.request import SamplingParams
from cadence.request import StructuredOutputsParams as SO

TINY = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}


async def _text(engine: AsyncEngine, rid: str, params: SamplingParams) -> str:
    text = ""
    async for d in engine.generate([1, 2, 3, 4], params, request_id=rid):
        text += d.text
    return text


def test_a_slow_compile_holds_only_its_own_request():
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    compiler = engine.core.structured.compiler
    build, started, gate = compiler._build, threading.Event(), threading.Event()

    def slow_build(spec):  # the library compiles real schemas in milliseconds: a gate stands in for a slow one
        started.set()
        gate.wait(60)
        return build(spec)

    compiler._build = slow_build

    async def scenario() -> None:
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, structured_outputs=SO(regex="[a-z]{4}"))
        slow = asyncio.create_task(_text(engine, "slow", params))
        assert await asyncio.to_thread(started.wait, 30)
        (snap,) = await engine.request_status("slow")
        assert snap.state == "waiting" and snap.wait is not None
        assert snap.wait.reason == WaitReason.GRAMMAR_COMPILING
        plain = [_text(engine, f"plain{i}", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                 for i in range(3)]
        assert len(await asyncio.wait_for(asyncio.gather(*plain), 60)) == 3
        assert not slow.done()
        gate.set()
        assert re.fullmatch("[a-z]{4}", await asyncio.wait_for(slow, 60))

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        engine.shutdown()


def test_a_refused_constraint_is_an_invalid_request_and_the_engine_serves_on():
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))

    async def scenario() -> None:
        bad = SamplingParams(max_tokens=4, structured_outputs=SO(regex="(unclosed"))
        with pytest.raises(CadenceError, match=r"structured_outputs\.regex") as info:
            await engine.submit([[1, 2, 3]], bad, request_id="bad")
        assert info.value.kind == ErrorKind.INVALID_REQUEST
        assert await engine.request_status("bad") is None
        assert await _text(engine, "ok", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
