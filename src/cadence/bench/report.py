"""What a benchmark run measured: per-request records in, distributions and goodput out.

Percentiles use linear interpolation between closest ranks, numpy's default ("linear"): for n
sorted values x[0..n-1] and q in [0, 100], h = (n - 1) * q / 100 and the result is
x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]). Plain Python, so a test can check
it by hand; `distribution` sorts with numpy (a simulated run pools tens of millions of inter-token
gaps) and applies the same formula to the sorted values.

Definitions (all in seconds, per request, measured by the client):
- TTFT: first non-empty token chunk minus send time.
- ITL: gaps between consecutive token chunks (pooled over all requests for the distribution).
- TPOT: (last token - first token chunk) / (output tokens - 1), requests with >= 2 tokens. The
  last token is the last token chunk, or, when the server counted the tokens (usage, timings) and
  the stream ended with finish_reason stop or length in a chunk of its own, that chunk: an EOS
  token streams no text but is counted among the output tokens, so the span must include its step.
- E2E: end of stream minus send time.
- queue: what the server reports (x-queue-time header or usage.queue_time), when it does.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from cadence.bench.speculative import format_lines as spec_lines
from cadence.wording import counted

PERCENTILES = (50, 90, 95, 99)
_TOKEN_FINISHES = ("stop", "length")  # a stream ends on a generated token (EOS, stop string, the cap)
_SERVER_COUNTS = ("usage", "timings")  # counts that include a token that streams no text (EOS)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e", "queue")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the start of the run."""

    index: int
    tenant: str = "default"
    priority: int = 0
    deadline: float | None = None
    prompt_tokens: int = 0  # as planned by the workload
    output_tokens_asked: int = 0
    scheduled_time: float | None = None  # when the workload said to send (open loop)
    send_time: float | None = None
    first_token_time: float | None = None
    # Every non-empty chunk's time. The simulator keeps them in an `array('d')`: tens of millions
    # of them as list items would be float objects that every full garbage collection walks.
    token_times: MutableSequence[float] = field(default_factory=list)
    end_time: float | None = None
    finish_time: float | None = None  # when the chunk carrying finish_reason arrived
    output_tokens: int = 0
    output_count_source: str = "chunks"  # usage | timings | tokenize | chunks
    server_prompt_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    retry_after: float | None = None
    queue_time: float | None = None
    finish_reason: str | None = None
    structured: bool = False  # sent with a response_format (--structured-fraction)
    text: str = ""  # generated text: kept for counting tokens, not written out

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end_time is not None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None or self.send_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        if not self.ok or self.send_time is None or self.end_time is None:
            return None
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        last = self.last_token_time
        if not self.ok or self.output_tokens < 2 or len(self.token_times) < 2 or last is None:
            return None
        return (last - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def last_token_time(self) -> float | None:
        """When the last of the `output_tokens` was streamed: the last text chunk, or a later chunk
        that ends the stream without text (an EOS token) when the server's count includes it."""
        last = self.token_times[-1] if len(self.token_times) else None
        if (self.finish_time is not None and self.finish_reason in _TOKEN_FINISHES
                and self.output_count_source in _SERVER_COUNTS):
            return self.finish_time if last is None else max(last, self.finish_time)
        return last

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["text"]
        d["token_times"] = list(self.token_times)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(**{k: v for k, v in d.items() if k != "text"})


def error_detail(body: bytes) -> str:
    """The message of an error answer: OpenAI's error.message, FastAPI's detail, else the text."""
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        return text.strip()[:200]
    if isinstance(doc, dict):
        err = doc.get("error")
        found = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
        found = found or doc.get("detail") or doc.get("message")
        if found:
            return str(found)[:200]
    return text.strip()[:200]


def json_rate(rate: float | None) -> float | str | None:
    """A rate as JSON can hold it: an infinite one (every request at once) as "inf"."""
    return "inf" if rate == math.inf else rate


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; ValueError on no values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q!r}")
    return _sorted_percentile(sorted(values), q)


def _position(n: int, q: float) -> float:
    """Where percentile q falls among n sorted values (linear interpolation between ranks)."""
    return (n - 1) * q / 100.0


def _sorted_percentile(xs: Sequence[float] | np.ndarray, q: float) -> float:
    h = _position(len(xs), q)
    lo = math.floor(h)
    if lo + 1 >= len(xs):
        return float(xs[-1])
    return float(xs[lo] + (h - lo) * (xs[lo + 1] - xs[lo]))


