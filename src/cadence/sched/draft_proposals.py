"""Drafts made outside the scheduler (by a draft model the executor runs), kept per request.

The scheduler stays model-free. Each step it names, in `SchedulerOutput.draft_requests`, the
requests whose row samples and that may speculate next step, with the context tokens the
proposer has not been sent yet; after the target model's step the executor's proposer returns
their next drafts in `ModelOutput.draft_token_ids`. They are kept here with the context length
they continue, and the next step verifies them (or a prefix, as adaptive k and the budget allow)
through the same path as n-gram drafts. Drafts for a context that has since changed are never
used; a preempted or finished request's drafts are dropped, and its context is sent again from
the start should it need drafts later.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from cadence.boundary import DraftRequest, ScheduledRequest
from cadence.request import Request


class DraftProposals:
    """Per-request drafts from an executor-side proposer, and what of each context it was sent."""

    __slots__ = ("num_speculative_tokens", "_sent", "_drafts")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self._sent: dict[str, int] = {}  # context tokens sent to the proposer, per request
        self._drafts: dict[str, tuple[int, tuple[int, ...]]] = {}  # (context length, drafts)

    def requests(self, rows: Iterable[ScheduledRequest], requests: Mapping[str, Request],
                 only: Collection[str] | None = None) -> dict[str, DraftRequest]:
        """Who wants drafts after this step: each row that samples, of a request that may
        speculate at its next step and has room for one draft after the token sampled now; of
        those, with `only`, the ones it names (adaptive k would verify their drafts). A request
        left out is sent the context it missed the next time it is drafted for."""
        out: dict[str, DraftRequest] = {}
        for sr in rows:
            if not sr.sample or (only is not None and sr.request_id not in only):
                continue
            req = requests.get(sr.request_id)
            if req is None:
                continue
            sp = req.sampling_params
            num_out = len(req.output_token_ids) + 1  # after this step's token
            k = min(self.num_speculative_tokens, sp.max_tokens - num_out - 1)
            if k < 1 or not sp.speculable or num_out < sp.min_tokens:
                continue
            rid, num = sr.request_id, req.num_tokens
            offset = self._sent.get(rid, 0)
            out[rid] = DraftRequest(k, offset, tuple(req.token_ids_slice(offset, num)))
            self._sent[rid] = num
        return out

    def store(self, request: Request, drafts: tuple[int, ...]) -> None:
        """Drafts proposed after the request's current context (its tokens once the step's were added)."""
        self._drafts[request.request_id] = (request.num_tokens, drafts)

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        """Up to `k` of the drafts kept for the request's current context; () when none are."""
        kept = self._drafts.get(request.request_id)
        if kept is None or kept[0] != request.num_tokens:
            return ()
        return kept[1][:k]

    def drop(self, request_id: str) -> None:
        """The request left the running set (preempted or finished): its drafts, and what the
        proposer was sent, are forgotten (the proposer drops its state on the same news)."""
        self._sent.pop(request_id, None)
        self._drafts.pop(request_id, None)
