"""The asyncio face of the engine: an `EngineCore` loop in one background thread, streams on the loop.

    engine thread                                  asyncio side
    ------------------------------------------     ---------------------------------------------
    take inbox (adds, aborts) between steps   <--  submit(): admission answered through a future
    core.step() -> OutputProcessor.process()
    finish stop-string hits in the core
    stats hook (Prometheus)
    loop.call_soon_threadsafe(deliver, batch) -->  one asyncio.Queue per request -> RequestStream

One thread is enough: torch releases the GIL inside its kernels, and the core is not thread-safe, so
only this thread ever touches it (and the output processor). Requests come in through a locked inbox
applied between steps, so an abort takes effect within one step. A request with `n > 1` (or several
prompts) fans out into one engine request per choice, admitted all-or-nothing.

A step that never returns (a deadlocked kernel) is caught by a watchdog (watchdog.py): the engine
is then dead, as after repeated step failures: every request waiting or running gets an error,
new ones are refused, and health checks fail until the process is restarted. If the stalled step
returns after all, the engine thread only frees what is left and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cadence.boundary import (
    IterationStats,
    QueueCensus,
    RequestDelta,
    RequestSnapshot,
    SchedulerStats,
    WaitInfo,
    WaitReason,
)
from cadence.clock import Clock
from cadence.engine.async_stream import AbortItem, AbortRecord, AddItem, DrainRate, Group, RequestStream
from cadence.engine.kv_transfer import KVTransfer
from cadence.engine.output_processor import OutputProcessor, StreamDelta, attach_final_metrics
from cadence.engine.thread_times import EngineThreadTimes, StepTimer, name_os_thread
from cadence.engine.watchdog import STALL_FACTOR, StepPace, Watchdog
from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.request import DECODE_LEG, DEFAULT_POLICY, Request, RequestPolicy, RequestStatus, SamplingParams
from cadence.sched.records import request_snapshot
from cadence.wording import counted

if TYPE_CHECKING:
    from cadence.engine.builder import Engine
    from cadence.engine.ttft import TTFTPredictor

log = logging.getLogger("cadence.engine")

StatsHook = Callable[[IterationStats | None, SchedulerStats | None], None]
MAX_CONSECUTIVE_STEP_FAILURES = 3  # after this many failed steps in a row the loop is declared dead
_IDLE_WAIT_S = 0.5  # how long an idle engine thread sleeps before looking at its flags again
FINISHED_KEEP = 1024  # finished requests whose state a client may still ask for...
FINISHED_KEEP_S = 300.0  # ...for this long after they end
STATUS_TIMEOUT_S = 10.0  # a status question unanswered this long (the engine stuck in a step) is a 503


@dataclass
class StatusItem:
    """A client asks for a request's state (`tenant`: only if it is that tenant's; None: any)."""

    request_id: str
    tenant: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class CallItem:
    """A function to run on the engine thread between steps (`run_in_engine`)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


Inbox = AddItem | AbortItem | StatusItem | CallItem


