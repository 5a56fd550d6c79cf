"""Applying a step's results to its requests (`StepResults`): progress, sampled tokens, when a
request stops.

The `Scheduler` owns one and hands it each step's rows and the executor's `ModelOutput` (`apply`),
with the step's stats to count into. It walks the rows in scheduling order (the order requests
finish in is the order their blocks return to the pool), advances each request's
`num_computed_tokens`, publishes the blocks that filled, appends the sampled token, decides
whether the request stops (`stop_status`) and ends it through the scheduler's `finish`. It returns
the tokens computed, which the scheduler adds to its running total.

A plain decode (one token, sampled, past the prompt, of a request with plain sampling) is
applied by `apply` inline, since it runs for nearly every token; every other row goes through
`record`, its plain form. With `went_on` (the scheduler's `decode_ids`), the plain decodes that go
on are listed there instead of getting a `RequestDelta` each.
"""

from __future__ import annotations

from typing import Protocol

from cadence.boundary import IterationStats, ModelOutput, RequestDelta, ScheduledRequest, TokenLogprobs
from cadence.kv.manager import KVCacheManager
from cadence.request import DECODE_LEG, Request, RequestStatus
from cadence.sched.queue import RequestQueue
from cadence.sched.records import final_delta, token_delta, tokens_delta
from cadence.sched.speculation import Speculation

_RUNNING = RequestStatus.RUNNING


class Finish(Protocol):
    """`Scheduler.finish`: end a running request, free its blocks, record why and when."""

    def __call__(self, req: Request, status: RequestStatus, now: float, *, stop_reason: str | int | None = None,
                 error: str | None = None) -> None: ...