def distribution(values: Iterable[float] | np.ndarray) -> dict:
    """count, mean, p50/p90/p95/p99, max; None for every statistic when there are no values.

    Sorted once, with numpy (partitioned at the ranks read, past 100,000 values): the percentiles
    are `percentile`'s, the mean numpy's (pairwise summation, so it may differ from a plain running
    sum in the last bits)."""
    arr = values if isinstance(values, np.ndarray) else np.fromiter(values, dtype=np.float64)
    arr = arr.astype(np.float64, copy=False)
    n = len(arr)
    if n > _PARTITION_FROM:
        # Tens of millions of gaps (a long simulation): place only the ranks the percentiles
        # read (np.partition, linear time) instead of sorting them all. Same percentiles: the
        # element at a placed rank is the sorted array's; the mean is summed in the given order.
        xs = np.partition(arr, sorted({r for q in PERCENTILES for r in _ranks(n, q)} | {n - 1}))
        mean = arr.mean()
    else:
        xs = np.sort(arr)
        mean = xs.mean() if n else None
    out: dict = {"count": n, "mean": float(mean) if n else None}
    for q in PERCENTILES:
        out[f"p{q}"] = _sorted_percentile(xs, q) if n else None
    out["max"] = float(xs[-1]) if n else None
    return out


_PARTITION_FROM = 100_000  # values; below it a sort costs less than it is worth avoiding


def _ranks(n: int, q: float) -> tuple[int, int]:
    """The two ranks `_sorted_percentile` reads for q."""
    lo = math.floor(_position(n, q))
    return lo, min(lo + 1, n - 1)


def pooled_itls(records: Iterable[RequestRecord]) -> np.ndarray:
    """Every record's gaps between token chunks, in one array (what `r.itls` gives, concatenated).

    Written record by record into one array allocated once: a long simulation has tens of
    millions of them, and building them from a concatenation of all the times (then differenced,
    then masked at the records' seams) made four arrays of that size, mostly first-touch page
    faults (x5 Azure: 1.8 s against about 0.5)."""
    times = [np.asarray(r.token_times, dtype=np.float64) for r in records]
    out = np.empty(sum(len(t) - 1 for t in times if len(t) > 1))
    pos = 0
    subtract = np.subtract
    for t in times:
        n = len(t) - 1
        if n > 0:
            subtract(t[1:], t[:-1], out=out[pos : pos + n])
            pos += n
    return out


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes all.

    All zeros count as perfectly fair (everyone equally starved). ValueError on no values or
    negative values, where the index means nothing.
    """
    if not values:
        raise ValueError("jain_index of no values")
    if any(v < 0 for v in values):
        raise ValueError("jain_index: values must be >= 0")
    sq = sum(v * v for v in values)
    if sq == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * sq)


def parse_slos(specs: Iterable[str]) -> dict[str, float]:
    """['ttft=0.5', 'e2e=10'] -> {'ttft': 0.5, 'e2e': 10.0}."""
    out: dict[str, float] = {}
    for spec in specs:
        key, sep, val = spec.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo {spec!r}: expected KEY=SECONDS with KEY in {SLO_KEYS}")
        try:
            bound = float(val)
        except ValueError:
            raise ValueError(f"--slo {spec!r}: {val!r} is not a number") from None
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"--slo {spec!r}: the bound must be > 0 seconds")
        out[key] = bound
    return out


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """A request counts for goodput when it succeeded and met every SLO given.

    ttft, tpot, e2e: the request's own value. itl: the request's longest gap between token chunks
    (a stall the user watches). queue: the server-reported queue time; a request without one
    fails a queue SLO, since it cannot be shown to meet it.
    """
    if not rec.ok:
        return False
    checks: dict[str, Callable[[], float | None]] = {
        "ttft": lambda: rec.ttft,
        "itl": lambda: max(rec.itls, default=0.0),
        "tpot": lambda: rec.tpot if rec.tpot is not None else 0.0,
        "e2e": lambda: rec.e2e,
        "queue": lambda: rec.queue_time,
    }
    for key, bound in slos.items():
        value = checks[key]()
        if value is None or value > bound:
            return False
    return True


def _span(records: Sequence[RequestRecord]) -> float:
    sent = [r.send_time for r in records if r.send_time is not None]
    ended = [r.end_time for r in records if r.end_time is not None]
    if not sent or not ended:
        return 0.0
    return max(ended) - min(sent)


def summarize_records(records: Sequence[RequestRecord], slos: dict[str, float], duration: float | None = None) -> dict:
    """Counts, rates and distributions of one group of requests over `duration` seconds."""
    span = duration if duration is not None else _span(records)
    ok = [r for r in records if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    prompt_tok = sum(r.server_prompt_tokens or r.prompt_tokens for r in ok)
    good = [r for r in ok if meets_slos(r, slos)]
    per_s = (lambda x: x / span) if span > 0 else (lambda x: None)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(1 for r in records if not r.ok),
        "rate_limited": sum(1 for r in records if r.status == 429),
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.output_tokens_asked),
        "duration_s": span,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(out_tok),
        "total_token_throughput": per_s(out_tok + prompt_tok),
        "output_tokens": out_tok,
        "prompt_tokens": prompt_tok,
        "goodput": per_s(len(good)) if slos else None,
        "goodput_fraction": (len(good) / len(records) if records else None) if slos else None,
        "ttft": distribution(r.ttft for r in ok if r.ttft is not None),
        "itl": distribution(pooled_itls(ok)),
        "tpot": distribution(r.tpot for r in ok if r.tpot is not None),
        "e2e": distribution(r.e2e for r in ok if r.e2e is not None),
        "queue": distribution(r.queue_time for r in ok if r.queue_time is not None),
    }


def _groups(records: Sequence[RequestRecord], key: Callable[[RequestRecord], object]) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = {}
    for r in records:
        out.setdefault(str(key(r)), []).append(r)
    return dict(sorted(out.items()))


def _fairness(groups: dict[str, dict]) -> dict:
    """Jain's index over groups of output tokens/s and of median TTFT (None with under 2 groups)."""
    if len(groups) < 2:
        return {"jain_output_throughput": None, "jain_ttft_p50": None}
    thr = [g["output_token_throughput"] or 0.0 for g in groups.values()]
    ttft = [g["ttft"]["p50"] for g in groups.values() if g["ttft"]["p50"] is not None]
    return {"jain_output_throughput": jain_index(thr), "jain_ttft_p50": jain_index(ttft) if len(ttft) >= 2 else None}


