"""Speculative decoding's figures over a benchmark run, from the server's own /metrics counters.

cadence exposes `cadence:spec_decode_*` counters (docs/metrics.md); reading them before and after the
load gives what the run proposed and accepted. A server without /metrics, or without these counters
(vLLM, llama.cpp), gives nothing: the section is then null. The counters are the server's, so
another client's traffic during the run is counted too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import httpx

DRAFTS = "cadence:spec_decode_num_drafts_total"
DRAFT_TOKENS = "cadence:spec_decode_num_draft_tokens_total"
ACCEPTED = "cadence:spec_decode_num_accepted_tokens_total"
COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)
# The server's configured drafts a step (0: it does not speculate); a fleet gives one per replica and their sum.
CONFIGURED_K = "cadence:spec_decode_num_speculative_tokens"
METRICS_TIMEOUT_S = 10.0

# A run with exact lengths, on a server with the counters, that proposed nothing: what to tell the operator.
EXACT_LENGTH_HINT = ("no draft tokens were proposed on a server that speculates: exact output lengths "
                     "(min_tokens) keep requests from speculating; --no-exact-output lets them")


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    configured_k: float = 0.0  # the most drafts a request verifies a step (0: not speculating, or not said)

    @property
    def speculates(self) -> bool:
        return self.configured_k > 0


def parse_counters(text: str) -> SpecCounters | None:
    """The three counters from a Prometheus text page; None unless all three are there."""
    found: dict[str, float] = {}
    k = 0.0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            try:
                found[name] = float(value.split()[0])
            except (ValueError, IndexError):
                return None
        elif name.partition("{")[0] == CONFIGURED_K:  # (a fleet's: per replica and summed)
            with contextlib.suppress(ValueError, IndexError):
                k = max(k, float(value.split()[0]))
    if len(found) < len(COUNTERS):
        return None
    return SpecCounters(found[DRAFTS], found[DRAFT_TOKENS], found[ACCEPTED], k)


async def read_counters(client: httpx.AsyncClient) -> SpecCounters | None:
    """The server's counters now; None (never an error) where /metrics is missing, refused or
    unreachable: the benchmark does not depend on it."""
    try:
        r = await client.get("/metrics", timeout=METRICS_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse_counters(r.text)


def summarize(before: SpecCounters | None, after: SpecCounters | None) -> dict | None:
    """The run's figures (the counters' differences); None where the server has no such counters or
    the run proposed no draft token (a server that does not speculate)."""
    if before is None or after is None:
        return None
    rows = int(after.drafts - before.drafts)
    proposed = int(after.draft_tokens - before.draft_tokens)
    accepted = int(after.accepted - before.accepted)
    if proposed <= 0 or rows <= 0:
        return None
    return {
        "verification_rows": rows,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed,
        "mean_k": proposed / rows,
        "accepted_per_row": accepted / rows,
    }


def format_lines(spec: dict | None) -> list[str]:
    """The printed summary's lines for the section (none where the server does not report it)."""
    if not spec:
        return []
    return [f"speculative  rows {spec['verification_rows']}  draft tokens {spec['draft_tokens']}  "
            f"accepted {spec['accepted_tokens']}  acceptance {spec['acceptance_rate'] * 100:.1f}%  "
            f"mean k {spec['mean_k']:.2f}  accepted/row {spec['accepted_per_row']:.2f}"]
