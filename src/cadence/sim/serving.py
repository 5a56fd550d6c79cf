"""Calibration's last phase: what serving adds to a step, measured through `cadence serve`.

A served step costs more than the forward pass timed alone: the engine thread also detokenizes,
updates metrics and hands tokens to the HTTP side, whose thread formats and streams them while the
next step runs, and a client on the same machine parses them. This phase starts `cadence serve`
with the engine options being calibrated, streams closed-loop decode traffic at a few batch sizes,
and compares the inter-token latency the client sees with what the fitted cost model predicts for
those decode steps. The difference, fitted as a constant per step plus a cost per running request,
becomes the profile's overhead.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from cadence.bench.launch import served
from cadence.config import EngineConfig, option_flags
from cadence.executor.cost_model import StepCostModel, StepFeatures

PROMPT_TOKENS = 64
OUTPUT_TOKENS = 48


def engine_flags(config: EngineConfig) -> list[str]:
    """Command-line flags that reproduce `config` (only what differs from the defaults)."""
    default = EngineConfig().as_options()
    flags: list[str] = []
    for name, value in config.as_options().items():
        if value != default[name] and value is not None:
            flags += option_flags(name, value)
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream_one(client: httpx.Client, prompt: list[int]) -> list[float]:
    """Arrival times of the token chunks of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "min_tokens": OUTPUT_TOKENS,
            "stream": True}
    times = []
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
    return times


def _closed_loop(url: str, users: int, rounds: int, vocab: int) -> list[float]:
    """`users` clients, each streaming `rounds` requests back to back; all inter-token gaps."""
    gaps: list[float] = []
    lock = threading.Lock()

    def user(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=300) as client:
            for _ in range(rounds):
                t = _stream_one(client, [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)])
                with lock:
                    gaps.extend(b - a for a, b in zip(t, t[1:], strict=False))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return gaps


