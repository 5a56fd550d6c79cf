"""Output tokens/s through the HTTP server (streaming, 32 concurrent clients) against the offline engine.

    .venv/bin/python benchmarks/bench_server_overhead.py [--tiny] [--requests 96] [--max-tokens 64]

Same engine object, same requests, same batch limit (`max_num_seqs` = the number of clients) on
both sides, prefix caching off so the second run gains nothing from the first: the ratio is what the
server (HTTP, JSON, SSE, the asyncio hop, the engine thread) costs. The target is >= 0.90.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import threading
import time

import httpx
import torch
import uvicorn

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import Engine, build_engine
from cadence.engine.output_processor import OutputProcessor
from cadence.request import Request, RequestStatus, SamplingParams
from cadence.server.app import create_app


def prompts(engine: Engine, count: int) -> list[list[int]]:
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "it",
        "was",
        "for",
        "on",
        "are",
        "with",
        "as",
        "his",
        "they",
        "be",
        "at",
        "one",
        "have",
        "this",
        "from",
    ]
    out = []
    for i in range(count):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(24 + i % 16))
        out.append(engine.tokenizer.encode(f"Request {i}: {text}"))
    return out


def offline(engine: Engine, token_lists: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    """The engine loop alone, in a thread of its own as in the server (torch threads behave alike)."""
    result: list[tuple[int, float]] = []
    thread = threading.Thread(target=lambda: result.append(_offline_loop(engine, token_lists, params)))
    thread.start()
    thread.join()
    return result[0]


def _offline_loop(engine: Engine, token_lists: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    core, proc = engine.core, OutputProcessor(engine.tokenizer)
    start = time.perf_counter()
    for i, toks in enumerate(token_lists):
        core.add_request(Request(f"off-{i}", list(toks), params))
        proc.add_request(f"off-{i}", params, toks)
    tokens = 0
    while core.has_unfinished_requests():
        deltas, stopped = proc.process(core.step())
        if stopped:
            core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        tokens += sum(len(d.token_ids) for d in deltas)
    return tokens, time.perf_counter() - start


async def _clients(url: str, token_lists: list[list[int]], params: SamplingParams, concurrency: int) -> int:
    queue: asyncio.Queue = asyncio.Queue()
    for toks in token_lists:
        queue.put_nowait(toks)
    total = 0
    body = {
        "max_tokens": params.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal total
        while not queue.empty():
            toks = queue.get_nowait()
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": toks}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            total += usage["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return total


def _client_process(
    url: str, token_lists: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[int, float]:
    params = SamplingParams(max_tokens=max_tokens)
    start = time.perf_counter()
    tokens = asyncio.run(_clients(url, token_lists, params, concurrency))
    return tokens, time.perf_counter() - start


def through_server(
    engine: Engine, token_lists: list[list[int]], params: SamplingParams, concurrency: int
) -> tuple[int, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, ServerConfig(port=port))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        # The load generator runs in its own process, as real clients do: it must not share the GIL.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            return pool.apply(
                _client_process, (f"http://127.0.0.1:{port}", token_lists, params.max_tokens, concurrency)
            )
    finally:
        server.should_exit = True
        thread.join(10)
        async_engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig.from_options(
        max_num_seqs=args.concurrency,
        enable_prefix_caching=False,
        max_model_len=1024,
        kv_cache_memory=256 << 20,
    )
    engine = build_engine(config, tiny=args.tiny)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    token_lists = prompts(engine, args.requests)
    offline(engine, token_lists[:8], params)  # warm-up
    expected = args.requests * args.max_tokens
    off_rates, srv_rates = [], []
    # Alternate the two, several rounds, best of each: a shared machine's load comes and goes.
    for _ in range(args.rounds):
        tokens, seconds = offline(engine, token_lists, params)
        assert tokens == expected, tokens
        off_rates.append(tokens / seconds)
        tokens, seconds = through_server(engine, token_lists, params, args.concurrency)
        assert tokens == expected, tokens
        srv_rates.append(tokens / seconds)
    off_rate, srv_rate = max(off_rates), max(srv_rates)
    print(
        f"model {engine.model_name}: {args.requests} requests x {args.max_tokens} tokens, "
        f"{args.concurrency} concurrent streaming clients, best of {args.rounds} alternating rounds"
    )
    print(
        f"offline engine : {off_rate:8.1f} output tokens/s  (rounds: {', '.join(f'{r:.0f}' for r in off_rates)})"
    )
    print(
        f"through server : {srv_rate:8.1f} output tokens/s  (rounds: {', '.join(f'{r:.0f}' for r in srv_rates)})"
    )
    print(f"ratio          : {srv_rate / off_rate:.3f} (target >= 0.90)")


if __name__ == "__main__":
    main()
