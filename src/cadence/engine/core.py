"""The engine core: a synchronous loop of schedule, execute, update.

It owns the scheduler and the KV cache manager, sizes the cache from the executor's bytes per
block, and turns each step into `RequestDelta`s for the streams. It reads time only through a
`Clock`, so the simulator runs the same loop on virtual time. No torch, no asyncio: the async
engine runs this in a background thread and calls `add_request` / `abort_requests` between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from cadence.boundary import IterationStats, ModelOutput, RequestDelta, SchedulerOutput, SchedulerStats
from cadence.clock import Clock, RealClock
from cadence.config import EngineConfig
from cadence.engine.events import RequestEventRecorder
from cadence.executor.base import Executor
from cadence.kv.manager import KVCacheManager
from cadence.request import FinishReason, Request, RequestStatus, StructuredOutputsParams
from cadence.sched.scheduler import Scheduler
from cadence.wording import counted

if TYPE_CHECKING:
    from cadence.boundary import SchedulerOutput


class Grammars(Protocol):
    """The engine's grammar matchers (`cadence.structured.StructuredOutputs`), as the core uses them."""

    @property
    def active(self) -> bool: ...
    def attach(self, requests: Sequence[Request]) -> None: ...
    def detach(self, request_ids: Iterable[str]) -> None: ...
    def with_bitmask(self, out: SchedulerOutput) -> SchedulerOutput: ...
    def advance(self, deltas: Sequence[RequestDelta]) -> Sequence[Any]: ...
    def validate_all(self, specs: Sequence[StructuredOutputsParams]) -> None: ...
    async def validate_async(self, spec: StructuredOutputsParams) -> object: ...