class AsyncEngine:
    def __init__(self, engine: Engine, *, stats_hook: StatsHook | None = None, start: bool = True) -> None:
        self.engine = engine
        self.core = engine.core
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_request_tokens = self.core.max_request_tokens
        self.vocab_size = engine.vocab_size
        self.clock: Clock = self.core.clock
        self.stats_hooks: list[StatsHook] = [stats_hook] if stats_hook else []
        self.drain_rate = DrainRate(self.clock)
        self._proc = OutputProcessor(engine.tokenizer)
        self.thread_times = EngineThreadTimes()  # where the engine thread's time goes (/metrics)
        self._inbox: list[Inbox] = []
        self._wake = threading.Condition()
        self._groups: dict[str, Group] = {}  # engine thread only
        self._owner: dict[str, Group] = {}  # sub-request id -> group; engine thread only
        self._members: dict[str, list[Request]] = {}  # group id -> its engine requests; engine thread only
        # Recently ended groups, oldest first: (engine-clock time ended, each choice's last state).
        self._ended: OrderedDict[str, tuple[float, tuple[RequestSnapshot, ...]]] = OrderedDict()
        self._in_flight = 0  # groups admitted and not yet finished (read from the loop side)
        # Client requests whose grammar is compiling: id -> (arrival, tenant, prompt tokens); loop side only.
        self._compiling: dict[str, tuple[float, str, int]] = {}
        self._stop = False
        self._draining = False
        self._dead: str | None = None
        config = engine.config
        self.step_timeout = config.model.step_timeout
        pace = StepPace(config.scheduler.max_num_batched_tokens)
        self._watchdog = Watchdog(self.step_timeout, pace, self._has_work, self._stalled)
        # Set by the server: predicts a waiting request's time to first token when asked (ttft.py).
        self.predictor: TTFTPredictor | None = None
        self._transfer: KVTransfer | None = None  # made on first use (engines that move KV blocks)
        self._thread = threading.Thread(target=self._run, name="cadence-engine", daemon=True)
        if start:
            self._thread.start()
            self._watchdog.start()

    # -- state --------------------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """Liveness: the loop thread is running and has not died of an unrecoverable error."""
        return self._dead is None and self._thread.is_alive()

    @property
    def is_ready(self) -> bool:
        return self.is_healthy and not self._draining

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def dead_reason(self) -> str | None:
        if self._dead is None and not self._thread.is_alive():
            return "the engine thread has stopped"
        return self._dead

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def engine_thread_times(self) -> dict[str, Any]:
        return self.thread_times.as_dict()

    def census(self) -> QueueCensus:
        """The waiting requests by tenant and priority, the running ones by tenant, and the free KV
        blocks still caching a prefix. Walks the queues: call it from a stats hook (this engine's
        thread, between steps), now and then, not every step."""
        sched = self.core.scheduler
        return QueueCensus.of(sched.waiting, sched.running, self.core.kv.count_cached_free_blocks())

    async def request_status(self, request_id: str, tenant: str | None = None) -> tuple[RequestSnapshot, ...] | None:
        """The state of a client request (one snapshot per choice), in flight or ended within the
        last FINISHED_KEEP_S seconds (the last FINISHED_KEEP); None if unknown or, with `tenant`,
        another tenant's. Answered by the engine thread between steps."""
        if not self.is_healthy:
            raise CadenceError(ErrorKind.UNAVAILABLE, f"the engine is not running: {self.dead_reason}")
        compiling = self._compiling.get(request_id)
        if compiling is not None:
            return self._compiling_snapshot(request_id, tenant, *compiling)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._post(StatusItem(request_id, tenant, loop, future))
        try:
            result: tuple[RequestSnapshot, ...] | None = await asyncio.wait_for(future, STATUS_TIMEOUT_S)
        except TimeoutError:
            raise CadenceError(ErrorKind.UNAVAILABLE, "the engine did not answer within "
                               f"{STATUS_TIMEOUT_S:g} s (a long step)") from None
        return result

    @staticmethod
    def _compiling_snapshot(request_id: str, tenant: str | None, arrival: float, owner: str,
                            num_prompt_tokens: int) -> tuple[RequestSnapshot, ...] | None:
        """A request waiting for its grammar, not yet in the engine."""
        if tenant is not None and tenant != owner:
            return None
        wait = WaitInfo(0, WaitReason.GRAMMAR_COMPILING)
        return (RequestSnapshot(request_id, owner, "waiting", None, wait, num_prompt_tokens, 0, 0, 0,
                                arrival_time=arrival),)

    # -- the asyncio side ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        prompt: str | None = None,
        policy: RequestPolicy = DEFAULT_POLICY,
    ) -> AsyncIterator[StreamDelta]:
        """Stream one request's deltas. Refusals (AdmissionError) raise before the first yield."""
        stream = await self.submit([prompt_token_ids], params, request_id=request_id, policy=policy)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    async def submit(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        request_id: str,
        policy: RequestPolicy = DEFAULT_POLICY,
        queue_status: bool = False,
        emitted: int = 0,
    ) -> RequestStream:
        """Admit `len(prompts) * params.n` engine requests all-or-nothing; raise the refusal if any is refused.

        `policy.deadline` is seconds from now. Choice k = prompt_index * n + i; seeded choices use seed + i.
        `queue_status`: the stream's `admission` holds each choice's snapshot as admitted (its place in
        the queue, its predicted time to first token), taken before any step ran it.
        `emitted`: each prompt's last tokens are output another engine streamed already; the text
        goes on from theirs (`OutputProcessor.add_request`).
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        if params.structured_outputs is not None:
            # Compiled here, in the compiler's threads, before the engine thread sees the request:
            # a slow grammar holds only its own request, which shows as waiting meanwhile.
            self._compiling[request_id] = (now, policy.tenant, sum(len(p) for p in prompts))
            try:
                await self.validate_structured(params)
            except ValueError as e:  # refused like any other admission: a 400 naming the field
                raise CadenceError(ErrorKind.INVALID_REQUEST, str(e)) from None
            finally:
                self._compiling.pop(request_id, None)
        requests = fan_out(prompts, params, request_id, now, policy)
        group = Group(request_id, [r.request_id for r in requests], loop, asyncio.Queue())
        future: asyncio.Future = loop.create_future()
        self._post(AddItem(group, requests, future, queue_status, emitted))
        try:
            admission = await future
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while we waited for admission
            raise
        stream = RequestStream(group, self.abort)
        stream.admission = admission
        return stream

    async def validate_structured(self, params: SamplingParams) -> None:
        """Compile `params.structured_outputs` (or find it cached): ValueError naming the field when
        it is refused (the server answers 400). Nothing to do without a constraint."""
        spec = params.structured_outputs
        if spec is None:
            return
        structured = self.core.structured
        if structured is None:
            raise ValueError("structured_outputs: this engine has no grammar support")
        await structured.validate_async(spec)

    async def run_in_engine(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between steps and return its result (or raise its error)."""
        self._check_open()
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._post(CallItem(fn, loop, future))
        return await future

    @property
    def kv_transfer(self) -> KVTransfer:
        """This engine's side of KV transfer; its methods run on the engine thread (`run_in_engine`)."""
        if self._transfer is None:
            self._transfer = KVTransfer(self.core)
        return self._transfer

    def abort(self, request_id: str, error: CadenceError | None = None) -> None:
        """End a request (all its choices) between steps; its blocks are freed. Unknown ids are ignored."""
        self._post(AbortItem(request_id, error))

    def _check_open(self) -> None:
        if not self.is_healthy:
            raise CadenceError(ErrorKind.UNAVAILABLE, f"the engine is not running: {self.dead_reason}")
        if self._draining:
            raise CadenceError(ErrorKind.UNAVAILABLE, "the server is shutting down")

    def _post(self, item: Inbox) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    def _deliver(self, batch: list[tuple[asyncio.Queue, Any]], sent: float | None = None) -> None:
        if sent is not None:  # how long the batch waited for this loop (its thread, or the GIL)
            times = self.thread_times
            times.handoff += time.perf_counter() - sent
            times.handoffs += 1
        for queue, item in batch:
            queue.put_nowait(item)

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
        if future.done():  # cancelled meanwhile: the client left while waiting for an answer
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    # -- draining and shutdown ----------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503); in-flight ones go on."""
        self._draining = True

    def abort_all(self, error: CadenceError) -> None:
        """End every request in flight; each stream gets `error` as its terminal event."""
        self._post(AbortItem("*", error))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread (after aborting whatever is left) and wait for it."""
        self._draining = True
        self.abort_all(CadenceError(ErrorKind.UNAVAILABLE, "the server is shutting down"))
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._watchdog.stop()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        name_os_thread("cadence-engine")
        timer = StepTimer(self.thread_times)
        while True:
            self._watchdog.beat = time.monotonic()
            if self._dead is not None:  # the watchdog declared this thread stalled
                self._after_stall()
                return
            if not self.core.has_unfinished_requests():
                self._flush_idle_stats()
            with self._wake:
                if not self._inbox and not self._stop and not self.core.has_unfinished_requests():
                    self._wake.wait(_IDLE_WAIT_S)
                inbox, self._inbox = self._inbox, []
                stop = self._stop
            timer.mark("idle")
            self._apply(inbox)
            self._settle_transfers()
            timer.mark("inbox")
            if stop:
                return
            if not self.core.has_unfinished_requests():
                continue
            try:
                self._step(timer)
                failures = 0
            except Exception as exc:  # the core could not step: fail what is in flight, maybe die
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                error = CadenceError(ErrorKind.INTERNAL, f"engine step failed: {type(exc).__name__}: {exc}")
                self._apply([AbortItem("*", error)])  # _apply logs, never raises
                if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    self._die(f"{failures} consecutive step failures, last: {type(exc).__name__}: {exc}")
                    return

    def _step(self, timer: StepTimer) -> None:
        deltas = self.core.step()
        self.thread_times.steps += 1
        timer.split("execute", self.core.last_stats.step_time, "schedule_update")
        try:
            out, stopped = self._proc.process(deltas)
        except Exception as exc:  # detokenization failed: fail this step's requests, keep the loop
            log.exception("output processing failed")
            ids = list({d.request_id for d in deltas})
            self._finish_in_core(ids, RequestStatus.FINISHED_ERROR)
            self._send_errors(ids, CadenceError(ErrorKind.INTERNAL, f"output processing failed: {exc}"))
            self._run_hooks()  # the step ran: its tokens and finishes still count
            timer.mark("publish")
            return
        timer.mark("detokenize")
        if stopped:
            attach_final_metrics(out, self._finish_in_core(stopped, RequestStatus.FINISHED_STOPPED))
        it = self._run_hooks()
        self._dispatch(out)
        timer.mark("publish")
        if it is not None and it.num_prompt_tokens == 0 and it.num_generation_tokens == 0 and not out:
            # Requests exist but none could run (all blocked): yield the CPU rather than spin.
            with self._wake:
                if not self._inbox:
                    self._wake.wait(0.002)
            timer.mark("idle")

    def _flush_idle_stats(self) -> None:
        """Report what ended between steps (an abort, a stop string) once nothing is left to run:
        it would otherwise wait in the scheduler for a step that an idle engine does not take."""
        try:
            it = self.core.flush_stats()
        except Exception:  # metrics must never take the engine down
            log.exception("closing the idle engine's stats failed")
            return
        if it is not None:
            self._run_hooks()

    def _run_hooks(self) -> IterationStats | None:
        it = None
        try:
            it, st = self.core.last_stats, self.core.scheduler_stats
            if it is not None:
                self._watchdog.pace.observe(it.step_time, it.num_prompt_tokens + it.num_generation_tokens)
            self.drain_rate.record(len(it.finished) if it is not None else 0, st)
            for hook in self.stats_hooks:
                hook(it, st)
        except Exception:  # metrics must never take the engine down
            log.exception("stats hook failed")
        return it

    def enable_request_events(self) -> None:
        """Record each request's waits, prefill chunks, preemptions and resumes (for its trace); they
        come with its final delta. Call before serving."""
        self.core.record_request_events().name_request = self._client_request_id

    def _client_request_id(self, request_id: str) -> str:
        """The client request an engine request (one choice) belongs to (engine thread)."""
        group = self._owner.get(request_id)
        return group.request_id if group is not None else request_id

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        events = self.core.events
        for d in deltas:
            group = self._owner.get(d.request_id)
            if group is None:
                continue  # aborted: nobody listens
            if d.finished and events is not None:
                d.events = events.pop(d.request_id)
            per_loop.setdefault(group.loop, []).append((group.queue, d))
            if d.finished:
                self._close_sub(group, d.request_id)
        sent = time.perf_counter()
        for loop, batch in per_loop.items():
            self._call(loop, self._deliver, batch, sent)

    def _close_sub(self, group: Group, sub_id: str) -> None:
        self._owner.pop(sub_id, None)
        group.open_ids.discard(sub_id)
        if not group.open_ids and self._groups.pop(group.request_id, None) is not None:
            self._in_flight -= 1
            self._retire(group.request_id)

    def _apply(self, inbox: list[Inbox]) -> None:
        for item in inbox:
            try:
                if isinstance(item, AddItem):
                    self._admit(item)
                elif isinstance(item, AbortItem):
                    self._abort(item)
                elif isinstance(item, CallItem):
                    self._run_call(item)
                else:
                    self._answer_status(item)
            except Exception:
                log.exception("applying %s failed", type(item).__name__)

    def _run_call(self, item: CallItem) -> None:
        try:
            result = item.fn()
        except Exception as exc:  # the caller gets it
            self._call(item.loop, self._resolve, item.future, exc)
            return
        self._call(item.loop, self._resolve, item.future, None, result)

    def _settle_transfers(self) -> None:
        if self._transfer is not None:
            try:
                self._transfer.settle(self._owner.__contains__)
            except Exception:
                log.exception("settling KV reservations failed")

    # -- request status (the engine thread) ---------------------------------------------------------

    def _answer_status(self, item: StatusItem) -> None:
        try:
            snaps = self._status(item.request_id, item.tenant)
        except Exception as exc:
            log.exception("request status failed")
            error = CadenceError(ErrorKind.INTERNAL, f"request status failed: {type(exc).__name__}")
            self._call(item.loop, self._resolve, item.future, error)
            return
        self._call(item.loop, self._resolve, item.future, None, snaps)

    def _status(self, request_id: str, tenant: str | None) -> tuple[RequestSnapshot, ...] | None:
        members = self._members.get(request_id)
        if members is not None:
            if tenant is not None and members[0].tenant != tenant:
                return None
            sched = self.core.scheduler
            return tuple(self._predicted(r, self._client_view(sched.snapshot(r.request_id) or request_snapshot(r),
                                                               tenant)) for r in members)
        self._forget_ended()
        ended = self._ended.get(request_id)
        if ended is None or tenant is not None and ended[1][0].tenant != tenant:
            return None
        return ended[1]

    def _predicted(self, req: Request, snap: RequestSnapshot) -> RequestSnapshot:
        """The snapshot with its predicted time to first token (or why there is none)."""
        if snap.state in ("decoding", "finished") or req.first_token_time is not None:
            return snap  # its first token is out: nothing to predict
        if self.predictor is None:
            return replace(snap, predicted_ttft_unavailable="no cost-model profile is loaded")
        p = self.predictor.predict(self.core.scheduler, req, self.clock.now())
        return replace(snap, predicted_ttft=p.ttft_s, predicted_ttft_unavailable=p.unavailable)

    def _client_view(self, snap: RequestSnapshot, tenant: str | None) -> RequestSnapshot:
        """The request it waits behind named by its client request id, and only if the caller may
        see that one (its own tenant's, or any caller without a tenant)."""
        wait = snap.wait
        if wait is None or wait.behind is None:
            return snap
        group = self._owner.get(wait.behind)
        members = self._members.get(group.request_id) if group is not None else None
        visible = members is not None and group is not None and (tenant is None or members[0].tenant == tenant)
        behind = group.request_id if visible and group is not None else None
        return replace(snap, wait=replace(wait, behind=behind))

    def _retire(self, group_id: str) -> None:
        """A group ended: keep its choices' last state a while for clients that ask after the end."""
        members = self._members.pop(group_id, None)
        if members is None:
            return
        self._ended[group_id] = (self.clock.now(), tuple(request_snapshot(r) for r in members))
        self._ended.move_to_end(group_id)
        self._forget_ended()

    def _forget_ended(self) -> None:
        ended, oldest = self._ended, self.clock.now() - FINISHED_KEEP_S
        while ended and (len(ended) > FINISHED_KEEP or next(iter(ended.values()))[0] < oldest):
            ended.popitem(last=False)

    def _admit(self, add: AddItem) -> None:
        group = add.group
        try:
            self._check_open()
            if group.request_id in self._groups:
                raise CadenceError(ErrorKind.INVALID_REQUEST, f"request id {group.request_id!r} is in use")
            self.core.add_requests(add.requests)  # all or nothing
        except Exception as exc:
            self._call(group.loop, self._resolve, add.future, self._admission_error(exc))
            return
        events = self.core.events
        for req in add.requests:
            self._proc.add_request(req.request_id, req.sampling_params, req.prompt_token_ids, add.emitted)
            self._owner[req.request_id] = group
            if events is not None:
                events.track(req.request_id)
        group.open_ids = set(group.sub_ids)
        self._groups[group.request_id] = group
        self._members[group.request_id] = list(add.requests)
        self._in_flight += 1
        snaps = None
        if add.status:
            try:
                snaps = self._status(group.request_id, None)
            except Exception:  # a status must never cost the admission
                log.exception("request status at admission failed")
        self._call(group.loop, self._resolve, add.future, None, snaps)

    def _admission_error(self, exc: Exception) -> CadenceError:
        busy = (ErrorKind.QUEUE_FULL, ErrorKind.FAIR_SHARE, ErrorKind.TENANT_QUOTA)
        if isinstance(exc, AdmissionError) and exc.kind in busy and exc.retry_after is None:
            exc.retry_after = self.drain_rate.retry_after()
        if isinstance(exc, CadenceError):
            return exc
        if isinstance(exc, ValueError):
            return CadenceError(ErrorKind.INVALID_REQUEST, str(exc))
        log.exception("admission failed", exc_info=exc)
        return CadenceError(ErrorKind.INTERNAL, f"admission failed: {type(exc).__name__}")

    def _abort(self, item: AbortItem) -> None:
        groups = (
            list(self._groups.values()) if item.request_id == "*" else [self._groups.get(item.request_id)]
        )
        for group in groups:
            if group is None:
                continue
            ids = sorted(group.open_ids)
            traced = self.core.events is not None
            outputs = {rid: self._proc.num_output_tokens(rid) for rid in ids} if traced else {}
            for rid in ids:
                self._proc.remove(rid)
                self._owner.pop(rid, None)
            group.open_ids.clear()
            self._groups.pop(group.request_id, None)
            self._in_flight -= 1
            batch: list[tuple[asyncio.Queue, Any]] = []
            try:
                deltas = self.core.abort_requests(ids)
                if traced:  # the span tells how far each choice got
                    batch.append((group.queue, AbortRecord(self._abort_records(deltas, outputs))))
            finally:
                self._forget_events(ids)
                self._retire(group.request_id)
                # Whoever still reads this stream must not wait forever.
                error = item.error or CadenceError(ErrorKind.UNAVAILABLE, "request aborted")
                batch.append((group.queue, error))
                self._call(group.loop, self._deliver, batch)

    def _abort_records(self, deltas: list[RequestDelta], outputs: dict[str, int]) -> tuple[StreamDelta, ...]:
        """Each aborted choice's last record, with its events up to the abort (the core has recorded
        the waits of one that ended while waiting)."""
        events = self.core.events
        assert events is not None
        return tuple(StreamDelta(
            d.request_id, finish_reason=d.finish_reason.value if d.finish_reason else "abort",
            num_prompt_tokens=d.num_prompt_tokens, num_cached_tokens=d.num_cached_tokens,
            num_output_tokens=outputs.get(d.request_id, 0), metrics=d.metrics, events=events.pop(d.request_id),
        ) for d in deltas)

    def _forget_events(self, ids: list[str]) -> None:
        events = self.core.events
        if events is not None:
            for rid in ids:
                events.discard(rid)

    def _finish_in_core(self, ids: list[str], status: RequestStatus) -> list[RequestDelta]:
        try:
            return self.core.finish_requests(ids, status)
        except Exception:
            log.exception("finishing %s in the core failed", counted(len(ids), "request"))
            return []

    def _send_errors(self, sub_ids: list[str], error: CadenceError) -> None:
        for group in {id(g): g for g in (self._owner.get(r) for r in sub_ids) if g is not None}.values():
            self._abort(AbortItem(group.request_id, error))

    def _die(self, reason: str) -> None:
        self._dead = reason
        log.error("engine loop stopped: %s", reason)
        with self._wake:
            pending, self._inbox = self._inbox, []
        self._refuse_pending(pending, reason)

    def _refuse_pending(self, pending: list[Inbox], reason: str) -> None:
        for item in pending:
            err = CadenceError(ErrorKind.UNAVAILABLE, f"the engine is not running: {reason}")
            if isinstance(item, AddItem):
                self._call(item.group.loop, self._resolve, item.future, err)
            elif isinstance(item, (StatusItem, CallItem)):
                self._call(item.loop, self._resolve, item.future, err)

    # -- stalls (the watchdog's thread) -------------------------------------------------------------

    def _has_work(self) -> bool:
        return self._in_flight > 0 or bool(self._inbox)

    def _stalled(self, running: float, limit: float) -> None:
        """The engine thread has been in one turn of its loop for `running` seconds, over `limit`:
        declare the engine dead and answer everyone waiting on it, from this (the watchdog's) thread.
        The engine thread, stuck, touches none of this; if it comes back it sees `_dead` and stops."""
        reason = (f"an engine step has been running for {running:.1f} s, over the {limit:.1f} s limit "
                  f"(--step-timeout {self.step_timeout:g} s, or {STALL_FACTOR:g}x the longest step expected)")
        with self._wake:
            if self._dead is not None or self._stop:
                return
            self._dead = reason
            pending, self._inbox = self._inbox, []
        groups = list(self._groups.values())  # one C-level copy: safe against the engine thread waking
        log.error("engine stalled: %s; failing %s in flight; the engine stays down until the "
                  "process is restarted", reason, counted(len(groups), "request"))
        self._refuse_pending(pending, reason)
        error = CadenceError(ErrorKind.UNAVAILABLE, f"the engine is not running: {reason}")
        for group in groups:
            self._call(group.loop, self._deliver, [(group.queue, error)])

    def _after_stall(self) -> None:
        """The stalled step came back after the engine was declared dead: free what the core holds
        (its requests were answered already) and stop."""
        log.warning("the stalled engine step returned; the engine stays down (restart the process)")
        with self._wake:
            pending, self._inbox = self._inbox, []
        self._refuse_pending(pending, self._dead or "stalled")
        error = CadenceError(ErrorKind.UNAVAILABLE, f"the engine is not running: {self._dead}")
        self._apply([AbortItem("*", error)])

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is left to tell
            loop.call_soon_threadsafe(fn, *args)


def fan_out(prompts: Sequence[list[int]], params: SamplingParams, request_id: str, now: float,
            policy: RequestPolicy) -> list[Request]:
    """The engine requests of one client request: `params.n` choices of each prompt (choice k =
    prompt_index * n + i; seeded choices use seed + i), each with the client request's policy, its
    deadline made absolute on the engine clock (`now` + seconds)."""
    n = params.n
    total = len(prompts) * n
    deadline = None if policy.deadline is None else now + policy.deadline
    requests = []
    for j, toks in enumerate(prompts):
        for i in range(n):
            seed = None if params.seed is None else (params.seed + i) % (1 << 63)
            sub = replace(params, n=1, seed=seed) if n > 1 else params
            rid = request_id if total == 1 else f"{request_id}-{j * n + i}"
            requests.append(
                Request(
                    rid,
                    list(toks),
                    sub,
                    arrival_time=now,
                    priority=policy.priority,
                    tenant=policy.tenant,
                    deadline=deadline,
                    cache_salt=policy.cache_salt,
                    handoff=policy.handoff,
                )
            )
    h = policy.handoff
    if h is not None and h.leg == DECODE_LEG and h.num_emitted:
        for req in requests:  # its next token's latency is from the first one, sampled elsewhere
            req.last_token_time = now - h.since_first_token
    return requests
