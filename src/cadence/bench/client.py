"""The load generator: replays a workload against any OpenAI-compatible server, streaming.

Open loop (arrivals from the workload: Poisson, gamma, trace timestamps; optionally capped at
`concurrency` requests in flight) or closed loop (`concurrency` users, each sending its next
request when the previous one ends). Bounded by a number of requests and by seconds. Works against
cadence, vLLM and llama.cpp's server: fields a server does not know are ignored there, and what
it does not honour (usage chunks, exact output lengths) is detected and reported.

In-process use: `run_benchmark(BenchConfig(...)) -> BenchResult`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from tqdm import tqdm

from cadence.bench import report
from cadence.bench import speculative as spec
from cadence.bench.prompts import LocalTokenizer, PromptBuilder, ServerTokenizer, Tokenizer
from cadence.bench.report import RequestRecord
from cadence.wording import counted
from cadence.workload import Workload, WorkloadRequest, assign_arrivals, builtin_workload

# The built-in schema of `--structured-fraction`: an extraction record as a pipeline asks for it,
# closed (strict) and ending in a free-text field, so that a request may run to its `max_tokens`.
EXTRACTION_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "category": {"type": "string", "enum": ["news", "story", "howto", "history", "science", "other"]},
        "year": {"anyOf": [{"type": "integer", "minimum": 1000, "maximum": 2100}, {"type": "null"}]},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "sentiment": {"type": "number", "minimum": -1, "maximum": 1},
        "summary": {"type": "string"},
    },
    "required": ["title", "category", "year", "places", "sentiment", "summary"],
    "additionalProperties": False,
}
EXTRACTION_RESPONSE_FORMAT: dict = {"type": "json_schema", "json_schema": {
    "name": "extraction", "schema": EXTRACTION_SCHEMA, "strict": True}}


@dataclass
class BenchConfig:
    """One benchmark run. `arrival`: poisson | gamma (needs `rate`; rate inf sends every request at
    time 0) | trace | none (closed loop, needs `concurrency`). `burstiness`: the gamma shape, as
    vLLM's (1 = Poisson, < 1 burstier). `tokenizer`: "auto" (the server's /tokenize, else an
    estimate), "none" (estimate), or a path to a tokenizer.json. `workload_settings`: how the
    workload was made (source file, scaling), recorded in the report's meta."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    workload: Workload | None = None
    arrival: str = "poisson"
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    out_dir: str | None = None
    tokenizer: str = "auto"
    request_timeout: float = 600.0
    drain_timeout: float = 60.0
    force_output_lengths: bool = True
    temperature: float | None = None
    top_p: float | None = None
    progress: bool = True
    label: str | None = None
    workload_settings: dict = field(default_factory=dict)
    structured_fraction: float = 0.0
    response_format: dict | None = None  # sent by the structured requests; None: EXTRACTION_RESPONSE_FORMAT

    def validate(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint: expected completions or chat, got {self.endpoint!r}")
        if self.arrival == "none" and not self.concurrency:
            raise ValueError("concurrency: a closed loop (--arrival none) needs --concurrency N")
        if self.arrival in ("poisson", "gamma") and not self.rate:
            raise ValueError(f"rate: {self.arrival} arrivals need --rate")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"burstiness: must be > 0 (the gamma shape), got {self.burstiness!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency: must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests: must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("duration: must be > 0 seconds")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p: must be in (0, 1]")
        if not (math.isfinite(self.structured_fraction) and 0.0 <= self.structured_fraction <= 1.0):
            raise ValueError(f"structured_fraction: must be in [0, 1], got {self.structured_fraction!r}")


@dataclass
class BenchResult:
    records: list[RequestRecord]
    summary: dict
    started_at: float  # POSIX time of the start
    files: list[str] = field(default_factory=list)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _resolve_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    return first_model_id(str(r.request.url), r)


def listed_model_ids(r: httpx.Response) -> list[str] | None:
    """The model names a /v1/models answer lists; None when the answer is not such a list (a server
    without the route, or not OpenAI-shaped), so that nothing can be checked against it."""
    if r.status_code != 200:
        return None
    try:
        data = r.json().get("data")
    except (ValueError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] or None


def first_model_id(url: str, r: httpx.Response) -> str:
    """The first model a /v1/models answer lists; a ValueError saying what is wrong with the answer
    (not JSON, no models, a model without an id) otherwise."""
    r.raise_for_status()
    try:
        doc = r.json()
    except ValueError:
        raise ValueError(f"{url}: the answer is not JSON: not an OpenAI-compatible server? "
                         f"(or pass --model)") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{url}: the server lists no models; pass --model")
    first = data[0]
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        raise ValueError(f"{url}: the first model has no 'id'; pass --model")
    return first["id"]