logger = logging.getLogger(__name__)
_NO_OUTPUT = ModelOutput()


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        clock: Clock | None = None,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        check_integrity: bool = False,
        snapshot_gauges: bool = True,
        decode_ids: bool = False,
        structured: Grammars | None = None,
    ) -> None:
        """`snapshot_gauges`: keep `scheduler_stats` as of the last step, for gauges read from
        other threads (the server's); without it, each read computes them then (the simulator
        reads none, and would otherwise build a snapshot per step for nothing). `decode_ids`:
        report the plain decodes that go on as ids in `last_decoded` rather than a delta each
        (for a caller that needs no delta per token: the simulator, where they are most of
        the tokens). `structured`: grammar matchers for requests with `structured_outputs`
        (None: such requests are refused)."""
        config.validate()
        if max_model_len < 1:
            raise ValueError("max_model_len: must be >= 1")
        self.config = config
        self.executor = executor
        self.clock: Clock = clock if clock is not None else RealClock()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.check_integrity = check_integrity
        self._snapshot_gauges = snapshot_gauges
        self.decode_ids = decode_ids
        self._max_model_len = max_model_len
        self.structured = structured

        cache = config.cache
        num_blocks = self._size_kv_cache()
        executor.initialize_kv_cache(num_blocks, cache.block_size)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.prefix_caching_hash_algo)
        self.scheduler = Scheduler(config.scheduler, cache, self.kv, max_model_len, decode_ids=decode_ids)
        # Told of each executed step and its duration (`--record-steps`); None: nobody.
        self.step_observer: Callable[[SchedulerOutput, float], None] | None = None
        self.last_stats = IterationStats()
        self._gauges = self.scheduler.stats()
        self.events: RequestEventRecorder | None = None  # see record_request_events
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens in %s (max_model_len %d, prefix caching %s)",
            num_blocks,
            cache.block_size,
            num_blocks * cache.block_size,
            self.kv_cache_dtype,
            max_model_len,
            "on" if cache.enable_prefix_caching else "off",
        )

    def _size_kv_cache(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.executor.kv_bytes_per_block(cache.block_size)
        if per_block <= 0:
            raise ValueError(f"executor reports {per_block} KV bytes per block")
        num_blocks = cache.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {cache.kv_cache_memory} bytes hold no block of {per_block} bytes; raise it"
            )
        return num_blocks

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV cache stores: int8 (the 8-bit cache), or for auto the model's dtype where the
        executor has one (auto otherwise: a simulated executor)."""
        name = self.config.cache.kv_cache_dtype
        dtype = getattr(self.executor, "dtype", None)
        if name == "auto" and dtype is not None:
            return str(dtype).removeprefix("torch.")
        return name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output) one request can hold here: the context, or the whole
        KV cache where that is smaller (admission refuses a request asking for more)."""
        return min(self._max_model_len, self.kv.capacity_tokens)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def last_decoded(self) -> list[str]:
        """With `decode_ids`: the requests whose plain decode in the last step gave one token
        and went on. `step` returns no delta for them; each one's new
        token is its last output token. Empty otherwise."""
        return self.scheduler.last_decoded

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request, *, evict: bool = True) -> None:
        """Queue a request; raises AdmissionError (the server maps its kind to an HTTP status)."""
        self.add_requests((request,), evict=evict)

    def add_requests(self, group: Sequence[Request], *, evict: bool = True) -> None:
        """Queue one client request's engine requests all or nothing; raises AdmissionError.
        Admission may drop queued requests of a tenant over its fair share to make room (not with
        `evict` False): they end with finish reason `evicted`, their refusal in the final
        delta's `error`, returned by the next `step`."""
        now = self.clock.now()
        for request in group:
            if request.arrival_time == 0.0:
                request.arrival_time = now
            if not request.eos_token_ids:
                request.eos_token_ids = self.eos_token_ids
        constrained = [r for r in group if r.sampling_params.structured_outputs is not None]
        grammars = self.structured
        if constrained:
            if grammars is None:
                raise ValueError("structured_outputs: this engine has no grammar support")
            grammars.attach(constrained)  # ValueError naming the field; compiled beforehand, a cache hit
        try:
            self.scheduler.add_requests(group, now, evict=evict)
        except BaseException:
            if constrained and grammars is not None:
                grammars.detach(r.request_id for r in constrained)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestDelta]:
        """Abort requests (a client went away); frees their blocks at once. Unknown ids are ignored."""
        deltas = self.scheduler.abort(tuple(request_ids), self.clock.now())
        self._advance_grammars(deltas)
        # Refresh the snapshot the gauges read: with nothing left to run, no step would.
        self._snapshot()
        return deltas

    def finish_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_STOPPED,
        *,
        stop_reason: str | int | None = None,
    ) -> list[RequestDelta]:
        """End requests for a reason found outside the engine, e.g. a stop string in the detokenized text."""
        deltas = self.scheduler.finish_requests(tuple(request_ids), status, self.clock.now(), stop_reason=stop_reason)
        self._advance_grammars(deltas)
        self._snapshot()
        return deltas

    def record_request_events(self) -> RequestEventRecorder:
        """Record each tracked request's prefill chunks, preemptions and resumes from now on (for
        its trace); off by default, and then the loop does no such work."""
        if self.events is None:
            self.events = RequestEventRecorder(self.clock)
            self.scheduler.on_preempt = self.events.preempted
            self.scheduler.on_end_waiting = self.events.ended_waiting
        return self.events

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestDelta]:
        """One iteration: schedule, execute, update. Returns what happened to each request."""
        sched = self.scheduler
        now = self.clock.now()
        out = sched.schedule(now)
        if self.events is not None:
            self.events.scheduled(out, sched.requests, now, sched.wait_stop)
        if self.structured is not None and self.structured.active:
            out = self.structured.with_bitmask(out)
        step_time = 0.0
        if out.is_empty:
            deltas = sched.update(out, _NO_OUTPUT, self.clock.now())
        else:
            start = self.clock.now()
            try:
                result = self.executor.execute(out)
            except Exception as e:  # noqa: BLE001 - one bad step must not take the engine down
                logger.exception("step %d failed; finishing its %s with an error", out.step, counted(out.num_scheduled, "request"))
                deltas = sched.fail_step(out, f"engine step failed: {type(e).__name__}: {e}", self.clock.now())
            else:
                now = self.clock.now()
                step_time = now - start
                if self.step_observer is not None:
                    self.step_observer(out, step_time)
                deltas = sched.update(out, result, now)
        deltas = self._advance_grammars(deltas)
        if out.preempted_ids:
            logger.debug("step %d preempted %s", out.step, ", ".join(out.preempted_ids))
        self.steps_ran(step_time)
        return deltas

    def _advance_grammars(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Advance the matchers with the accepted tokens; a request whose grammar has ended (or
        failed) ends too, its final delta carrying its last tokens."""
        if self.structured is None or not self.structured.active:
            return deltas
        ends = self.structured.advance(deltas)
        if not ends:
            return deltas
        now = self.clock.now()
        finals: dict[str, RequestDelta] = {}
        ended = {d.request_id: d for d in deltas if d.finished}
        for end in ends:
            if end.request_id in ended:  # ended by the scheduler in this step, while its grammar failed
                finals[end.request_id] = replace(ended[end.request_id], finish_reason=FinishReason.ERROR, stop_reason=None,
                                                 error=end.error, error_by_request=end.beyond_limits)
                continue
            status = RequestStatus.FINISHED_STOPPED if end.error is None else RequestStatus.FINISHED_ERROR
            for d in self.scheduler.finish_requests((end.request_id,), status, now):
                finals[d.request_id] = d if end.error is None else replace(d, error=end.error,
                                                                           error_by_request=end.beyond_limits)
        self.structured.detach(finals)
        out = []
        for d in deltas:
            final = finals.pop(d.request_id, None)
            out.append(d if final is None else replace(final, new_token_ids=d.new_token_ids, new_logprobs=d.new_logprobs))
        return out + list(finals.values())

    def steps_ran(self, step_time: float) -> None:
        """Record the steps just run (one `step`, or several at once from outside, as the
        simulator's fast-forward does): their stats as `last_stats`, `step_time` seconds long."""
        self.last_stats = self.scheduler.last_iteration_stats
        self.last_stats.step_time = step_time
        self._snapshot()
        if self.check_integrity:
            self.scheduler.check_integrity()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def flush_stats(self) -> IterationStats | None:
        """The counts gathered since the last step (requests ended between steps), closed now as
        `last_stats`; None if there are none. For a loop that goes idle (see
        `Scheduler.close_pending_stats`)."""
        it = self.scheduler.close_pending_stats(self.clock.now())
        if it is not None:
            self.last_stats = it
            self._snapshot()
        return it

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The gauges after the last step (or abort, or finish): see `snapshot_gauges`."""
        return self._gauges if self._snapshot_gauges else self.scheduler.stats()

    def _snapshot(self) -> None:
        if self._snapshot_gauges:
            self._gauges = self.scheduler.stats()
