"""The frozen records built from a mutable `Request`: what the executor, the stream and the
metrics see of it. The scheduler calls these per request per step, so they avoid O(context) work.

The two built every step (`scheduled_request`, `token_delta`) fill the instance dict directly
instead of calling the dataclass's generated `__init__`, which for a frozen dataclass sets every
field through `object.__setattr__` and costs several times as much. The result is the same
frozen, equal-comparing record: `scheduled_request_reference` and `token_delta_reference` build
them the plain way, and tests/unit/test_references.py compares both over generated requests.
"""

from __future__ import annotations

from cadence.boundary import (
    FinishedRequestStats,
    RequestDelta,
    RequestMetrics,
    RequestSnapshot,
    ScheduledRequest,
    TokenLogprobs,
    WaitInfo,
)
from cadence.request import DECODE_LEG, PREFILL_LEG, FinishReason, HandOff, Request, RequestStatus

_new = object.__new__


def token_slice(req: Request, start: int, end: int) -> tuple[int, ...]:
    """`tuple(req.all_token_ids[start:end])` without concatenating prompt and outputs."""
    return tuple(req.token_ids_slice(start, end))


def scheduled_request(req: Request, n: int, block_table: tuple[int, ...]) -> ScheduledRequest:
    """The next `n` tokens of `req` after its computed ones, as the executor needs them."""
    start = req.num_computed_tokens
    num_prompt = len(req.prompt_token_ids)
    outputs = req.output_token_ids
    if n == 1 and start >= num_prompt:  # a decode feeds the last sampled token
        token_ids: tuple[int, ...] = (outputs[start - num_prompt],)
    else:
        token_ids = token_slice(req, start, start + n)
    sp = req.sampling_params
    sr = _new(ScheduledRequest)
    fields = sr.__dict__  # every field of ScheduledRequest, in order (see the module doc)
    fields["request_id"] = req.request_id
    fields["token_ids"] = token_ids
    fields["start_pos"] = start
    fields["block_table"] = block_table
    fields["sample"] = start + n == num_prompt + len(outputs)  # reaches the end of what is known: sample
    fields["sampling_params"] = sp
    fields["num_output_tokens"] = len(outputs)
    fields["history"] = tuple(req.all_token_ids) if sp.needs_history else None
    fields["eos_token_ids"] = req.eos_token_ids
    fields["num_draft_tokens"] = 0
    return sr


def verification_request(req: Request, drafts: tuple[int, ...], block_table: tuple[int, ...]) -> ScheduledRequest:
    """A decoding request's row with `drafts` to verify: its last sampled token, then the drafts."""
    start = req.num_computed_tokens
    sp = req.sampling_params
    return ScheduledRequest(
        request_id=req.request_id,
        token_ids=(req.output_token_ids[-1], *drafts),
        start_pos=start,
        block_table=block_table,
        sample=True,
        sampling_params=sp,
        num_output_tokens=len(req.output_token_ids),
        history=tuple(req.all_token_ids) if sp.needs_history else None,
        eos_token_ids=req.eos_token_ids,
        num_draft_tokens=len(drafts),
    )


def scheduled_request_reference(req: Request, n: int, block_table: tuple[int, ...]) -> ScheduledRequest:
    """`scheduled_request`, plainly: the dataclass constructor over the request's whole token list."""
    start = req.num_computed_tokens
    sp = req.sampling_params
    return ScheduledRequest(
        request_id=req.request_id,
        token_ids=tuple(req.all_token_ids[start : start + n]),
        start_pos=start,
        block_table=block_table,
        sample=start + n == req.num_tokens,
        sampling_params=sp,
        num_output_tokens=req.num_output_tokens,
        history=tuple(req.all_token_ids) if sp.needs_history else None,
        eos_token_ids=req.eos_token_ids,
    )


def request_metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(
        req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time, req.num_preemptions
    )


def token_delta(req: Request, token: int, lps: tuple[TokenLogprobs, ...]) -> RequestDelta:
    """One new token of a request that goes on."""
    delta = _new(RequestDelta)
    fields = delta.__dict__  # every field of RequestDelta, in order (see the module doc)
    fields["request_id"] = req.request_id
    fields["new_token_ids"] = (token,)
    fields["new_logprobs"] = lps
    fields["finish_reason"] = None
    fields["stop_reason"] = None
    fields["num_prompt_tokens"] = len(req.prompt_token_ids)
    fields["num_cached_tokens"] = req.num_cached_tokens
    fields["metrics"] = None
    fields["error"] = None
    fields["error_by_request"] = False
    fields["retry_after"] = None
    return delta