def _summarize_groups(records: Sequence[RequestRecord], key: Callable[[RequestRecord], object],
                      slos: dict[str, float], span: float, overall: dict) -> dict[str, dict]:
    """`summarize_records` per group. Per-group rates share the run's duration, so they add up to
    the overall rate. A single group holds every record in order: its summary is a copy of
    `overall`, not a second pass (which pools and sorts every inter-token gap again)."""
    groups = _groups(records, key)
    if len(groups) == 1:
        return {k: copy.deepcopy(overall) for k in groups}
    return {k: summarize_records(v, slos, span) for k, v in groups.items()}


# vLLM's `--percentile-metrics` names -> cadence's metric names.
VLLM_METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """One metric's values over the completed requests (itl: every gap between token chunks)."""
    ok = [r for r in records if r.ok]
    if metric == "itl":
        return pooled_itls(ok).tolist()
    get = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot, "e2e": lambda r: r.e2e,
           "queue": lambda r: r.queue_time}[metric]
    return [v for v in map(get, ok) if v is not None]


def format_percentiles(records: Sequence[RequestRecord], metrics: Sequence[str], percentiles: Sequence[float],
                       names: Sequence[str] | None = None) -> str:
    """Chosen percentiles of chosen metrics, in milliseconds (vLLM's `--metric-percentiles` table);
    each row is named by `names` (the user's spelling, e.g. e2el) when given, else by the metric."""
    lines = [f"{'metric (ms)':<12}" + "".join(f"{'p' + format(q, 'g'):>10}" for q in percentiles)]
    for m, name in zip(metrics, names or metrics, strict=True):
        values = sorted(metric_values(records, m))
        cells = [f"{'n/a':>10}" if not values else f"{_sorted_percentile(values, q) * 1000:>10.1f}"
                 for q in percentiles]
        lines.append(f"{name:<12}" + "".join(cells))
    return "\n".join(lines)