def request_count(cfg: BenchConfig) -> int | None:
    """Requests to prepare: the cap given; for a duration, enough for it at the rate (all of a
    trace's requests that arrive within it; 1000 for a closed loop); else 200."""
    if cfg.num_requests is not None:
        return cfg.num_requests
    if cfg.duration is not None and cfg.arrival == "trace":
        return None
    if cfg.rate == math.inf:  # every request at time 0: a duration bounds nothing
        return 200
    if cfg.duration is not None and cfg.rate:
        return int(cfg.rate * cfg.duration * 1.5) + 16
    if cfg.duration is not None:
        return 1000  # closed loop for a duration: the report says if it ran out first
    return 200


def prepare_workload(cfg: BenchConfig) -> Workload:
    """The workload to send: capped, arrival times assigned, and (open loop) cut at the duration,
    so that no prompt is made for a request that will not be sent."""
    n = request_count(cfg)
    w = cfg.workload or builtin_workload("chat", n or 200, cfg.seed)
    if n is not None and len(w.requests) > n:
        w = replace(w, requests=w.requests[:n])
    w = assign_arrivals(w, cfg.arrival, cfg.rate, cfg.seed, cfg.burstiness)
    if cfg.duration is not None and cfg.arrival != "none":
        within = tuple(r for r in w.requests if (r.arrival_time or 0.0) <= cfg.duration)
        if within and len(within) == len(w.requests):  # the workload, not the duration, ends the sends
            w = w.with_note(f"all {len(within)} requests of the workload arrive before the {cfg.duration:g}s "
                            "duration ends: it ran out first")
        w = replace(w, requests=within)
    if not w.requests:
        raise ValueError("workload: no requests to send")
    return w


def _make_tokenizer(cfg: BenchConfig, model: str) -> tuple[Tokenizer | None, str | None]:
    """The tokenizer, and why the server's /tokenize was not used when `auto` fell back to the estimate."""
    if cfg.tokenizer == "none":
        return None, None
    if cfg.tokenizer == "auto":
        return ServerTokenizer.probe_explained(cfg.base_url, model, auth_headers(cfg.api_key))
    return LocalTokenizer(cfg.tokenizer), None


def structured_indices(n: int, fraction: float, seed: int) -> frozenset[int]:
    """Which of `n` requests carry the response format: round(fraction * n) of them, drawn by the
    seed alone (the same seed, the same requests), spread over the run rather than in one block."""
    k = round(fraction * n)
    return frozenset(random.Random(f"structured:{seed}").sample(range(n), k))


def response_format_name(cfg: BenchConfig) -> str:
    """The response format the structured requests send, by its schema's name (else its type)."""
    fmt = cfg.response_format or EXTRACTION_RESPONSE_FORMAT
    schema = fmt.get("json_schema")
    return str(schema.get("name") if isinstance(schema, dict) and schema.get("name") else fmt.get("type"))


def _body(cfg: BenchConfig, model: str, req: WorkloadRequest, text: str | None, structured: bool = False) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": req.output_tokens}
    if cfg.force_output_lengths:
        # vLLM and cadence honour both; llama.cpp honours ignore_eos; the rest is detected.
        body.update(ignore_eos=True, min_tokens=req.output_tokens)
    if cfg.endpoint == "chat":
        msgs = req.messages if req.messages is not None else (("user", text or ""),)
        body["messages"] = [{"role": r, "content": c} for r, c in msgs]
    else:
        body["prompt"] = text if text is not None else "\n".join(c for _, c in req.messages or ())
    if req.tenant != "default":
        body["user"] = req.tenant
    if req.priority:
        body["priority"] = req.priority
    if req.deadline is not None:
        body["deadline"] = req.deadline  # seconds after the server receives it
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    if structured:
        body["response_format"] = cfg.response_format or EXTRACTION_RESPONSE_FORMAT
    return body


