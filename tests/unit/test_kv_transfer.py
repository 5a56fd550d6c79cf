"""KV blocks moved between two engines of one model (engine/kv_transfer.py), without Ray: a prefill
engine exports a prompt's blocks, a decode engine reserves, writes and publishes them, and the
request admitted there finds them as prefix hits."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from cadence.config import EngineConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.engine.output_processor import StreamDelta
from cadence.fleet.protocol import GenerateCall
from cadence.request import SamplingParams

CONFIG = {"num_kv_blocks": 64, "block_size": 16, "max_model_len": 512, "device": "cpu", "dtype": "float32",
          "num_threads": 1, "max_num_seqs": 4}
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(83)]  # 5 full blocks and 3 tokens


@pytest.fixture
def engines() -> Iterator[tuple[AsyncEngine, AsyncEngine]]:
    cfg = EngineConfig.from_options(**CONFIG)
    prefill, decode = AsyncEngine(build_engine(cfg, tiny=True)), AsyncEngine(build_engine(cfg, tiny=True))
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


async def _run(engine: AsyncEngine, prompt: list[int], max_tokens: int, rid: str) -> tuple[list[int], int]:
    """Greedy tokens of one request, and the prompt tokens it found cached."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, cached = [], 0
    async for d in engine.generate(prompt, params, request_id=rid):
        tokens += d.token_ids
        cached = max(cached, d.num_cached_tokens)
    return tokens, cached


async def _hand_off(prefill: AsyncEngine, decode: AsyncEngine, rid: str, max_tokens: int):
    """Prefill's first token, its export of what decode lacks, decode's import and the rest."""
    first, _ = await _run(prefill, PROMPT, 1, rid)
    pt, dt = prefill.kv_transfer, decode.kv_transfer
    missing = await decode.run_in_engine(lambda: dt.reserve(rid, PROMPT, None, 30.0))
    export = await prefill.run_in_engine(lambda: pt.export(PROMPT, None, missing))
    await decode.run_in_engine(lambda: dt.write(rid, export))
    stream = decode.generate(PROMPT + first, SamplingParams(max_tokens=max_tokens - 1, temperature=0.0,
                                                            ignore_eos=True), request_id=rid)
    rest, cached = [], 0
    bound = False
    async for d in stream:
        if not bound:
            await decode.run_in_engine(lambda: dt.bind(rid, rid))
            bound = True
        rest += d.token_ids
        cached = max(cached, d.num_cached_tokens)
    return first + rest, cached, missing, export


def test_greedy_output_through_a_hand_off_equals_one_engines(engines) -> None:
    prefill, decode = engines
    colocated = AsyncEngine(build_engine(EngineConfig.from_options(**CONFIG), tiny=True))
    try:
        expected, _ = asyncio.run(_run(colocated, PROMPT, 12, "c"))
    finally:
        colocated.shutdown()
    got, cached, missing, export = asyncio.run(_hand_off(prefill, decode, "r1", 12))
    assert got == expected
    assert missing == [0, 1, 2, 3, 4] and export.positions == (0, 1, 2, 3, 4)
    assert cached == 5 * 16  # the imported blocks were prefix hits: only the partial block was computed


def test_imported_blocks_are_byte_identical_and_a_repeat_moves_nothing(engines) -> None:
    prefill, decode = engines

    async def scenario():
        _, _, _, export = await _hand_off(prefill, decode, "r1", 4)
        ids = await decode.run_in_engine(lambda: decode.core.kv.prefix_block_ids(decode.kv_transfer.chain(PROMPT, None)))
        imported = await decode.run_in_engine(lambda: decode.core.executor.read_blocks(ids))
        pids = await prefill.run_in_engine(lambda: prefill.core.kv.prefix_block_ids(prefill.kv_transfer.chain(PROMPT, None)))
        local = await prefill.run_in_engine(lambda: prefill.core.executor.read_blocks(pids))
        _, _, missing2, export2 = await _hand_off(prefill, decode, "r2", 4)
        return export, imported, local, missing2, export2

    export, imported, local, missing2, export2 = asyncio.run(scenario())
    assert len(export.positions) == 5 and export.nbytes == imported.numel() * imported.element_size()
    assert torch.equal(imported, local) and torch.equal(imported, export.data)
    assert missing2 == [] and export2.nbytes == 0 and export2.data is None


