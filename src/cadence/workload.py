"""One workload format, read by the benchmark client and the simulator.

A workload is a sequence of `WorkloadRequest`s: sizes in tokens, an optional arrival time, and the
scheduling attributes a server may honour (tenant, priority, deadline). Sources: seeded built-in
mixes, the real traces in traces/ (shipped in the repository) (Azure LLM 2023 CSV, Mooncake JSONL), and a user's JSONL.
Everything here is deterministic for a given seed and imports only the standard library, because
the simulator reuses it without the benchmark's dependencies.
"""

from __future__ import annotations

import calendar
import csv
import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ARRIVALS = ("poisson", "gamma", "trace", "none")
BUILTIN_WORKLOADS = ("chat", "shared-prefix", "long-prompt-mix", "mixed-tenants")
MOONCAKE_BLOCK_TOKENS = 512  # the Mooncake release hashes prompts in blocks of 512 tokens
_HEADER_KEY = "cadence_workload"  # marks the optional first line of a workload JSONL


# cadence.request's is_int / is_finite, repeated: this module imports only the standard library
# (tests/unit/test_workload.py), so that it can be read without the engine.
def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, kw_only=True)
class WorkloadRequest:
    """One request of a workload.

    `arrival_time` is seconds from the start of the run, or None when the load generator assigns
    arrivals (Poisson, gamma) or runs closed loop. `prefix_group` holds block ids, Mooncake-style:
    two requests whose leading ids are equal share that many blocks of prompt text
    (`Workload.prefix_block_tokens` tokens each). `priority`: lower values are served first, as in
    vLLM. `deadline`: seconds after arrival by which the request should finish. `messages` is a
    tuple of (role, content) pairs for the chat endpoint; `prompt` is explicit text; without
    either, the benchmark writes real text of `prompt_tokens` tokens.
    """

    arrival_time: float | None = None
    prompt_tokens: int
    output_tokens: int
    prefix_group: tuple[int, ...] = ()
    tenant: str = "default"
    priority: int = 0
    deadline: float | None = None
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_group, tuple):
            if not isinstance(self.prefix_group, (list, range)) or not all(_is_int(i) for i in self.prefix_group):
                raise ValueError(f"prefix_group: must be a list of integer block ids, got {self.prefix_group!r:.60}")
            object.__setattr__(self, "prefix_group", tuple(self.prefix_group))
        if self.messages is not None and not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple((str(r), str(c)) for r, c in self.messages))
        if self.arrival_time is not None and not (_is_number(self.arrival_time) and self.arrival_time >= 0):
            raise ValueError(f"arrival_time: must be a finite number >= 0, got {self.arrival_time!r}")
        if not _is_int(self.prompt_tokens) or self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens: must be an integer >= 1, got {self.prompt_tokens!r}")
        if not _is_int(self.output_tokens) or self.output_tokens < 1:
            raise ValueError(f"output_tokens: must be an integer >= 1, got {self.output_tokens!r}")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError("tenant: must be a non-empty string")
        if not _is_int(self.priority):
            raise ValueError(f"priority: must be an integer, got {self.priority!r}")
        if self.deadline is not None and not (_is_number(self.deadline) and self.deadline > 0):
            raise ValueError(f"deadline: must be a number of seconds > 0, got {self.deadline!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: default fields are left out to keep files small."""
        out = {k: v for k, v in asdict(self).items() if v is not None and v != () and v != []}
        if out.get("tenant") == "default":
            del out["tenant"]
        if out.get("priority") == 0:
            del out["priority"]
        if self.prefix_group:
            out["prefix_group"] = list(self.prefix_group)
        if self.messages is not None:
            out["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadRequest:
        known = {"arrival_time", "prompt_tokens", "output_tokens", "prefix_group", "tenant", "priority",
                 "deadline", "prompt", "messages"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        d = dict(d)
        if "messages" in d and d["messages"] is not None:
            msgs = d["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise ValueError("messages: must be a non-empty list of {'role': str, 'content': str} objects")
            for i, m in enumerate(msgs):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise ValueError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r:.60}")
            d["messages"] = tuple((m["role"], m["content"]) for m in msgs)
        if d.get("prompt") is not None and not isinstance(d["prompt"], str):
            raise ValueError(f"prompt: must be a string, got {d['prompt']!r:.60}")
        if "prompt_tokens" not in d:
            # Explicit text without a size: estimate at 4 characters per token (the benchmark
            # reports the server's own count from usage when it sends one).
            text = d.get("prompt") or " ".join(c for _, c in d.get("messages") or ())
            if not text:
                raise ValueError("prompt_tokens: required unless prompt or messages is given")
            d["prompt_tokens"] = max(1, len(text) // 4)
        return cls(**d)


@dataclass(frozen=True)
class Workload:
    """Requests plus how they were made. `notes` say, in words, every scaling applied."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    prefix_block_tokens: int = 16
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.requests, tuple):
            object.__setattr__(self, "requests", tuple(self.requests))
        if self.prefix_block_tokens < 1:
            raise ValueError("prefix_block_tokens: must be >= 1")

    def __len__(self) -> int:
        return len(self.requests)

    def with_note(self, note: str) -> Workload:
        return replace(self, notes=(*self.notes, note))


# ---------------------------------------------------------------------------------------------
# Arrival processes


def interarrival_gaps(process: str, rate: float, rng: random.Random, burstiness: float = 1.0) -> Iterator[float]:
    """Endless gaps (seconds) between arrivals with mean 1/rate.

    poisson: exponential gaps. gamma: gamma gaps of shape `burstiness` (vLLM's `--burstiness`):
    1 is Poisson again, below 1 burstier (coefficient of variation 1/sqrt(burstiness) > 1), above
    1 smoother, tending to evenly spaced arrivals.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate: must be > 0 requests/s, got {rate!r}")
    if process == "poisson":
        while True:
            yield rng.expovariate(rate)
    elif process == "gamma":
        if not (math.isfinite(burstiness) and burstiness > 0):
            raise ValueError(f"burstiness: the gamma shape must be > 0, got {burstiness!r}")
        scale = 1.0 / (rate * burstiness)  # mean = shape * scale = 1/rate
        while True:
            yield rng.gammavariate(burstiness, scale)
    else:
        raise ValueError(f"arrival: expected poisson or gamma for generated gaps, got {process!r}")


def arrival_times(n: int, process: str, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """The first n arrival times (seconds from start); the first request arrives at t=0.
    An infinite rate (vLLM's `--request-rate inf`) puts every arrival at t=0."""
    if n < 0:
        raise ValueError("n: must be >= 0")
    if rate == math.inf:
        return [0.0] * n
    gaps = interarrival_gaps(process, rate, random.Random(seed), burstiness)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += next(gaps)
        times.append(t)
    return times


def assign_arrivals(workload: Workload, process: str, rate: float | None = None, seed: int = 0,
                    burstiness: float = 1.0) -> Workload:
    """Give every request an arrival time: generated (poisson, gamma; all at t=0 for rate inf),
    kept (trace) or none."""
    if process not in ARRIVALS:
        raise ValueError(f"arrival: expected one of {ARRIVALS}, got {process!r}")
    if process == "trace":
        if any(r.arrival_time is None for r in workload.requests):
            raise ValueError("arrival trace: the workload has requests without arrival times")
        return workload
    if process == "none":
        reqs = tuple(replace(r, arrival_time=None) for r in workload.requests)
        return replace(workload, requests=reqs).with_note("closed loop: no arrival times")
    if rate is None:
        raise ValueError(f"rate: required for {process} arrivals")
    times = arrival_times(len(workload.requests), process, rate, seed, burstiness)
    reqs = tuple(replace(r, arrival_time=t) for r, t in zip(workload.requests, times, strict=True))
    if rate == math.inf:
        how = f"request rate inf: all {len(reqs)} requests arrive at time 0 (sent at once)"
    else:
        how = f"{process} arrivals at {rate:g} req/s, seed {seed}"
        if process == "gamma":
            how += f", burstiness {burstiness:g} (gamma shape; 1 = Poisson, < 1 burstier)"
    return replace(workload, requests=reqs).with_note(how)


# ---------------------------------------------------------------------------------------------
# Built-in workloads (arrival times left to the load generator)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def _chat_output(rng: random.Random) -> int:
    """Mostly short answers with a long tail: 70% ~32 tokens, 25% ~128, 5% ~512."""
    u = rng.random()
    median = 32 if u < 0.70 else 128 if u < 0.95 else 512
    return _lognormal_int(rng, median, 0.5, 4, 1024)


def _chat_request(rng: random.Random, **kw: Any) -> WorkloadRequest:
    return WorkloadRequest(prompt_tokens=_lognormal_int(rng, 96, 0.6, 8, 1024), output_tokens=_chat_output(rng), **kw)


def _shared_prefix(rng: random.Random, n: int) -> list[WorkloadRequest]:
    # One 1024-token system prompt (16 blocks of 64) shared by all; a short question each.
    system = tuple(range(16))
    return [WorkloadRequest(prompt_tokens=1024 + _lognormal_int(rng, 32, 0.4, 8, 128),
                            output_tokens=_lognormal_int(rng, 48, 0.5, 8, 256), prefix_group=system)
            for _ in range(n)]


def _long_prompt_mix(rng: random.Random, n: int) -> list[WorkloadRequest]:
    out = []
    for _ in range(n):
        if rng.random() < 0.2:  # a document to summarise beside the chats
            out.append(WorkloadRequest(prompt_tokens=_lognormal_int(rng, 2500, 0.3, 1024, 4096),
                                       output_tokens=_lognormal_int(rng, 128, 0.4, 32, 512)))
        else:
            out.append(_chat_request(rng))
    return out


def _mixed_tenants(rng: random.Random, n: int) -> list[WorkloadRequest]:
    # "batch" floods (60% of requests, low priority, no deadline); three interactive tenants
    # share the rest at high priority with deadlines of a few seconds per expected token budget.
    out = []
    for _ in range(n):
        if rng.random() < 0.6:
            out.append(_chat_request(rng, tenant="batch", priority=1))
        else:
            tenant = rng.choice(("alpha", "beta", "gamma"))
            r = _chat_request(rng, tenant=tenant, priority=0)
            out.append(replace(r, deadline=round(5.0 + 0.05 * r.output_tokens, 3)))
    return out


def builtin_workload(name: str, num_requests: int = 200, seed: int = 0) -> Workload:
    """A seeded, deterministic request mix; see BUILTIN_WORKLOADS and docs/benchmarking.md."""
    if num_requests < 1:
        raise ValueError("num_requests: must be >= 1")
    rng = random.Random(f"{name}:{seed}")
    if name == "chat":
        reqs = [_chat_request(rng) for _ in range(num_requests)]
    elif name == "shared-prefix":
        reqs = _shared_prefix(rng, num_requests)
    elif name == "long-prompt-mix":
        reqs = _long_prompt_mix(rng, num_requests)
    elif name == "mixed-tenants":
        reqs = _mixed_tenants(rng, num_requests)
    else:
        raise ValueError(f"workload: expected one of {BUILTIN_WORKLOADS}, got {name!r}")
    block = 64 if name == "shared-prefix" else 16
    return Workload(name, tuple(reqs), prefix_block_tokens=block, notes=(f"built-in {name}, seed {seed}",))


# ---------------------------------------------------------------------------------------------
# Scaling real traces to the served model


@dataclass(frozen=True)
class Scaling:
    """Deterministic scaling: lengths are multiplied, rounded half-to-even, then clamped;
    arrival times are multiplied by `time_scale` (0.1 replays ten times faster); `limit` keeps
    the first requests in file order. Prefix blocks shrink with the prompts so sharing survives."""

    length_scale: float = 1.0
    output_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    time_scale: float = 1.0
    limit: int | None = None

    def __post_init__(self) -> None:
        for name in ("length_scale", "output_scale", "time_scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}: must be > 0, got {v!r}")
        for name in ("max_prompt_tokens", "max_output_tokens", "limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}: must be >= 1, got {v!r}")

    @property
    def is_identity(self) -> bool:
        return self == Scaling()


def _scale_len(n: int, factor: float, cap: int | None) -> int:
    v = max(1, round(n * factor))
    return min(v, cap) if cap is not None else v


def scale_workload(workload: Workload, s: Scaling) -> Workload:
    """Apply `s` to every request and record how in the workload's notes."""
    if s.is_identity:
        return workload
    reqs = workload.requests[: s.limit] if s.limit is not None else workload.requests
    block = max(1, round(workload.prefix_block_tokens * s.length_scale))
    out = []
    for r in reqs:
        p = _scale_len(r.prompt_tokens, s.length_scale, s.max_prompt_tokens)
        arrival = None if r.arrival_time is None else r.arrival_time * s.time_scale
        out.append(replace(r, prompt_tokens=p, output_tokens=_scale_len(r.output_tokens, s.output_scale, s.max_output_tokens),
                           prefix_group=r.prefix_group[: math.ceil(p / block)], arrival_time=arrival))
    note = (f"scaled: first {len(out)} of {len(workload.requests)} requests; prompt lengths x{s.length_scale:g} "
            f"clamped to [1, {s.max_prompt_tokens or 'inf'}]; output lengths x{s.output_scale:g} clamped to "
            f"[1, {s.max_output_tokens or 'inf'}]; arrival times x{s.time_scale:g}; prefix blocks "
            f"{workload.prefix_block_tokens} -> {block} tokens")
    return replace(workload, requests=tuple(out), prefix_block_tokens=block).with_note(note)


# ---------------------------------------------------------------------------------------------
# Trace readers


def _parse_azure_time(stamp: str) -> tuple[int, float]:
    """'2023-11-16 18:17:03.9799600' -> (whole POSIX seconds read as UTC, fraction).

    Kept apart so that differences keep microsecond precision (a float of ~1.7e9 seconds would not).
    """
    whole, _, frac = stamp.strip().partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%d %H:%M:%S")), float("0." + frac) if frac else 0.0


def _count(row: dict[str, Any], key: str, where: str) -> int:
    try:
        v = int(row[key])
    except ValueError:
        raise ValueError(f"{where}: {key}: expected a whole number of tokens, got {row[key]!r}") from None
    if v < 0:
        raise ValueError(f"{where}: {key}: must be >= 0, got {v}")
    return v


def read_azure_csv(path: str | Path) -> Workload:
    """Azure LLM inference trace 2023: TIMESTAMP, ContextTokens, GeneratedTokens."""
    path = Path(path)
    rows: list[tuple[tuple[int, float], int, int]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace, missing columns {sorted(missing)}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row or any(row[k] is None for k in ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
                raise ValueError(f"{where}: expected {len(reader.fieldnames or ())} columns "
                                 f"({', '.join(reader.fieldnames or ())})")
            try:
                stamp = _parse_azure_time(row["TIMESTAMP"])
            except ValueError:
                raise ValueError(f"{where}: TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS[.fraction]', "
                                 f"got {row['TIMESTAMP']!r}") from None
            rows.append((stamp, _count(row, "ContextTokens", where), _count(row, "GeneratedTokens", where)))
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda row: row[0])  # stable: ties keep file order
    (s0, f0) = rows[0][0]
    # A handful of rows record 0 generated tokens; a request must ask for at least one.
    reqs = tuple(WorkloadRequest(arrival_time=round((s - s0) + (fr - f0), 7), prompt_tokens=max(1, p),
                                 output_tokens=max(1, o)) for (s, fr), p, o in rows)
    return Workload(path.stem, reqs, notes=(f"Azure LLM 2023 trace {path.name}: {len(reqs)} requests",))


def read_mooncake_jsonl(path: str | Path) -> Workload:
    """Mooncake trace: timestamp (ms), input_length, output_length, hash_ids (512-token blocks)."""
    path = Path(path)
    reqs = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("expected a JSON object")
                for key in ("timestamp", "input_length", "output_length"):
                    if key not in d:
                        raise ValueError(f"{key}: missing")
                    if not _is_number(d[key]) or d[key] < 0:
                        raise ValueError(f"{key}: must be a number >= 0, got {d[key]!r:.40}")
                hashes = d.get("hash_ids", [])
                if not isinstance(hashes, list) or not all(_is_int(h) for h in hashes):
                    raise ValueError("hash_ids: must be a list of integers")
                reqs.append(WorkloadRequest(arrival_time=d["timestamp"] / 1000.0, prompt_tokens=max(1, int(d["input_length"])),
                                            output_tokens=max(1, int(d["output_length"])), prefix_group=tuple(hashes)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line: {e}") from None
    if not reqs:
        raise ValueError(f"{path}: no requests")
    t0 = min(r.arrival_time or 0.0 for r in reqs)
    reqs = [replace(r, arrival_time=(r.arrival_time or 0.0) - t0) for r in reqs]
    reqs.sort(key=lambda r: r.arrival_time or 0.0)
    return Workload(path.stem, tuple(reqs), prefix_block_tokens=MOONCAKE_BLOCK_TOKENS,
                    notes=(f"Mooncake trace {path.name}: {len(reqs)} requests",))


def load_trace(path: str | Path, scaling: Scaling | None = None) -> Workload:
    """Read a trace by its shape (Azure CSV, Mooncake JSONL, or a workload JSONL) and scale it."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        w = read_azure_csv(path)
    else:
        with path.open() as f:
            first = next((ln for ln in f if ln.strip()), "")
        w = read_mooncake_jsonl(path) if '"input_length"' in first else read_jsonl(path)
    return scale_workload(w, scaling or Scaling())


# ---------------------------------------------------------------------------------------------
# Workload JSONL: an optional header line, then one request per line


def read_jsonl(path: str | Path) -> Workload:
    path = Path(path)
    name, block, notes, reqs = path.stem, 16, [f"requests file {path.name}"], []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not JSON ({e.msg})") from None
                if not isinstance(d, dict):
                    raise ValueError("expected a JSON object")
                if _HEADER_KEY in d:
                    name, block = str(d.get("name", name)), d.get("prefix_block_tokens", block)
                    if not _is_int(block) or block < 1:
                        raise ValueError(f"prefix_block_tokens: must be an integer >= 1, got {block!r}")
                    notes = d.get("notes", notes)
                    if not isinstance(notes, list) or not all(isinstance(x, str) for x in notes):
                        raise ValueError("notes: must be a list of strings")
                    continue
                reqs.append(WorkloadRequest.from_dict(d))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return Workload(name, tuple(reqs), prefix_block_tokens=block, notes=tuple(notes))


def write_jsonl(workload: Workload, path: str | Path) -> None:
    header = {_HEADER_KEY: 1, "name": workload.name, "prefix_block_tokens": workload.prefix_block_tokens,
              "notes": list(workload.notes)}
    with Path(path).open("w") as f:
        f.write(json.dumps(header) + "\n")
        for r in workload.requests:
            f.write(json.dumps(r.to_dict()) + "\n")


def shared_prefix_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading prefix blocks two requests share (equal leading ids)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