def _float_header(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP-date Retry-After, or junk: not worth guessing


def _on_event(rec: RequestRecord, obj: dict, now: float) -> None:
    """Fold one SSE event into the record."""
    if obj.get("error"):
        err = obj["error"]
        rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
        return
    for choice in obj.get("choices") or ():
        piece = choice.get("text")
        if piece is None:
            delta = choice.get("delta") or {}
            piece = delta.get("content") or delta.get("reasoning_content")
        if piece:
            if rec.first_token_time is None:
                rec.first_token_time = now
            rec.token_times.append(now)
            rec.text += piece
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
            rec.finish_time = now  # an EOS token's chunk has no text: TPOT's span ends here
    usage = obj.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens, rec.output_count_source = int(usage["completion_tokens"]), "usage"
        rec.server_prompt_tokens = usage.get("prompt_tokens")
        if usage.get("queue_time") is not None:
            rec.queue_time = float(usage["queue_time"])
    timings = obj.get("timings")  # llama.cpp's own per-request counters
    if timings and timings.get("predicted_n") is not None and rec.output_count_source != "usage":
        rec.output_tokens, rec.output_count_source = int(timings["predicted_n"]), "timings"


async def _stream(client: httpx.AsyncClient, path: str, body: dict, headers: dict, rec: RequestRecord,
                  t0: float) -> None:
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        rec.status = resp.status_code
        rec.queue_time = _float_header(resp.headers.get("x-queue-time"))
        if resp.status_code != 200:
            rec.retry_after = _float_header(resp.headers.get("retry-after"))
            rec.error = f"HTTP {resp.status_code}: {report.error_detail(await resp.aread())}"
            rec.end_time = time.perf_counter() - t0
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                continue
            _on_event(rec, obj, time.perf_counter() - t0)
        rec.end_time = time.perf_counter() - t0


async def _send_one(client: httpx.AsyncClient, cfg: BenchConfig, model: str, req: WorkloadRequest,
                    text: str | None, rec: RequestRecord, t0: float) -> None:
    headers = {"X-Tenant": req.tenant} if req.tenant != "default" else {}
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    rec.send_time = time.perf_counter() - t0
    try:
        await _stream(client, path, _body(cfg, model, req, text, rec.structured), headers, rec, t0)
    except asyncio.CancelledError:
        rec.error = "cancelled: still running when the drain timeout ended the run"
        raise
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"


def _new_record(i: int, req: WorkloadRequest) -> RequestRecord:
    return RequestRecord(index=i, tenant=req.tenant, priority=req.priority, deadline=req.deadline,
                         prompt_tokens=req.prompt_tokens, output_tokens_asked=req.output_tokens,
                         scheduled_time=req.arrival_time)


async def _drain(tasks: list[asyncio.Task], timeout: float) -> None:
    """Wait for in-flight requests; cancel what is still running after `timeout` seconds."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def _open_loop(send, reqs: tuple[WorkloadRequest, ...], cfg: BenchConfig, t0: float) -> None:
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None

    async def one(i: int) -> None:
        if sem is None:
            await send(i)
            return
        async with sem:  # the wait here shows up as send_time - scheduled_time
            await send(i)

    tasks = []
    for i, req in enumerate(reqs):
        at = req.arrival_time or 0.0
        if cfg.duration is not None and at > cfg.duration:
            break
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await _drain(tasks, cfg.drain_timeout)


async def _closed_loop(send, n: int, cfg: BenchConfig, t0: float) -> None:
    next_index = iter(range(n))

    async def user() -> None:
        for i in next_index:  # shared iterator: each index is taken by exactly one user
            if cfg.duration is not None and time.perf_counter() - t0 > cfg.duration:
                return
            await send(i)

    users = [asyncio.create_task(user()) for _ in range(cfg.concurrency or 1)]
    if cfg.duration is None:
        await asyncio.gather(*users)
    else:
        _, pending = await asyncio.wait(users, timeout=cfg.duration)
        await _drain(list(pending), cfg.drain_timeout)


def _count_outputs(records: list[RequestRecord], builder: PromptBuilder) -> None:
    """Output tokens for requests without usage: re-tokenize the text, else count chunks."""
    for rec in records:
        if rec.output_count_source in ("usage", "timings"):
            continue
        n = builder.count_tokens(rec.text) if rec.text else None
        if n is not None:
            rec.output_tokens, rec.output_count_source = n, "tokenize"
        else:
            rec.output_tokens, rec.output_count_source = len(rec.token_times), "chunks"


async def run_benchmark_async(cfg: BenchConfig) -> BenchResult:
    """Run one benchmark; prompts are made (and outputs counted) off the event loop."""
    cfg.validate()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # never throttle the load
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=auth_headers(cfg.api_key),
                                 limits=limits, timeout=timeout) as client:
        model = cfg.model or await _resolve_model(client)
        workload = prepare_workload(cfg)
        tokenizer, refused = await asyncio.to_thread(_make_tokenizer, cfg, model)
        builder = PromptBuilder(tokenizer, cfg.seed, tokenizer_refused=refused)
        texts = await asyncio.to_thread(builder.build_all, workload)
        records = [_new_record(i, r) for i, r in enumerate(workload.requests)]
        for i in structured_indices(len(records), cfg.structured_fraction, cfg.seed):
            records[i].structured = True
        bar = tqdm(total=len(records), disable=not cfg.progress, desc=cfg.label or "bench", unit="req")
        spec_before = await spec.read_counters(client)
        t0, started_at = time.perf_counter(), time.time()

        async def send(i: int) -> None:
            await _send_one(client, cfg, model, workload.requests[i], texts[i], records[i], t0)
            bar.update(1)

        if cfg.arrival == "none":
            await _closed_loop(send, len(records), cfg, t0)
        else:
            await _open_loop(send, workload.requests, cfg, t0)
        bar.close()
        spec_after = await spec.read_counters(client) if spec_before is not None else None
    sent = [r for r in records if r.send_time is not None]
    await asyncio.to_thread(_count_outputs, sent, builder)
    if isinstance(tokenizer, ServerTokenizer):
        tokenizer.close()
    meta = _meta(cfg, model, workload, builder, len(sent), len(records))
    result = BenchResult(sent, report.summarize(sent, cfg.slos, meta), started_at)
    speculative = spec.summarize(spec_before, spec_after)
    result.summary["speculative"] = speculative
    if speculative is None and spec_after is not None and spec_after.speculates and cfg.force_output_lengths:
        result.summary["meta"]["notes"].append(spec.EXACT_LENGTH_HINT)
    if refused:
        result.summary["warnings"].append(f"the server's /tokenize refused ({refused}): prompt sizes are an "
                                          "estimate of 4 characters per token")
    if cfg.out_dir:
        result.files = write_outputs(result, cfg.out_dir)
    return result


def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Synchronous entry point (the CLI, and the lead's in-process end-to-end test)."""
    return asyncio.run(run_benchmark_async(cfg))


def _meta(cfg: BenchConfig, model: str, w: Workload, builder: PromptBuilder, sent: int, prepared: int) -> dict:
    notes = [*w.notes, f"prompts: {builder.method}"]
    if builder.inexact:
        notes.append(f"{len(builder.inexact)} prompts could not be cut to their exact size (wanted, got): "
                     f"{builder.inexact[:5]}")
    # Open loop: `prepare_workload` already cut the workload at the duration (and said so if it ran
    # out first), so every prepared request is sent unless a --concurrency cap still held it back.
    if cfg.duration is not None and cfg.arrival == "none" and sent == prepared:
        notes.append(f"all {prepared} prepared requests were sent before the {cfg.duration:g}s duration ended")
    if cfg.structured_fraction:
        notes.append(f"{round(cfg.structured_fraction * prepared)} of {counted(prepared, 'request')} sent "
                     f"response_format {response_format_name(cfg)!r}")
    if cfg.arrival != "none" and sent < prepared:
        notes.append(f"{prepared - sent} of {counted(prepared, 'request')} never sent: still waiting for one of the "
                     f"{cfg.concurrency} --concurrency slots when the drain timeout ended the run")
    return {
        "label": cfg.label, "base_url": cfg.base_url, "model": model, "endpoint": cfg.endpoint,
        "workload": w.name, "arrival": cfg.arrival, "rate": report.json_rate(cfg.rate),
        "burstiness": cfg.burstiness, "concurrency": cfg.concurrency, "num_requests": cfg.num_requests,
        "duration": cfg.duration, "seed": cfg.seed, "force_output_lengths": cfg.force_output_lengths,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "tokenizer": cfg.tokenizer,
        "structured_fraction": cfg.structured_fraction,
        "response_format": response_format_name(cfg) if cfg.structured_fraction else None,
        **cfg.workload_settings, "notes": notes,
    }


def write_outputs(result: BenchResult, out_dir: str | Path) -> list[str]:
    """summary.json (the report), requests.jsonl (every record) and latency_cdf.png."""
    from cadence.bench.plots import plot_latency_cdfs  # matplotlib only when files are asked for

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(result.summary, started_at=result.started_at)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (out / "requests.jsonl").open("w") as f:
        for rec in result.records:
            f.write(json.dumps(rec.to_dict()) + "\n")
    plot_latency_cdfs(result.records, out / "latency_cdf.png", result.summary["meta"].get("label") or "")
    return [str(out / n) for n in ("summary.json", "requests.jsonl", "latency_cdf.png")]