def test_a_reservation_counts_against_the_cache_and_an_unbound_one_expires(engines) -> None:
    _, decode = engines
    dt, kv = decode.kv_transfer, decode.core.kv
    long_prompt = list(range(10, 10 + 40 * 16))  # 40 full blocks of a 64-block cache

    async def scenario():
        first = await decode.run_in_engine(lambda: dt.reserve("a", long_prompt, None, 30.0))
        free_after_first = kv.num_free_blocks
        second = await decode.run_in_engine(lambda: dt.reserve("b", long_prompt[::-1], None, 30.0))
        released = await decode.run_in_engine(lambda: dt.release("a"))
        # A reservation nobody binds to a request is dropped at its time to live (here at once).
        third = await decode.run_in_engine(lambda: dt.reserve("c", long_prompt, None, 0.0))
        await decode.run_in_engine(lambda: None)
        return first, free_after_first, second, released, third

    first, free_after_first, second, released, third = asyncio.run(scenario())
    assert len(first) == 40 and free_after_first == 24
    assert second is None  # 40 more blocks do not fit: refused, nothing taken
    # "a"'s blocks, released without their KV, were never published: all 40 must come again.
    assert released and third == list(range(40))
    assert kv.num_free_blocks == 64 and kv.num_import_blocks == 0 and dt.num_reservations == 0
    kv.check_integrity()


def _pd_replicas() -> tuple:
    from cadence.fleet.pd import PDReplica

    cfg = EngineConfig.from_options(**CONFIG)
    return PDReplica(cfg, tiny=True), PDReplica(cfg, tiny=True)  # (outside Serve: no Ray cluster)


async def _texts(engine: AsyncEngine, params: SamplingParams) -> list[tuple[str, str | None]]:
    return [(d.text, d.finish_reason) async for d in engine.generate(PROMPT, params, request_id="one")]


async def _replica_hand_off(prefill, decode, params: SamplingParams) -> tuple[str, str | None, str | int | None]:
    """The text a client sees through the replicas' hand-off calls (as `PDFleetClient` drives them)."""
    first_params = replace(params, max_tokens=1)
    reserved = await decode.reserve_kv("k", PROMPT, None, 30.0)
    items = [i async for i in prefill.prefill(GenerateCall((PROMPT,), first_params, "r"), reserved.missing)]
    first = [i for i in items if isinstance(i, StreamDelta)]
    text = "".join(d.text for d in first)
    assert first[-1].finish_reason == "length", first  # (the stop is not in the first token's text alone)
    ids = [t for d in first for t in d.token_ids]
    call = GenerateCall((PROMPT + ids,), replace(params, max_tokens=params.max_tokens - 1), "r",
                        num_emitted=len(ids))
    last = None
    async for item in decode.decode(call, "k", items[-1]):
        if isinstance(item, StreamDelta):
            text += item.text
            last = item
    assert last is not None
    return text, last.finish_reason, last.stop_reason


def test_a_stop_string_that_begins_in_the_first_tokens_text_is_matched_across_the_hand_off() -> None:
    prefill, decode = _pd_replicas()
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    try:
        deltas = asyncio.run(_texts(prefill.engine, greedy))
        t0, t1 = deltas[0][0], deltas[1][0]
        assert t0 and t1, deltas  # (the tiny model's first two tokens both show text for this prompt)
        stop = t0[-1] + t1[:1]  # begins in the first token's text, ends in the second's
        params = replace(greedy, stop=(stop,))
        expected = asyncio.run(_texts(decode.engine, params))
        expected_text = "".join(t for t, _ in expected)
        text, finish, stop_reason = asyncio.run(_replica_hand_off(prefill, decode, params))
    finally:
        prefill.engine.shutdown()
        decode.engine.shutdown()
    assert expected[-1][1] == "stop" and expected_text == (t0 + t1)[: len(t0) - 1]
    assert (text, finish, stop_reason) == (expected_text, "stop", stop)



