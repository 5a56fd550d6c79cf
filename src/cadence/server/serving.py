"""Completions and chat completions: check against the model, submit to the engine, answer JSON or SSE.

The first result is awaited before any header is sent (as llama.cpp's server does), so a refusal or
a failure before the first token is a real HTTP error with a real status. After the first token an
error can only be an SSE error event, followed by `data: [DONE]`. A client that goes away, while
queued or running, streaming or not, has its request aborted within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cadence.config import ServerConfig
from cadence.engine.output_processor import StreamDelta
from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.metrics.prometheus import PrometheusExporter
from cadence.server.engine_client import TRACE_CARRIER, EngineClient
from cadence.server.engine_client import EngineStream as RequestStream
from cadence.server.errors import error_payload
from cadence.server.formats import (
    DONE_EVENT,
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    TokenStrings,
    UsageTracker,
    queue_comment,
    sse,
)
from cadence.server.inputs import InputBuilder, Job
from cadence.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cadence.server.tools import NO_TOOLS, ToolPlan
from cadence.wording import counted

if TYPE_CHECKING:  # the OpenTelemetry SDK is loaded only when tracing is on
    from cadence.server.tracing import RequestTrace, RequestTracer

log = logging.getLogger("cadence.server")

# How long an aborted request's span waits for the engine's last records of it (the abort takes
# effect between two steps); beyond, the span is ended with what it has.
ABORT_RECORDS_WAIT_S = 30.0


class DisconnectWatcher:
    """Calls `on_disconnect` when the client goes away (the ASGI `http.disconnect` message)."""

    def __init__(self, raw: Request, on_disconnect: Callable[[], None]) -> None:
        self._task = asyncio.ensure_future(self._watch(raw.receive, on_disconnect))

    @staticmethod
    async def _watch(receive: Callable[[], Any], on_disconnect: Callable[[], None]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    def stop(self) -> None:
        self._task.cancel()


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        config: ServerConfig,
        exporter: PrometheusExporter | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.exporter = exporter
        self.tracer = tracer  # None: tracing off, and no tracing work at all
        self.tokens = TokenStrings(engine.tokenizer)
        self.active = 0  # generation requests whose response is not finished (drain waits for them)
        self.tenant_in_flight: Counter[str] = Counter()
        self.inputs = InputBuilder(engine, config)
        self._trace_tasks: set[asyncio.Future] = set()  # spans waiting for an abort's records

    # -- routes -------------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        received_ns = time.time_ns()
        self.inputs.check_model(body.model)
        with self.counting_refusals():
            constraint = self.inputs.constraint(body)
            prompts = [
                await self.inputs.prompt_ids(p, "prompt", split_special_tokens=body.split_special_tokens,
                                             add_special_tokens=body.add_special_tokens)
                for p in body.prompts()
            ]
            job = self.inputs.job("cmpl", body, raw, prompts, body.max_tokens, body.logprobs, "prompt",
                                  constraint.params if constraint else None)
            job = replace(job, constraint_field=constraint.field if constraint else None)
            await self.inputs.check_constraint(constraint, job.params)
        fmt = CompletionFormatter(
            job.request_id,
            self.engine.model_name,
            int(time.time()),
            len(prompts) * body.n,
            self.tokens,
            body.logprobs is not None,
        )
        return await self._run(job, fmt, raw, received_ns)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        received_ns = time.time_ns()
        self.inputs.check_model(body.model)
        with self.counting_refusals():
            plan = self.inputs.tool_plan(body)
            constraint = self.inputs.constraint(body, plan)
            messages, tools = self.inputs.chat_messages(body.messages, body.chat_template, plan)
            ids = await self.inputs.chat_ids(messages, body.add_generation_prompt, body.chat_template,
                                             body.add_special_tokens, tools)
            job = self.inputs.job(
                "chatcmpl", body, raw, [ids], body.requested_max_tokens(), body.num_logprobs(), "messages",
                constraint.params if constraint else None,
            )
            job = replace(job, constraint_field=constraint.field if constraint else None)
            await self.inputs.check_constraint(constraint, job.params)
        fmt = ChatFormatter(
            job.request_id, self.engine.model_name, int(time.time()), body.n, self.tokens, body.logprobs,
            extractor=plan.extractor(),
        )
        return await self._run(job, fmt, raw, received_ns)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.inputs.check_model(body.model)
        if body.messages is not None:
            plan = ToolPlan("auto", tuple(body.tools)) if body.tools else NO_TOOLS
            messages, tools = self.inputs.chat_messages(body.messages, None, plan)
            ids = await self.inputs.chat_ids(
                messages,
                body.add_generation_prompt,
                None,
                bool(body.add_special_tokens),
                tools,
            )
        else:
            ids = await self.inputs.prompt_ids(
                body.prompt or "", "prompt", allow_empty=True, split_special_tokens=body.split_special_tokens,
                add_special_tokens=body.add_special_tokens is not False,
            )
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}
        if body.return_token_strs:
            out["token_strs"] = [self.tokens(t) for t in ids]
        return out

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.inputs.check_model(body.model)
        self.inputs.check_ids(body.tokens, "tokens")
        return {"prompt": self.engine.tokenizer.decode(body.tokens)}

    # -- refusals -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def counting_refusals(self) -> Iterator[None]:
        """Count a generation request refused as invalid (HTTP 400) while its body is read or its
        engine input built, before the engine sees it: a prompt longer than the context, a bad
        parameter, a body that does not parse."""
        try:
            yield
        except CadenceError as e:  # APIError too
            if e.kind is ErrorKind.INVALID_REQUEST:
                self._count_refusal(ErrorKind.INVALID_REQUEST)
            raise
        except ValueError:  # pydantic's ValidationError and SamplingParams' checks: answered 400
            self._count_refusal(ErrorKind.INVALID_REQUEST)
            raise

    def _count_refusal(self, kind: ErrorKind) -> None:
        if self.exporter is not None:
            self.exporter.record_rejection(kind.value)

    # -- running ------------------------------------------------------------------------------------

    def _acquire(self, job: Job) -> None:
        cap = self.config.tenant_max_requests
        if cap is not None and self.tenant_in_flight[job.policy.tenant] >= cap:
            self._count_refusal(ErrorKind.TENANT_QUOTA)
            raise AdmissionError(
                ErrorKind.TENANT_QUOTA,
                f"tenant {job.policy.tenant!r} has {counted(cap, 'request')} in flight, its cap; retry later",
                retry_after=self.engine.drain_rate.retry_after(),
            )
        self.tenant_in_flight[job.policy.tenant] += 1
        self.active += 1

    def _release(self, job: Job) -> None:
        self.active -= 1
        self.tenant_in_flight[job.policy.tenant] -= 1
        if self.tenant_in_flight[job.policy.tenant] <= 0:
            del self.tenant_in_flight[job.policy.tenant]

    async def _run(self, job: Job, fmt: Formatter, raw: Request, received_ns: int) -> Response:
        trace = self._begin_trace(raw, received_ns)
        usage = UsageTracker(job.params.n)
        try:
            self._acquire(job)
        except BaseException as e:
            self._end_trace(job, trace, usage, e)
            raise
        handed_over = False
        watcher = DisconnectWatcher(raw, lambda: self._client_left(job, trace))
        try:
            carried = None
            if trace is not None:
                trace.submit_ns = time.time_ns()
                carried = TRACE_CARRIER.set(trace.carrier())  # for an engine in another process
            try:
                stream = await self._submit(job)
            finally:
                if carried is not None:
                    TRACE_CARRIER.reset(carried)
            if job.stream and job.queue_status:
                # Answered now, before the first token: later refusals become the stream's error event.
                preamble = _queue_preamble(getattr(stream, "admission", None))
                watcher.stop()
                handed_over = True
                done = self._finisher(job, stream, usage, trace)
                return self._streaming(job, fmt, None, stream, done, usage, trace, preamble)
            try:
                first = await self._first(stream, usage)
            except BaseException as e:
                await stream.aclose()
                _add_aborted(stream, usage)
                if isinstance(e, CadenceError) and e.kind is ErrorKind.FAIR_SHARE:
                    self._count_refusal(e.kind)  # dropped from the queue for another tenant's request
                raise
            if job.stream:
                watcher.stop()  # from here on Starlette notices the disconnect and cancels the stream
                handed_over = True
                done = self._finisher(job, stream, usage, trace)
                return self._streaming(job, fmt, first, stream, done, usage, trace)
            try:
                return JSONResponse(await self._collect(fmt, first, stream, usage), headers={"X-Request-Id": job.request_id})
            finally:
                await stream.aclose()
                _add_aborted(stream, usage)
        except CadenceError as e:
            e = job.in_request_terms(e)
            if trace is not None:
                trace.error = e
            raise e from None
        except BaseException as e:
            if trace is not None:
                trace.error = e
            raise
        finally:
            watcher.stop()
            if not handed_over:
                self._release(job)
                self._end_trace(job, trace, usage)

    def _streaming(self, job: Job, fmt: Formatter, first: StreamDelta | None, stream: RequestStream,
                   done: Callable[[], Awaitable[None]], usage: UsageTracker, trace: RequestTrace | None,
                   preamble: bytes = b"") -> EngineStreamingResponse:
        return EngineStreamingResponse(
            self._sse(job, fmt, first, stream, done, usage, trace, preamble),
            done,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": job.request_id},
        )

    # -- tracing (nothing runs here while tracing is off) -------------------------------------------

    def _begin_trace(self, raw: Request, received_ns: int) -> RequestTrace | None:
        if self.tracer is None:
            return None
        return self.tracer.begin(raw.headers, received_ns)

    def _client_left(self, job: Job, trace: RequestTrace | None) -> None:
        if trace is not None:
            trace.client_left = True
        self.engine.abort(job.request_id)

    def _end_trace_after_abort(self, job: Job, stream: RequestStream, usage: UsageTracker,
                               trace: RequestTrace | None) -> None:
        """End the span of a request whose stream closed before every choice finished: once the
        engine has answered the abort with the choices' last records (events, metrics), in the
        background, so that neither the abort nor the response waits for it."""
        last_records = getattr(stream, "last_records", None)
        if trace is None or last_records is None or len(usage.finals) >= len(job.prompts) * job.params.n:
            self._end_trace(job, trace, usage)
            return

        async def end() -> None:
            try:
                for d in await last_records(ABORT_RECORDS_WAIT_S):
                    i = stream.index_of(d.request_id)
                    if i not in usage.finals:
                        usage.add(i, d)
            finally:
                self._end_trace(job, trace, usage)

        task = asyncio.ensure_future(end())
        self._trace_tasks.add(task)
        task.add_done_callback(self._trace_tasks.discard)

    def _end_trace(
        self, job: Job, trace: RequestTrace | None, usage: UsageTracker, error: BaseException | None = None
    ) -> None:
        if trace is None or self.tracer is None:
            return
        from cadence.server.tracing import SpanFacts

        try:
            trace.error = trace.error or error
            if trace.client_left and _is_abort(trace.error):
                trace.error = None  # the client went away: an abort, not a failure (its finish reason says so)
            trace.finals = usage.finals
            counts = usage.as_dict()
            p = job.params
            self.tracer.end(trace, SpanFacts(
                request_id=job.request_id, model=self.engine.model_name, max_tokens=p.max_tokens,
                temperature=p.temperature, top_p=p.top_p, n=p.n, num_sequences=len(job.prompts) * p.n,
                tenant=job.policy.tenant, priority=job.policy.priority, deadline=job.policy.deadline,
                prompt_tokens=counts["prompt_tokens"], completion_tokens=counts["completion_tokens"],
                cached_tokens=counts["prompt_tokens_details"]["cached_tokens"],
            ))
        except Exception:  # a trace must never cost a response
            log.exception("tracing request %s failed", job.request_id)

    async def _submit(self, job: Job) -> RequestStream:
        try:
            if job.stream and job.queue_status:  # (only then: an engine client need not know the option)
                return await self.engine.submit(job.prompts, job.params, request_id=job.request_id,
                                                policy=job.policy, queue_status=True)
            return await self.engine.submit(
                job.prompts,
                job.params,
                request_id=job.request_id,
                policy=job.policy,
            )
        except CadenceError as e:
            # The engine's refusals too, counted here as they are answered: the core reports its own
            # only with its next step, which an idle engine never runs.
            self._count_refusal(e.kind)
            raise

    @staticmethod
    async def _first(stream: RequestStream, usage: UsageTracker) -> StreamDelta:
        first = await anext(stream)
        if first.finished and not first.token_ids and first.finish_reason in ("deadline", "abort"):
            usage.add(stream.index_of(first.request_id), first)  # for its span: how it waited and ended
            if first.finish_reason == "deadline":
                raise CadenceError(ErrorKind.DEADLINE, "the request's deadline passed before it was served")
            if first.finish_reason == "abort":
                raise CadenceError(ErrorKind.UNAVAILABLE, "the request was aborted before it was served")
        return first

    async def _collect(
        self, fmt: Formatter, first: StreamDelta, stream: RequestStream, usage: UsageTracker
    ) -> dict[str, Any]:
        d: StreamDelta | None = first
        while d is not None:
            i = stream.index_of(d.request_id)
            usage.add(i, d)
            fmt.accumulate(i, d)
            d = await anext(stream, None)
        return fmt.response(usage.as_dict())

    def _finisher(
        self, job: Job, stream: RequestStream, usage: UsageTracker, trace: RequestTrace | None
    ) -> Callable[[], Awaitable[None]]:
        """Abort what is left and release the request's slot, once, whoever gets there first."""
        done = False

        async def finish() -> None:
            nonlocal done
            if not done:
                done = True
                await stream.aclose()
                self._release(job)
                self._end_trace_after_abort(job, stream, usage, trace)

        return finish

    async def _sse(
        self,
        job: Job,
        fmt: Formatter,
        first: StreamDelta | None,
        stream: RequestStream,
        done: Callable[[], Awaitable[None]],
        usage: UsageTracker,
        trace: RequestTrace | None,
        preamble: bytes = b"",
    ) -> AsyncIterator[bytes]:
        try:
            if preamble:
                yield preamble
            if first is None:
                first = await self._first(stream, usage)
            for start in fmt.start_chunks():
                yield sse(_with_usage(start, job, usage))
            d: StreamDelta | None = first
            while d is not None:
                i = stream.index_of(d.request_id)
                usage.add(i, d)
                for chunk in fmt.chunks(i, d):
                    yield sse(_with_usage(chunk, job, usage))
                d = await anext(stream, None)
            if job.include_usage:
                yield sse(fmt.usage_chunk(usage.as_dict()))
        except CadenceError as e:
            e = job.in_request_terms(e)
            if trace is not None:
                trace.error = e
            yield sse(error_payload(e.kind, e.message, e.param))
        except Exception as e:
            if trace is not None:
                trace.error = e
            log.exception("stream %s failed", job.request_id)
            yield sse(error_payload(ErrorKind.INTERNAL, f"internal error: {type(e).__name__}"))
        finally:
            await done()
        yield DONE_EVENT


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `done`, even when the client leaves before the body starts
    (Starlette then cancels the body iterator before its first step, so its `finally` never runs)."""

    def __init__(self, content: AsyncIterator[bytes], done: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._done = done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._done()


def _with_usage(chunk: dict[str, Any], job: Job, usage: UsageTracker) -> dict[str, Any]:
    if job.continuous_usage:
        # As vLLM: the counts of the chunk's own choice so far (its prompt, its tokens generated).
        index = chunk["choices"][0]["index"]
        chunk["usage"] = usage.choice_dict(index, len(job.prompts[index // job.params.n]))
    elif job.include_usage:
        chunk["usage"] = None  # OpenAI sends a null usage on every chunk but the last
    return chunk


def _queue_preamble(snaps: tuple[Any, ...] | None) -> bytes:
    """The opening comment of a stream that asked for its queue status, from the engine's snapshots
    of its choices as admitted: the best-placed choice, and the earliest predicted first token."""
    if not snaps:
        return queue_comment(None, None, "unknown")
    waiting = [s for s in snaps if s.queue_position is not None]
    head = min(waiting, key=lambda s: s.queue_position) if waiting else snaps[0]
    predicted = [s.predicted_ttft for s in snaps if s.predicted_ttft is not None]
    return queue_comment(head.queue_position, min(predicted) if predicted else None, head.state)


def _add_aborted(stream: RequestStream, usage: UsageTracker) -> None:
    """The choices an abort ended, as the engine last saw them (read with the abort's error), for
    the span; choices that finished before keep their own last delta."""
    for d in getattr(stream, "aborted", ()):
        i = stream.index_of(d.request_id)
        if i not in usage.finals:
            usage.add(i, d)


def _is_abort(error: BaseException | None) -> bool:
    return isinstance(error, CadenceError) and error.kind is ErrorKind.UNAVAILABLE