class StepResults:
    def __init__(self, requests: dict[str, Request], kv: KVCacheManager, waiting: RequestQueue, max_model_len: int,
                 speculation: Speculation | None, finish: Finish) -> None:
        self.requests = requests  # the scheduler's unfinished requests, by id
        self.kv = kv
        self.waiting = waiting
        self.max_model_len = max_model_len
        self.speculation = speculation
        self.finish = finish

    def apply(self, rows: tuple[ScheduledRequest, ...], model_output: ModelOutput, now: float,
              stats: IterationStats, deltas: list[RequestDelta], went_on: list[str] | None) -> int:
        """A step's results, row by row: `record` for each row, but for a plain decode what it and
        `_append_token` do written flat. Returns the tokens computed (of requests that finished
        too: `finish` took their updated count off the scheduler's total)."""
        requests, cache, block_size = self.requests, self.kv.cache_computed_blocks, self.kv.block_size
        account = self.waiting.account if self.waiting.tracks_service else None
        latencies = stats.token_latencies
        max_len = self.max_model_len
        sampled = model_output.sampled_token_ids
        record = self.record
        num_computed = num_sampled = 0
        for sr in rows:
            rid = sr.request_id
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue  # ended between schedule and update
            start = sr.start_pos
            if len(sr.token_ids) != 1 or not sr.sample or start < len(req.prompt_token_ids) \
                    or not sr.sampling_params.plain_decode:
                num_computed += record(sr, model_output, now, stats, deltas)
                continue
            assert req.num_computed_tokens == start, f"{rid}: progress out of step"
            req.num_computed_tokens = start + 1
            num_computed += 1
            if (start + 1) % block_size == 0:
                cache(req)
            token = sampled.get(rid)
            if token is None:
                self.finish(req, RequestStatus.FINISHED_ERROR, now, error="the executor returned no token")
                deltas.append(final_delta(req))
                continue
            if account is not None:
                account(req, 0, 1)
            num_sampled += 1
            last = req.last_token_time
            if last is None:  # not for a decode (it feeds a sampled token); kept exact all the same
                deltas.append(self._append_token(req, token, None, now, stats))
                continue
            outputs = req.output_token_ids
            outputs.append(token)
            latencies.append((req.tenant, now - last))
            req.last_token_time = now
            sp = req.sampling_params
            # Context after this token: start + 2 (the token fed, then the one just sampled).
            status, stop_reason = None, None
            if not (len(outputs) < sp.max_tokens and start + 2 < max_len and token not in req.eos_token_ids
                    and token not in sp.stop_token_ids):  # (most tokens end nothing: decided cheaply)
                status, stop_reason = self.stop_status(req, token)
            if status is None:
                if went_on is not None:
                    went_on.append(rid)
                else:
                    deltas.append(token_delta(req, token, ()))
                continue
            self.finish(req, status, now, stop_reason=stop_reason)
            deltas.append(final_delta(req, (token,)))
        stats.num_generation_tokens += num_sampled
        return num_computed

    def record(self, sr: ScheduledRequest, model_output: ModelOutput, now: float, stats: IterationStats,
               deltas: list[RequestDelta]) -> int:
        """One scheduled record's result: its progress, and its sampled token if it samples.
        Returns the tokens computed (0 for a request that ended between schedule and update)."""
        rid = sr.request_id
        req = self.requests.get(rid)
        if req is None or req.status is not _RUNNING:
            return 0  # ended between schedule and update
        if sr.num_draft_tokens:
            return self._verified(req, sr, model_output, now, stats, deltas)
        start, n = sr.start_pos, len(sr.token_ids)
        assert req.num_computed_tokens == start, f"{rid}: progress out of step"
        req.num_computed_tokens = start + n
        # Blocks fill only where a step crosses a block boundary (every `block_size` decodes):
        # the KV manager has published every block full before this step, so skip the call otherwise.
        if start % self.kv.block_size + n >= self.kv.block_size:
            self.kv.cache_computed_blocks(req)
        prompt_tokens = 0 if n == 1 and start >= len(req.prompt_token_ids) else n  # decode: 0
        if req.handoff is None or req.handoff.leg != DECODE_LEG:  # (a decode leg's prompt was counted by its prefill)
            stats.num_prompt_tokens += prompt_tokens
        account = self.waiting.account if self.waiting.tracks_service else None  # a no-op call otherwise
        if not sr.sample:
            if account is not None:
                account(req, prompt_tokens, 0)
            return n
        token = model_output.sampled_token_ids.get(rid)
        if token is None:
            self.finish(req, RequestStatus.FINISHED_ERROR, now, error="the executor returned no token")
            deltas.append(final_delta(req))
            return n
        if account is not None:
            account(req, prompt_tokens, 1)
        stats.num_generation_tokens += 1
        logprobs = model_output.logprobs
        deltas.append(self._append_token(req, token, logprobs.get(rid) if logprobs else None, now, stats))
        return n

    def _verified(self, req: Request, sr: ScheduledRequest, model_output: ModelOutput, now: float,
                  stats: IterationStats, deltas: list[RequestDelta]) -> int:
        """A verification row's result (`Speculation.accept`): the kept tokens join the outputs, one
        at a time, until one ends the request (the rest are dropped); the KV of the fed token and of
        the accepted drafts is kept, the rejected drafts' slots are given back."""
        start, spec = sr.start_pos, self.speculation
        assert req.num_computed_tokens == start and spec is not None, f"{req.request_id}: progress out of step"
        tokens, error = spec.accept(sr, model_output, stats)
        if error is not None:
            self.finish(req, RequestStatus.FINISHED_ERROR, now, error=error)
            deltas.append(final_delta(req))
            return 0
        outputs, sp = req.output_token_ids, req.sampling_params
        status, stop_reason, taken = None, None, 0
        for token in tokens:
            outputs.append(token)
            taken += 1
            if not (len(outputs) < sp.max_tokens and req.num_tokens < self.max_model_len
                    and token not in req.eos_token_ids and token not in sp.stop_token_ids):
                status, stop_reason = self.stop_status(req, token)
                if status is not None:
                    break
        # Positions start .. start + taken - 1 hold the fed token and the drafts now confirmed.
        req.num_computed_tokens = start + taken
        self.kv.release_tail(req)
        self.kv.cache_computed_blocks(req)
        if self.waiting.tracks_service:
            self.waiting.account(req, 0, taken)
        stats.num_generation_tokens += taken
        if req.last_token_time is not None:  # one latency per step, as for a plain decode step
            stats.token_latencies.append((req.tenant, now - req.last_token_time))
        req.last_token_time = now
        new = tuple(outputs[len(outputs) - taken :])
        if status is None:
            deltas.append(tokens_delta(req, new))
        else:
            self.finish(req, status, now, stop_reason=stop_reason)
            deltas.append(final_delta(req, new))
        return taken

    def _append_token(self, req: Request, token: int, logprobs: TokenLogprobs | None, now: float,
                      stats: IterationStats) -> RequestDelta:
        """Append a sampled token (the caller counts it); runs once per generated token."""
        outputs = req.output_token_ids
        outputs.append(token)
        last = req.last_token_time
        if last is None:  # the first token
            req.first_token_time = now
            stats.first_token_latencies.append((req.tenant, now - req.arrival_time))
            stats.first_token_prompt_tokens += req.num_prompt_tokens
        else:
            if req.first_token_time is None:  # a decode leg's first token here: the request's next one
                req.first_token_time = now
            stats.token_latencies.append((req.tenant, now - last))
        req.last_token_time = now
        lps = (logprobs,) if logprobs is not None else ()
        sp = req.sampling_params
        num_out = len(outputs)
        # Most tokens end nothing: decide that with a few cheap tests before the full check.
        if (
            num_out < sp.max_tokens
            and len(req.prompt_token_ids) + num_out < self.max_model_len
            and token not in req.eos_token_ids
            and token not in sp.stop_token_ids
        ):
            return token_delta(req, token, lps)
        status, stop_reason = self.stop_status(req, token)
        if status is None:
            return token_delta(req, token, lps)
        self.finish(req, status, now, stop_reason=stop_reason)
        return final_delta(req, (token,), lps)

    def stop_status(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """Whether `req` stops with `token`, just appended: EOS, a stop token id (both only after
        `min_tokens`), or its length (`max_tokens`, the model's context); (None, None) if not."""
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