def test_a_reservation_that_expired_while_its_prefill_queued_still_imports_and_decodes() -> None:
    """A prefill that waits longer than the reservation's time to live (a queue of long prompts, a
    replica starting) must not cost the request: the decode replica reserves again and imports."""
    prefill, decode = _pd_replicas()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def scenario():
        expected = [t async for d in prefill.engine.generate(PROMPT, greedy, request_id="one") for t in d.token_ids]
        reserved = await decode.reserve_kv("k", PROMPT, None, 0.0)  # (expires at the engine's next turn)
        await decode.engine.run_in_engine(lambda: decode.engine.kv_transfer.expire())
        items = [i async for i in prefill.prefill(GenerateCall((PROMPT,), replace(greedy, max_tokens=1), "r"),
                                                  reserved.missing)]
        first = [t for i in items if isinstance(i, StreamDelta) for t in i.token_ids]
        call = GenerateCall((PROMPT + first,), replace(greedy, max_tokens=5), "r", num_emitted=1)
        got, cached = list(first), 0
        async for item in decode.decode(call, "k", items[-1]):
            if isinstance(item, StreamDelta):
                got += item.token_ids
                cached = max(cached, item.num_cached_tokens)
        state = decode.kv_state()
        return expected, got, cached, state

    try:
        expected, got, cached, (_, free, held, reservations) = asyncio.run(scenario())
    finally:
        prefill.engine.shutdown()
        decode.engine.shutdown()
    assert got == expected
    assert cached == 5 * 16  # the blocks arrived after all: only the partial block was computed
    assert (free, held, reservations) == (64, 0, 0)


@pytest.mark.parametrize("stop", [(), ("猫 ア",), ("t ア c",), ("ア",)])
def test_the_text_goes_on_across_a_hand_off_at_every_token(stop) -> None:
    """One stream's text, whichever token it is handed over after: a character split between the
    first engine's tokens and the next one's, a stop string across them (the real tokenizer)."""
    from cadence.boundary import RequestDelta
    from cadence.engine.output_processor import OutputProcessor, shown_text
    from cadence.model.loader import default_model_path
    from cadence.model.tokenizer import Tokenizer
    from cadence.request import FinishReason

    tok = Tokenizer.from_gguf(default_model_path())
    ids = tok.encode("cat 猫 ア cat 🐈 end", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=stop)

    def stream(proc: OutputProcessor, rest: list[int]) -> tuple[str, str | None]:
        text, finish = "", None
        for i, t in enumerate(rest):
            last = i == len(rest) - 1
            out, _ = proc.process([RequestDelta("r", (t,), finish_reason=FinishReason.LENGTH if last else None)])
            text += "".join(d.text for d in out)
            finish = next((d.finish_reason for d in out if d.finished), finish)
            if finish:
                break
        return text, finish

    whole = OutputProcessor(tok)
    whole.add_request("r", params, [1, 2])
    expected = stream(whole, ids)
    for k in range(1, len(ids)):
        if stop and expected[1] == "stop" and tok.decode(ids[:k]).find(stop[0]) >= 0:
            break  # (the first engine would have matched it alone)
        second = OutputProcessor(tok)
        second.add_request("r", params, [1, 2, *ids[:k]], emitted=k)
        text, finish = stream(second, ids[k:])
        assert (shown_text(tok, params, ids[:k]) + text, finish) == expected, k


class _Spans:
    """A replica's tracer stand-in: the engine spans it would export."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, str], str, str, dict[int, Any], BaseException | None]] = []

    def end_engine_span(self, carrier, request_id, replica, start_ns, finals, error=None) -> None:
        self.spans.append((carrier, request_id, replica, finals, error))

    def shutdown(self) -> None:
        pass


def test_both_replicas_export_their_span_of_a_handed_off_request() -> None:
    prefill, decode = _pd_replicas()
    prefill.tracer, decode.tracer = _Spans(), _Spans()
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        reserved = await decode.reserve_kv("k", PROMPT, None, 30.0)
        call = GenerateCall((PROMPT,), replace(greedy, max_tokens=1), "r", trace_context=carrier)
        items = [i async for i in prefill.prefill(call, reserved.missing)]
        first = [t for i in items if isinstance(i, StreamDelta) for t in i.token_ids]
        call = GenerateCall((PROMPT + first,), replace(greedy, max_tokens=3), "r", trace_context=carrier,
                            num_emitted=1)
        _ = [i async for i in decode.decode(call, "k", items[-1])]

    try:
        asyncio.run(scenario())
    finally:
        prefill.engine.shutdown()
        decode.engine.shutdown()
    for replica in (prefill, decode):
        assert len(replica.tracer.spans) == 1, (replica is prefill, replica.tracer.spans)
        [(got_carrier, rid, name, finals, error)] = replica.tracer.spans
        assert (got_carrier, rid, name, error) == (carrier, "r", replica.name, None)
        assert [d.finished for d in finals.values()] == [True]