def token_delta_reference(req: Request, token: int, lps: tuple[TokenLogprobs, ...]) -> RequestDelta:
    """`token_delta`, plainly: the dataclass constructor."""
    return RequestDelta(req.request_id, (token,), lps, num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=req.num_cached_tokens)


def tokens_delta(req: Request, tokens: tuple[int, ...]) -> RequestDelta:
    """Several new tokens of a request that goes on (a verification row's)."""
    return RequestDelta(req.request_id, tokens, num_prompt_tokens=len(req.prompt_token_ids),
                        num_cached_tokens=req.num_cached_tokens)


def final_delta(req: Request, tokens: tuple[int, ...] = (), lps: tuple[TokenLogprobs, ...] = ()) -> RequestDelta:
    """The last delta of a finished request: why it ended, and its timings."""
    assert req.is_finished
    return RequestDelta(
        req.request_id,
        tokens,
        lps,
        req.finish_reason,
        req.stop_reason,
        req.num_prompt_tokens,
        req.num_cached_tokens,
        request_metrics(req),
        error=req.error,
        retry_after=req.retry_after,
    )


def finished_stats(req: Request) -> FinishedRequestStats:
    reason = req.finish_reason
    assert reason is not None
    h = req.handoff
    if h is not None and h.leg == DECODE_LEG:
        return _continued_stats(req, reason.value, h)
    return FinishedRequestStats(
        req.request_id,
        req.tenant,
        req.priority,
        reason.value,
        req.num_prompt_tokens,
        req.num_output_tokens,
        req.num_cached_tokens,
        request_metrics(req),
        handed_off=h is not None and h.leg == PREFILL_LEG and reason is FinishReason.LENGTH and req.error is None,
        max_tokens=req.sampling_params.max_tokens,
    )


def _continued_stats(req: Request, reason: str, h: HandOff) -> FinishedRequestStats:
    """A decode leg's record as the whole request's: its prompt without the tokens another engine
    emitted, its outputs with them, and its times from the request's arrival (the hand-off's
    offsets, taken back from this engine's arrival): the e2e latency, the queue time and the time
    to first token are the request's, though measured in part by the ingress."""
    t = req.arrival_time
    first = t - h.since_first_token if h.num_emitted else req.first_token_time
    metrics = RequestMetrics(t - h.since_arrival, t - h.since_scheduled, first, req.finished_time,
                             req.num_preemptions)
    return FinishedRequestStats(req.request_id, req.tenant, req.priority, reason,
                                req.num_prompt_tokens - h.num_emitted, req.num_output_tokens + h.num_emitted,
                                req.num_cached_tokens, metrics,
                                max_tokens=req.sampling_params.max_tokens + h.num_emitted)


def request_state(req: Request) -> str:
    """waiting, preempted, prefilling (the prompt, or recomputing after a preemption), decoding
    or finished."""
    if req.is_finished:
        return "finished"
    if req.status is RequestStatus.RUNNING:
        return "prefilling" if req.num_computed_tokens < req.num_tokens - 1 else "decoding"
    return "preempted" if req.status is RequestStatus.PREEMPTED else "waiting"


def request_snapshot(req: Request, position: int | None = None, wait: WaitInfo | None = None) -> RequestSnapshot:
    """A request's state as plain data (read it on the thread that steps the scheduler)."""
    reason = req.finish_reason
    return RequestSnapshot(
        request_id=req.request_id,
        tenant=req.tenant,
        state=request_state(req),
        queue_position=position,
        wait=wait,
        num_prompt_tokens=req.num_prompt_tokens,
        num_computed_prompt_tokens=min(req.num_computed_tokens, req.num_prompt_tokens),
        num_output_tokens=req.num_output_tokens,
        num_preemptions=req.num_preemptions,
        priority=req.priority,
        finish_reason=reason.value if reason is not None else None,
        arrival_time=req.arrival_time,
        first_token_time=req.first_token_time,
    )