def summarize(records: Sequence[RequestRecord], slos: dict[str, float], meta: dict | None = None) -> dict:
    """The whole report: overall, per tenant, per priority class, fairness, warnings."""
    span = _span(records)
    overall = summarize_records(records, slos, span)
    tenants = _summarize_groups(records, lambda r: r.tenant, slos, span, overall)
    prios = _summarize_groups(records, lambda r: r.priority, slos, span, overall)
    return {
        "meta": dict(meta or {}),
        "slos": dict(slos),
        "overall": overall,
        "per_tenant": tenants,
        "per_priority": prios,
        "fairness": {"tenants": _fairness(tenants), "priorities": _fairness(prios)},
        "errors": _error_counts(records),
        "error_reasons": error_reasons(records),
        "warnings": _warnings(records, overall, (meta or {}).get("force_output_lengths", True)),
    }


def _error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = f"HTTP {r.status}" if r.status not in (None, 200) else (r.error or "incomplete").split(":")[0]
            out[key] = out.get(key, 0) + 1
    return out


ERROR_REASONS_SHOWN = 3
_REASON_CHARS = 120


def error_reasons(records: Sequence[RequestRecord], top: int = ERROR_REASONS_SHOWN) -> list[dict]:
    """The most common reasons requests failed (status and the server's message, truncated), with
    their counts, most common first (ties in order of first appearance)."""
    counts: dict[str, int] = {}
    for r in records:
        if not r.ok:
            reason = r.error or (f"HTTP {r.status}" if r.status not in (None, 200) else "incomplete stream")
            reason = reason if len(reason) <= _REASON_CHARS else reason[: _REASON_CHARS - 3] + "..."
            counts[reason] = counts.get(reason, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [{"reason": k, "count": n} for k, n in ranked]


def _format_error_reasons(summary: dict) -> list[str]:
    reasons = summary.get("error_reasons") or []
    if not reasons:
        return []
    kinds = len(summary.get("errors") or {})
    head = "errors by reason" + (" (most common first)" if len(reasons) > 1 or kinds > 1 else "") + ":"
    return [head, *(f"{r['count']:>8}  {r['reason']}" for r in reasons)]


def _warnings(records: Sequence[RequestRecord], overall: dict, exact_asked: bool = True) -> list[str]:
    """`exact_asked`: whether the requests carried ignore_eos/min_tokens (not with --no-exact-output,
    where a model stopping at its end-of-sequence token is what was asked for, not the server's fault)."""
    out = []
    if overall["short_outputs"]:
        short = [r for r in records if r.ok and r.output_tokens < r.output_tokens_asked]
        # Stopped at a stop token (or with no reason given): the server ignored ignore_eos/min_tokens.
        # Any other reason (a deadline, a length cap) is the server's own decision, said as such.
        eos = [r for r in short if r.finish_reason in (None, "stop") and not r.structured]
        # A request with a response_format stops where its output is complete, whatever ignore_eos says.
        complete = [r for r in short if r.finish_reason == "stop" and r.structured]
        if complete:
            out.append(f"{len(complete)} of {sum(r.ok and r.structured for r in records)} completed requests with a "
                       "response_format stopped before the asked length, where their output was complete; tokens/s "
                       "count what they produced")
        if eos and exact_asked:
            out.append(f"{len(eos)} of {overall['completed']} completed requests stopped before the asked length: "
                       "the server does not honour ignore_eos/min_tokens; tokens/s count what it produced")
        elif eos:
            out.append(f"{len(eos)} of {overall['completed']} completed requests stopped before max_tokens (no "
                       "ignore_eos/min_tokens sent: the model chose its length); tokens/s count what it produced")
        reasons: dict[str, int] = {}
        for r in short:
            if r.finish_reason not in (None, "stop"):
                reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
        if reasons:
            said = ", ".join(f"{n} with finish_reason {k!r}" for k, n in sorted(reasons.items()))
            out.append(f"the server ended requests before the asked length: {said}")
    sources: dict[str, int] = {}
    for r in records:
        if r.ok:
            sources[r.output_count_source] = sources.get(r.output_count_source, 0) + 1
    if any(s != "usage" for s in sources):
        how = ", ".join(f"{n} from {s}" for s, n in sorted(sources.items()))
        out.append(f"output token counts: {how} (usage is the server's own count; tokenize re-counts the "
                   "text; chunks assumes one token per streamed chunk)")
    if overall["rate_limited"]:
        out.append(f"{counted(overall['rate_limited'], 'request')} refused with HTTP 429")
    starved = client_starvation(records)
    if starved:
        out.append(starved)
    return out


# A server sends one stream's chunks at least a decode step apart (milliseconds); chunks read less
# than this apart were waiting together in the socket, because their reader could not run.
BUFFERED_GAP_S = 1e-4
_MIN_BURST_GAPS = 2  # at least three chunks read at once
_SAME_MOMENT_S = 2e-3  # stalls of two streams ending this close ended together


def _stall_ends(rec: RequestRecord, stall_s: float) -> list[tuple[float, float]]:
    """(when, how long) of each stall of at least `stall_s` that a burst of buffered chunks follows."""
    t = np.asarray(rec.token_times, dtype=float)
    g = np.diff(t)
    ends = []
    for i in np.flatnonzero(g >= stall_s):
        burst = g[i + 1 : i + 1 + _MIN_BURST_GAPS]
        if len(burst) == _MIN_BURST_GAPS and bool(np.all(burst < BUFFERED_GAP_S)):
            ends.append((float(t[i + 1]), float(g[i])))
    return ends


def client_starvation(records: Sequence[RequestRecord]) -> str | None:
    """A warning when the benchmark client (or the server's HTTP loop) was starved of CPU: streams
    stall, then their chunks arrive in bursts under 0.1 ms apart, and the stalls end at the same
    moments across streams (one starved process reading every socket at once). The ITLs measured
    are then the machine's contention, not the engine's steps."""
    ok = [r for r in records if r.ok and len(r.token_times) > _MIN_BURST_GAPS + 1]
    gaps = pooled_itls(ok)
    if not len(gaps) or not bool(np.any(gaps < BUFFERED_GAP_S)):
        return None  # the usual case, decided without looking at each stream
    steps = gaps[gaps >= BUFFERED_GAP_S]
    stall_s = 2.0 * float(np.median(steps)) if len(steps) else BUFFERED_GAP_S
    ends = sorted((when, stall, k) for k, r in enumerate(ok) for when, stall in _stall_ends(r, stall_s))
    shared = {k for a, b in zip(ends, ends[1:], strict=False) if b[0] - a[0] <= _SAME_MOMENT_S and a[2] != b[2]
              for k in (a[2], b[2])}
    if len(shared) < 2:
        return None
    longest = max(stall for _, stall, k in ends if k in shared)
    return (f"the client was starved of CPU: {len(shared)} of {len(ok)} streams stalled (up to "
            f"{longest * 1e3:.0f} ms) and then got bursts of chunks under 0.1 ms apart, the stalls ending at "
            "the same moments across streams; ITL and TPOT measure that contention, not the server's steps "
            "(run the client on another machine, or with fewer streams)")


def format_table(summary: dict) -> str:
    """The report for people: one block of distributions, then groups and warnings."""
    o = summary["overall"]
    lines = [f"requests {o['requests']}  completed {o['completed']}  errors {o['errors']}  "
             f"429s {o['rate_limited']}  duration {o['duration_s']:.2f}s"]

    def rate(v: float | None, unit: str) -> str:
        return "n/a" if v is None else f"{v:.3f} {unit}"

    lines.append(f"throughput {rate(o['request_throughput'], 'req/s')}  output {rate(o['output_token_throughput'], 'tok/s')}  "
                 f"total {rate(o['total_token_throughput'], 'tok/s')}")
    lines += spec_lines(summary.get("speculative"))
    if summary["slos"]:
        slo = " ".join(f"{k}<={v:g}s" for k, v in summary["slos"].items())
        lines.append(f"goodput {rate(o['goodput'], 'req/s')} ({(o['goodput_fraction'] or 0) * 100:.1f}% of requests meet {slo})")
    names = [n for n in ("ttft", "itl", "tpot", "e2e", "queue") if o[n]["count"]]
    stats = ("mean", "p50", "p90", "p95", "p99", "max")
    # Milliseconds, unless a value would fill its column (a simulated day of queueing): seconds.
    longest = max((o[n][k] or 0.0 for n in names for k in stats), default=0.0)
    unit, scale = ("s", 1.0) if longest >= 1000.0 else ("ms", 1000.0)
    lines.append(f"{f'metric ({unit})':<12}" + "".join(f"{h:>10}" for h in ("count", *stats)))
    for name in names:
        d = o[name]
        cells = [f"{d['count']:>10}"] + [f" {d[k] * scale:>9.1f}" for k in stats]
        lines.append(f"{name:<12}" + "".join(cells))
    lines += _format_error_reasons(summary)
    for title, groups, fair in (("tenant", summary["per_tenant"], summary["fairness"]["tenants"]),
                                ("priority", summary["per_priority"], summary["fairness"]["priorities"])):
        if len(groups) < 2:
            continue
        lines.append(f"{title:<12}{'done':>8}{'err':>6}{'tok/s':>10}{'ttft p50':>10}{'ttft p95':>10}{'e2e p95':>10}")
        for k, g in groups.items():
            cells = [_ms(g["ttft"]["p50"]), _ms(g["ttft"]["p95"]), _ms(g["e2e"]["p95"])]
            lines.append(f"{k:<12}{g['completed']:>8}{g['errors']:>6}{g['output_token_throughput'] or 0:>10.2f}" + "".join(cells))
        lines.append(f"  Jain's index: output tok/s {_num(fair['jain_output_throughput'])}, "
                     f"ttft p50 {_num(fair['jain_ttft_p50'])}")
    lines += [f"warning: {w}" for w in summary["warnings"]]
    lines += [f"note: {n}" for n in summary["meta"].get("notes", [])]
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return f"{'n/a':>10}" if v is None else f"{v * 1000:>10.1f}"


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


COMPARE_ROWS = (
    ("request_throughput", "req/s"), ("output_token_throughput", "tok/s"), ("total_token_throughput", "tok/s"),
    ("goodput", "req/s"), ("ttft.p50", "s"), ("ttft.p95", "s"), ("ttft.p99", "s"), ("itl.p50", "s"),
    ("itl.p95", "s"), ("tpot.p50", "s"), ("tpot.p95", "s"), ("e2e.p50", "s"), ("e2e.p95", "s"),
    ("queue.p95", "s"), ("errors", ""), ("rate_limited", ""),
)


def _lookup(overall: dict, path: str) -> float | None:
    v: object = overall
    for part in path.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return v if isinstance(v, (int, float)) else None


def compare(a: dict, b: dict, label_a: str = "A", label_b: str = "B") -> str:
    """Side-by-side: each metric in A and B and the ratio B/A (n/a where either is missing)."""
    oa, ob = a["overall"], b["overall"]
    lines = [f"{'metric':<34}{label_a:>14}{label_b:>14}{'B/A':>9}"]
    for path, unit in COMPARE_ROWS:
        va, vb = _lookup(oa, path), _lookup(ob, path)
        if va is None and vb is None:
            continue
        ratio = f"{vb / va:.3f}" if va and vb is not None else "n/a"
        name = f"{path} ({unit})" if unit else path
        lines.append(f"{name:<34}{_fmt(va):>14}{_fmt(vb):>14}{ratio:>9}")
    return "\n".join(lines)


# The benchmark settings a summary's `meta` records, every one that changes what is sent; two runs
# compared should differ in one at most (or only in the server's own settings, which `meta` does not see).
COMPARED_SETTINGS = ("model", "endpoint", "workload", "workload_source", "random_input_len", "random_output_len",
                     "random_range_ratio", "scale_lengths", "scale_output", "max_prompt_tokens", "max_output_tokens",
                     "time_scale", "tokenizer", "arrival", "rate", "burstiness", "concurrency", "num_requests",
                     "duration", "seed", "force_output_lengths", "temperature", "top_p", "structured_fraction",
                     "response_format")


def setting_differences(meta_a: dict, meta_b: dict) -> list[str]:
    """`name: A vs B` for each recorded benchmark setting in which two runs differ. A setting only
    one of them recorded (a summary written before it was recorded) is not compared."""
    return [f"{k}: {meta_a.get(k)} vs {meta_b.get(k)}" for k in COMPARED_SETTINGS
            if k in meta_a and k in meta_b and meta_a[k] != meta_b[k]]


def compare_warnings(a: dict, b: dict) -> list[str]:
    """Warn when two runs differ in more than one benchmark setting: the ratios then mix the effects."""
    diffs = setting_differences(a.get("meta", {}), b.get("meta", {}))
    if len(diffs) <= 1:
        return [f"note: the runs differ in {diffs[0]}"] if diffs else []
    return [f"warning: the runs differ in {len(diffs)} settings ({'; '.join(diffs)}): the ratios mix their "
            "effects; compare runs that differ in one setting"]


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