def measure_serving_overhead(config: EngineConfig, model: StepCostModel, vocab: int, *,
                             batches: tuple[int, ...] = (1, 4, 16), rounds: int = 2,
                             log_path: str = "cadence_calibrate_serve.log") -> dict[str, Any]:
    """Serve, stream decode traffic at each batch size, fit (median ITL - modelled step) = a + b * batch;
    and probe the request path at idle first (`probe_request_path`: the caller fits it once the
    step overhead is known)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cadence.cli", "serve", "--port", str(port), *engine_flags(config)]
    with served(cmd, url + "/ready", log_path):
        warm_up(url, 1, vocab)
        probe = probe_request_path(url)
        fit = decode_overhead(url, model, vocab, batches=batches, rounds=rounds)
    return {**fit, "how": "cadence serve, streaming client on "
            f"this machine, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} tokens out",
            "request_path_probe": probe}


def warm_up(url: str, clients: int, vocab: int) -> None:
    """One streamed request from each of `clients` at once (a fleet's: one on each replica), untimed."""
    _closed_loop(url, clients, 1, vocab)


ClosedLoop = Callable[[str, int, int, int], list[float]]


def decode_overhead(url: str, model: StepCostModel, vocab: int, *, replicas: int = 1,
                    batches: tuple[int, ...] = (1, 4, 16), rounds: int = 2,
                    loop: ClosedLoop | None = None) -> dict[str, Any]:
    """What serving adds to a decode step on the server at `url`, from closed-loop streaming traffic:
    for each batch size n in `batches`, `replicas` x n clients (a fleet whose router spreads them
    evenly runs n on each replica, all replicas at once, as they share the machine's cores), the
    median inter-token gap less the cost model's price of a decode step of n requests, fitted as
    per_step + per_seq x n. `model` is priced as given: pass it without its own overhead."""
    if replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {replicas}")
    loop = loop or _closed_loop
    rows = []
    for n in batches:
        gaps = loop(url, replicas * n, rounds, vocab)
        if not gaps:
            raise RuntimeError(f"serving overhead: no inter-token gaps from {replicas * n} clients")
        ctx = PROMPT_TOKENS + OUTPUT_TOKENS // 2
        f = StepFeatures(decode_seqs=n, sampled=n, decode_context=n * ctx, decode_padded=n * ctx)
        # The mean beside the fitted median: where a server sends tokens in bursts, they part.
        rows.append({"batch": n, "clients": replicas * n, "median_itl_s": statistics.median(gaps),
                     "mean_itl_s": statistics.fmean(gaps), "modelled_step_s": model.predict(f)})
    per_seq, per_step = fit_line([r["batch"] for r in rows], [r["median_itl_s"] - r["modelled_step_s"] for r in rows])
    return {"per_step": per_step, "per_seq": per_seq, "replicas": replicas, "runs": rows}


# Words for the request-path probe's text prompts: each probe a fresh random sentence, so no prompt
# finds another's blocks in the prefix cache.
_WORDS = ("river", "stone", "lantern", "orbit", "maple", "quiet", "signal", "harbor", "copper", "meadow",
          "thunder", "violet", "engine", "paper", "summit", "candle", "falcon", "garden", "mirror", "winter")


def _first_token(client: httpx.Client, text: str) -> tuple[float, int, int]:
    """Seconds to the first streamed token of a one-token completion of `text`, its prompt tokens
    and how many of them the prefix cache held."""
    body = {"prompt": text, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, prompt_tokens, cached = None, 0, 0
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices") and first is None:
                first = time.perf_counter() - t0
            if obj.get("usage"):
                prompt_tokens = int(obj["usage"]["prompt_tokens"])
                cached = int((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if first is None or not prompt_tokens:
        raise RuntimeError("request-path probe: the server sent no token or no usage")
    return first, prompt_tokens, cached


# The probe's prompt lengths in words (about a token and a half each with their spaces): short
# to a few hundred tokens, so the fit sees what a long prompt's path costs beyond a short one's.
PROBE_WORDS = (8, 96, 384)


def probe_request_path(url: str, *, words: tuple[int, ...] = PROBE_WORDS, repeats: int = 8,
                       seed: int = 0) -> list[dict[str, float]]:
    """Time to first token of one request at a time through a server at idle: text prompts of
    each length in `words`, one token out, streamed as `cadence bench` streams. Each prompt is new
    and sent twice; the second send is timed: its full blocks are then in the prefix cache, so
    its step computes only the last partial block's tokens, and the cost model's error on a long
    prefill does not leak into the path's cost per prompt token. Each run: the prompt's words,
    tokens, tokens found cached (the server's usage) and the second send's time to first token."""
    rng = random.Random(seed)
    runs = []
    with httpx.Client(base_url=url, timeout=120) as client:
        _first_token(client, "warm up")
        for n in words:
            for _ in range(repeats):
                text = " ".join(rng.choice(_WORDS) for _ in range(n))
                _first_token(client, text)  # fills the prefix cache with the prompt's full blocks
                ttft, tokens, cached = _first_token(client, text)
                runs.append({"words": n, "prompt_tokens": tokens, "cached_tokens": cached, "ttft_s": ttft})
    return runs


def _priced_first_step(model: StepCostModel, prompt_tokens: int, cached: int) -> float:
    """The cost model's price of the step that computes a prompt's last `prompt_tokens - cached`
    tokens over its `cached` ones and samples its first token. One token left is a decode row, as
    the engine lays out any one-token row (a prompt cached but for its last token)."""
    m = prompt_tokens - cached
    if m == 1:
        return model.predict(StepFeatures(decode_seqs=1, sampled=1, decode_context=prompt_tokens,
                                          decode_padded=prompt_tokens))
    return model.predict(StepFeatures(prefill_tokens=m, prefill_seqs=1, sampled=1,
                                      prefill_attention=m * cached + m * (m + 1) // 2))


def fit_request_path(runs: list[dict[str, float]], model: StepCostModel) -> dict[str, float]:
    """The request path from a probe's runs: the client's time to its first token less the cost
    model's price of the one prefill step that made it is what the request paid outside the
    engine's steps (HTTP, the chat template and tokenization, the hand-offs to and from the engine
    thread). Runs of cached prompts (a `cached_tokens` field, as `probe_request_path` makes them)
    of several lengths are fitted as per_request + per_prompt_token x prompt tokens, a line
    through each length's median (one request held up by something else on the machine does not
    move it). Runs of fresh prompts only price a full prefill each, whose model error grows with
    the prompt: those give a constant, the median over the shortest prompts. Terms clipped at 0."""
    if not runs:
        raise ValueError("request path: no probe runs to fit")
    if all("cached_tokens" in r for r in runs):
        groups: dict[float, list[dict[str, float]]] = {}
        for r in runs:
            groups.setdefault(r.get("words", r["prompt_tokens"]), []).append(r)
        if len(groups) > 1:
            x = [statistics.median(int(r["prompt_tokens"]) for r in g) for g in groups.values()]
            y = [statistics.median(r["ttft_s"] - _priced_first_step(model, int(r["prompt_tokens"]),
                                                                     int(r["cached_tokens"])) for r in g)
                 for g in groups.values()]
            per_token, per_request = fit_line(x, y)
            return {"per_request": per_request, "per_prompt_token": per_token}
    shortest = min(int(r["prompt_tokens"]) for r in runs)
    excess = []
    for r in runs:
        if int(r["prompt_tokens"]) > shortest + 16:  # a longer prompt's prefill carries more model error
            continue
        excess.append(r["ttft_s"] - _priced_first_step(model, int(r["prompt_tokens"]), int(r.get("cached_tokens", 0))))
    return {"per_request": max(statistics.median(excess), 0.0)}


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept, both clipped at 0 (serving never makes a step cheaper)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (c - my) for a, c in zip(x, y, strict=True)) / sxx if sxx else 0.0
    slope = max(slope, 0.0)
    return slope, max(my - slope * mx, 0.0)
