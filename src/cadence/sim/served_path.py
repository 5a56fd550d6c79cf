"""The request path as served traffic pays it, request by request.

A simulated request reaches its engine `request_delay_for(prompt tokens)` after it is sent, waits in
the queue, and has its first token when the step that computes the rest of its prompt ends. A
served request pays more than that path at idle suggests: under traffic its HTTP handling and
tokenization share the cores with the engine thread, and its first token's hand-off waits behind
the other requests' tokens. `benchmarks/serving_breakdown.py` keeps, for each served run, every
step the engine made (its shape and measured executor time, in order) and every request's client
times and engine-side queue wait, which is enough to take each request's time to first token
apart:

    path = TTFT - queue wait - its prompt step's measured time - the engine's overhead on that step

for each request whose whole uncached prompt was computed by one step that computed no other
prompt (its step is then known: a step with one prompt chunk of m tokens over c cached ones, with
m + c the request's prompt tokens, taken in the order the engine admitted them). Requests split
over several chunks or batched with other prompts are left out: their first token's time cannot be
laid on one step. The path is then fitted as per_request + per_prompt_token x prompt tokens.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadence.executor.cost_model import StepFeatures
from cadence.executor.step_log import read_step_log

# How many prompt steps ahead of the last one matched a request's step is looked for: requests
# admitted close together may have their steps in another order than their queue waits suggest.
MATCH_WINDOW = 8
# Fewer matched requests than this over all the runs: the fit is left to the idle probe.
MIN_REQUESTS = 20


@dataclass(frozen=True)
class FirstToken:
    """One served request's time to first token, taken apart (seconds)."""

    prompt_tokens: int
    cached_tokens: int
    ttft: float
    queue: float
    step: float  # its prompt step's measured executor time
    overhead: float  # the engine's time outside the executor on that step, as the profile charges it

    @property
    def path(self) -> float:
        return self.ttft - self.queue - self.step - self.overhead


def probe_steps(run: dict[str, Any]) -> int:
    """Steps at the head of a breakdown run's step log that are the idle probe's: a warm-up request
    and each probe run's two sends (a one-token request is one step)."""
    probe = run.get("request_path_probe") or ()
    return 1 + 2 * len(probe) if probe else 0


def _cached(f: StepFeatures) -> int:
    """The tokens before a lone prompt chunk: its attention is m x cached + m(m+1)/2."""
    m = f.prefill_tokens
    return (f.prefill_attention - m * (m + 1) // 2) // m


def _lone_chunks(steps: Sequence[tuple[StepFeatures, float]]) -> list[tuple[StepFeatures, float, int]]:
    """Steps that computed one prompt chunk (decodes beside it allowed), each with its cached
    tokens, less the chunks that carry on a prompt the step's last prompt chunk left unfinished (a
    chunked prompt has a chunk in each step until it is done: the one before ended where this
    one's cached tokens end)."""
    out = []
    last_end = -1  # where the last step's lone chunk ended (m + cached); -1 after a step of several
    for f, seconds in steps:
        if f.prefill_tokens <= 0:
            continue
        if f.prefill_seqs != 1:
            last_end = -1
            continue
        cached = _cached(f)
        if cached != last_end:
            out.append((f, seconds, cached))
        last_end = f.prefill_tokens + cached
    return out


def first_tokens(records: Sequence[dict[str, Any]], steps: Sequence[tuple[StepFeatures, float]],
                 overhead: dict[str, float]) -> list[FirstToken]:
    """The requests of one served run (`cadence bench` records) whose first token one lone prompt
    step made, matched to that step in admission order (module doc)."""
    chunks = _lone_chunks(steps)
    ok = [r for r in records if r.get("status") == 200 and r.get("first_token_time") is not None
          and r.get("queue_time") is not None and r.get("send_time") is not None]
    ok.sort(key=lambda r: r["send_time"] + r["queue_time"])
    per_step, per_seq = overhead.get("per_step", 0.0), overhead.get("per_seq", 0.0)
    out, j = [], 0
    for r in ok:
        n = int(r.get("server_prompt_tokens") or r["prompt_tokens"])
        for k in range(j, min(j + MATCH_WINDOW, len(chunks))):
            f, seconds, cached = chunks[k]
            if f.prefill_tokens + cached == n:
                out.append(FirstToken(n, cached, r["first_token_time"] - r["send_time"], r["queue_time"], seconds,
                                      per_step + per_seq * (f.prefill_seqs + f.decode_seqs)))
                j = k + 1
                break
    return out


def run_first_tokens(d: Path, run: dict[str, Any], overhead: dict[str, float]) -> list[FirstToken]:
    """`first_tokens` of one run of a breakdown directory (its step log and its client records, as
    serving_breakdown.py names them); none where either is missing."""
    if run.get("seed") is None or run.get("rate") is None:
        return []
    tag = f"{run['seed']}_{float(run['rate']):.3f}"
    log, recs = d / f"steps_{tag}.jsonl", d / f"real_{tag}" / "requests.jsonl"
    if not (log.is_file() and recs.is_file()):
        return []
    records = [json.loads(line) for line in recs.read_text().splitlines() if line.strip()]
    return first_tokens(records, read_step_log(log)[probe_steps(run):], overhead)


def _bin(n: int) -> int:
    """Prompts of 2^k to 2^(k+1) - 1 tokens share a bin: each length range weighs the same in the fit."""
    return max(n, 1).bit_length()


def fit_served_path(tokens: Sequence[FirstToken]) -> dict[str, float] | None:
    """per_request + per_prompt_token x prompt tokens through the median path of each bin of
    prompt lengths (a request held up by something else does not move a median), both terms
    clipped at 0; None with fewer than MIN_REQUESTS requests. One bin only: its median, per request."""
    from cadence.sim.serving import fit_line

    if len(tokens) < MIN_REQUESTS:
        return None
    bins: dict[int, list[FirstToken]] = {}
    for t in tokens:
        bins.setdefault(_bin(t.prompt_tokens), []).append(t)
    if len(bins) == 1:
        return {"per_request": max(statistics.median(t.path for t in tokens), 0.0)}
    x = [statistics.median(t.prompt_tokens for t in b) for b in bins.values()]
    y = [statistics.median(t.path for t in b) for b in bins.values()]
    per_token, per_request = fit_line(x, y)
    return {"per_request": per_request, "per_prompt_token": per_token}
