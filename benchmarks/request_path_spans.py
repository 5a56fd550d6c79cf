"""Where a chat request's time goes before and around its first engine step: a long prompt whose
leading blocks are in the prefix cache against a short one.

Serves the default model in process (uvicorn on 127.0.0.1), sends each chat twice (the second
send finds its prompt's full blocks cached) and times, per request:

- in process, with `time.perf_counter_ns` around the same calls the server makes: the JSON body
  parsed and validated (pydantic), the chat template rendered, the rendering tokenized, the
  prompt's block-hash chain;
- in the engine thread (wrapped for the run): the prefix lookup at admission and each executor
  step;
- over HTTP: the client's time to its first streamed token.

What the client waits beyond those spans is the hand-offs (HTTP thread to engine thread and back)
and the HTTP framing. Prints each stage's median, and its cost per prompt token as the difference
between the long and the short prompt over their difference in tokens.

    PYTHONPATH=src python benchmarks/request_path_spans.py [--repeats 15] [--port 18xxx]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.kv.hashing import block_hashers
from cadence.server.app import create_app
from cadence.server.protocol import ChatCompletionRequest
from cadence.server.tools import NO_TOOLS, template_messages

_WORDS = ("river", "stone", "lantern", "orbit", "maple", "quiet", "signal", "harbor", "copper", "meadow",
          "thunder", "violet", "engine", "paper", "summit", "candle", "falcon", "garden", "mirror", "winter")


def _ns(fn: Callable[[], Any], n: int = 20) -> float:
    """Median nanoseconds of `fn()` over `n` calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return statistics.median(out)


class _Spans:
    """Engine-thread spans recorded by wrapping a method for the run."""

    def __init__(self) -> None:
        self.times: dict[str, list[int]] = {}

    def wrap(self, obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return inner(*a, **kw)
            finally:
                self.times.setdefault(label, []).append(time.perf_counter_ns() - t0)

        setattr(obj, name, timed)

    def take(self) -> dict[str, int]:
        out = {k: sum(v) for k, v in self.times.items()}
        self.times.clear()
        return out


def _first_token_s(client: httpx.Client, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def _body(system: str, user: str) -> dict[str, Any]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"messages": msgs, "max_tokens": 1, "stream": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--port", type=int, default=random.randrange(18000, 19000))
    ap.add_argument("--prefix-words", type=int, default=440, help="words of the shared system prompt")
    args = ap.parse_args()
    config = EngineConfig()
    engine = AsyncEngine(build_engine(config))
    tok = engine.tokenizer
    spans = _Spans()
    spans.wrap(engine.core.scheduler.kv, "get_computed_blocks", "prefix lookup (engine thread)")
    spans.wrap(engine.core.executor, "execute", "step (engine thread)")
    app = create_app(engine, ServerConfig(port=args.port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                           lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    rng = random.Random(0)
    system = " ".join(rng.choice(_WORDS) for _ in range(args.prefix_words))
    hash_chain = block_hashers(config.cache.prefix_caching_hash_algo)[1]
    rows: dict[str, dict[str, float]] = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=120) as client:
            _first_token_s(client, _body("", "warm up"))
            for name, sys_text in (("short", ""), ("long", system)):
                acc: dict[str, list[float]] = {}
                n_tokens = 0
                for _ in range(args.repeats):
                    body = _body(sys_text, " ".join(rng.choice(_WORDS) for _ in range(6)))
                    _first_token_s(client, body)  # first send: fills the cache
                    spans.take()
                    ttft = _first_token_s(client, body)  # second send: every full block cached
                    engine_side = spans.take()
                    raw = json.dumps(body).encode()
                    parsed = ChatCompletionRequest.model_validate(json.loads(raw))
                    msgs = template_messages(parsed.messages, NO_TOOLS, False)
                    chat = tok.render_chat(msgs, True)
                    ids = tok.apply_chat_template(msgs, True, max_tokens=engine.max_model_len)
                    n_tokens = len(ids)
                    stage = {
                        "parse + validate": _ns(lambda raw=raw: ChatCompletionRequest.model_validate(json.loads(raw))),
                        "template render": _ns(lambda msgs=msgs: tok.render_chat(msgs, True)),
                        "tokenize": _ns(lambda chat=chat: tok._encode_chat(chat)),
                        "render + tokenize (server call)": _ns(
                            lambda msgs=msgs: tok.apply_chat_template(msgs, True, max_tokens=engine.max_model_len)),
                        "block-hash chain": _ns(lambda ids=ids: hash_chain(ids, config.cache.block_size, None, ())),
                        **{k: float(v) for k, v in engine_side.items()},
                        "client TTFT": ttft * 1e9,
                    }
                    for k, v in stage.items():
                        acc.setdefault(k, []).append(v)
                rows[name] = {k: statistics.median(v) for k, v in acc.items()}
                rows[name]["prompt tokens"] = n_tokens
    finally:
        server.should_exit = True
        th.join(15)
        engine.shutdown(timeout=10)
    short, long_ = rows["short"], rows["long"]
    dn = long_["prompt tokens"] - short["prompt tokens"]
    print(f"prompt tokens: short {short['prompt tokens']:.0f}, long {long_['prompt tokens']:.0f} "
          "(second send: its full blocks cached)")
    print("| stage | short (us) | long (us) | us per prompt token |\n|---|---|---|---|")
    for k in short:
        if k == "prompt tokens":
            continue
        a, b = short[k] / 1e3, long_[k] / 1e3
        print(f"| {k} | {a:.1f} | {b:.1f} | {(b - a) / dn:.3f} |")


if __name__ == "__main__":
    main()
