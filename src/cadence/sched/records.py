"""The frozen records built from a mutable `Request`: what the executor, the stream and the
metrics see of it. The scheduler calls these per request per step, so they avoid O(context) work.
"""

from __future__ import annotations

from cadence.metrics.stats import FinishedRequestStats
from cadence.request import Request
from cadence.sched.output import RequestDelta, RequestMetrics, ScheduledRequest, TokenLogprobs


def token_slice(req: Request, start: int, end: int) -> tuple[int, ...]:
    """`tuple(req.all_token_ids[start:end])` without concatenating prompt and outputs."""
    prompt = req.prompt_token_ids
    p = len(prompt)
    if end <= p:
        return tuple(prompt[start:end])
    if start >= p:
        return tuple(req.output_token_ids[start - p : end - p])
    return tuple(prompt[start:]) + tuple(req.output_token_ids[: end - p])


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
    return ScheduledRequest(
        req.request_id,
        token_ids,
        start,
        block_table,
        start + n == num_prompt + len(outputs),  # reaches the end of what is known: sample
        sp,
        len(outputs),
        tuple(req.all_token_ids) if sp.needs_history else None,
        req.eos_token_ids,
    )


def request_metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(
        req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time, req.num_preemptions
    )


def token_delta(req: Request, token: int, lps: tuple[TokenLogprobs, ...]) -> RequestDelta:
    """One new token of a request that goes on."""
    return RequestDelta(req.request_id, (token,), lps, None, None, len(req.prompt_token_ids), req.num_cached_tokens)


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
        req.error,
    )


def finished_stats(req: Request) -> FinishedRequestStats:
    reason = req.finish_reason
    assert reason is not None
    return FinishedRequestStats(
        req.request_id,
        req.tenant,
        req.priority,
        reason.value,
        req.num_prompt_tokens,
        req.num_output_tokens,
        req.num_cached_tokens,
        request_metrics(req),
    )
