"""The replica deployment: one `AsyncEngine` in a Ray Serve replica.

`generate` answers a request's admission: an `Admitted` (or a `Refused`, the engine's own
admission answer). A call naming a `subscriber` ends there, and the request's deltas (and a
`Failed` if it fails midway) travel on that subscriber's `subscribe` stream, with every other
request of that subscriber (fleet/subscription.py); `abort` aborts one. A call without one
streams its own deltas after the admission (the prefill and decode pools); when the ingress
cancels it (its client went away), Serve cancels the generator here and its `finally` aborts the
request in the engine, freeing its blocks.

Serve polls `record_routing_stats` (the fleet router's `ReplicaStats`) and `check_health`
(which fails once the engine's loop is dead, so Serve replaces the replica); `metrics` is this
engine's Prometheus exposition for the ingress to merge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cadence.config import EngineConfig, ServerConfig
from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.fleet.protocol import Admitted, Deltas, Failed, GenerateCall, Refused, Target, policy_at_replica
from cadence.fleet.subscription import IDLE_LINGER_S, Batch, Outbox, pump
from cadence.routing import DIGEST_LIMIT, ReplicaStats, fingerprints

log = logging.getLogger("cadence.fleet")


@dataclass(frozen=True)
class ReplicaObservability:
    """The server's observability options a replica applies to its own engine: OTLP traces (its
    engine span, a child of the ingress's) and the cost profile that predicts time to first token."""

    otlp_traces_endpoint: str | None = None
    otlp_traces_sample_ratio: float | None = None
    cost_profile: str | None = None

    @classmethod
    def of(cls, server_config: ServerConfig) -> ReplicaObservability:
        return cls(server_config.otlp_traces_endpoint, server_config.otlp_traces_sample_ratio,
                   server_config.cost_profile)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to validate requests before any replica sees them."""

    model_name: str
    max_model_len: int
    max_request_tokens: int
    vocab_size: int
    block_size: int
    hash_algo: str


class CadenceReplica:
    def __init__(self, engine_config: EngineConfig, tiny: bool = False, metrics_compat: tuple[str, ...] = (),
                 observability: ReplicaObservability | None = None) -> None:
        import torch
        from ray import serve

        from cadence.engine.async_engine import AsyncEngine
        from cadence.engine.builder import build_engine
        from cadence.engine.ttft import attach_predictor, load_cost_profile
        from cadence.metrics.prometheus import PrometheusExporter

        obs = observability or ReplicaObservability()
        self.name = _replica_name(serve)
        self.engine = AsyncEngine(build_engine(engine_config, tiny=tiny))
        self.exporter = PrometheusExporter(
            vllm_model_name=self.engine.model_name if "vllm" in metrics_compat else None)
        self.engine.stats_hooks.append(self.exporter.record_step)
        self.exporter.record_speculation(engine_config.speculative_config)
        self.exporter.watch_thread_times(self.engine.engine_thread_times)
        predictor = load_cost_profile(obs.cost_profile, torch.get_num_threads())
        if predictor is not None:  # (the TTFT it predicts, and adaptive k's price of drafts)
            attach_predictor(self.engine, predictor)
        self.tracer: Any = None
        if obs.otlp_traces_endpoint is not None:
            from cadence.server.tracing import RequestTracer

            self.tracer = RequestTracer.create(obs.otlp_traces_endpoint, obs.otlp_traces_sample_ratio,
                                               self.exporter.record_spans_dropped)
            self.engine.enable_request_events()
        self._digest: frozenset[int] = frozenset()
        self._outboxes: dict[str, Outbox] = {}  # by subscriber
        self._pumps: dict[str, asyncio.Task] = {}  # a subscribed request's pump, by request id
        log.info("replica %s serving %s", self.name, self.engine.model_name)

    def info(self) -> ReplicaInfo:
        cache = self.engine.engine.config.cache
        return ReplicaInfo(self.engine.model_name, self.engine.max_model_len, self.engine.max_request_tokens,
                           self.engine.vocab_size, cache.block_size, cache.prefix_caching_hash_algo)

    async def generate(self, call: GenerateCall) -> AsyncIterator[Any]:
        start_ns = time.time_ns()
        try:
            stream = await self.engine.submit(call.prompts, call.params, request_id=call.request_id,
                                              policy=policy_at_replica(call, time.time()),
                                              queue_status=call.queue_status)
        except CadenceError as e:
            yield Refused(e.kind.value, str(e), e.param, e.retry_after, isinstance(e, AdmissionError), self.name)
            return
        if call.subscriber is not None:
            self._start_pump(call, stream, start_ns)
            yield Admitted(self.name, stream.admission)
            return
        async for item in self._serve(call, stream, start_ns):
            yield item

    def _start_pump(self, call: GenerateCall, stream: Any, start_ns: int) -> None:
        """The request's items go to its subscriber's outbox (its `Admitted` is the call's answer)."""
        assert call.subscriber is not None
        outbox = self._outboxes.get(call.subscriber)
        if outbox is None:
            outbox = self._outboxes[call.subscriber] = Outbox()
        outbox.open(call.request_id)
        items = self._serve(call, stream, start_ns)
        task = asyncio.get_running_loop().create_task(pump(_after_admission(items), call.request_id, outbox))
        self._pumps[call.request_id] = task
        subscriber = call.subscriber
        task.add_done_callback(lambda t: self._pump_done(call.request_id, t, subscriber, outbox))

    def _pump_done(self, request_id: str, task: asyncio.Task, subscriber: str, outbox: Outbox) -> None:
        if self._pumps.get(request_id) is task:
            del self._pumps[request_id]
        # A subscriber that left with streams open is not coming back for them (`subscribe` aborted
        # them): its outbox goes with the last of them. (One not yet connected keeps its outbox.)
        if outbox.departed and not outbox.streams and self._outboxes.get(subscriber) is outbox:
            del self._outboxes[subscriber]

    async def subscribe(self, subscriber: str, target: Target | None = None) -> AsyncIterator[Batch]:
        """The deltas of `subscriber`'s requests here, one batch of whatever is ready at a time;
        it ends once none of them has been open for a while. Cancelled (its reader is gone), it
        aborts them."""
        outbox = self._outboxes.get(subscriber)
        if outbox is None:
            outbox = self._outboxes[subscriber] = Outbox()
        outbox.connect()
        try:
            yield {}  # (the ingress knows it is connected)
            while (batch := await outbox.take(IDLE_LINGER_S)) is not None:
                yield batch
        except BaseException:
            outbox.departed = bool(outbox.streams)
            for request_id in list(outbox.streams):
                self._abort(request_id)
            raise
        finally:
            outbox.disconnect()
            if outbox.idle and self._outboxes.get(subscriber) is outbox:
                del self._outboxes[subscriber]

    async def abort(self, request_id: str, target: Target | None = None) -> None:
        """Abort a subscribed request (its reader left). A coroutine, so that it runs on the loop
        that owns the request's pump: Serve runs a plain method in a worker thread, and a task is
        not to be cancelled from another thread."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        task = self._pumps.get(request_id)
        if task is not None:
            task.cancel()

    async def _serve(self, call: GenerateCall, stream: Any, start_ns: int) -> AsyncIterator[Any]:
        """An admitted request's `Admitted`, deltas and `Failed`, and its span when traced. Deltas
        already delivered together (several choices of a step, a burst the ingress was slow to
        take) go as one `Deltas` item: one Ray message each time, not one per delta."""
        traced = self.tracer is not None and call.trace_context is not None
        finals: dict[int, Any] = {}
        error: BaseException | None = None
        pending: list[Any] = []
        try:
            yield Admitted(self.name, stream.admission)
            async for delta in stream:
                if traced and delta.finished:
                    finals[stream.index_of(delta.request_id)] = delta
                pending.append(delta)
                if stream.ready():  # more is here already: read it before sending
                    continue
                yield _item(pending)
                pending = []
            if pending:
                yield _item(pending)
        except CadenceError as e:
            error = e
            if pending:
                yield _item(pending)
            yield Failed(e.kind.value, str(e), e.retry_after)
        finally:
            await stream.aclose()  # (a no-op once every choice finished; else the request is aborted)
            if traced:
                self._end_span(call, start_ns, finals, error)

    def _end_span(self, call: GenerateCall, start_ns: int, finals: dict[int, Any], error: BaseException | None) -> None:
        try:
            assert call.trace_context is not None
            self.tracer.end_engine_span(call.trace_context, call.request_id, self.name, start_ns, finals, error)
        except Exception:  # a trace must never cost a response
            log.exception("tracing request %s failed", call.request_id)

    # -- polled by Serve ------------------------------------------------------------------------------

    def record_routing_stats(self) -> dict[str, Any]:
        st = self.engine.core.scheduler_stats
        return ReplicaStats(st.num_running, st.num_waiting, st.num_free_blocks, self._read_digest()).to_dict()

    def _read_digest(self) -> frozenset[int]:
        # The engine thread changes the cache while this reads it: a read that meets a change is
        # tried again, and the last digest kept if it keeps meeting them.
        kv = self.engine.core.kv
        for _ in range(3):
            try:
                self._digest = frozenset(fingerprints(kv.cached_hashes(DIGEST_LIMIT)))
                break
            except RuntimeError:
                continue
        return self._digest

    async def request_status(self, request_id: str, tenant: str | None, target: Target | None = None) -> Any:
        """The engine's snapshots of a request this replica served (`GET /v1/requests/{id}`)."""
        return await self.engine.request_status(request_id, tenant)

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError(f"the engine loop is not running: {self.engine.dead_reason}")

    def metrics(self, target: Target | None = None) -> str:
        """This engine's Prometheus exposition (`target`: how the ingress addresses this replica)."""
        self.exporter.record_scheduler(self.engine.core.scheduler_stats)
        return self.exporter.render()[0].decode()

    def load(self, target: Target | None = None) -> tuple[str, int, int]:
        """(its name, requests admitted and not finished, requests running): for tests and operators."""
        return self.name, self.engine.num_in_flight, self.engine.core.scheduler_stats.num_running

    def node_id(self, target: Target | None = None) -> str:
        """The Ray node this replica runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5.0)
        tracer = getattr(self, "tracer", None)
        if tracer is not None:
            tracer.shutdown()


async def _after_admission(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`_serve`'s items without its first, the `Admitted` (the call answered it already)."""
    try:
        first = True
        async for item in items:
            if not first:
                yield item
            first = False
    finally:
        await items.aclose()  # type: ignore[attr-defined]


def _item(deltas: list[Any]) -> Any:
    """One stream item for `deltas`: the delta itself when alone."""
    return deltas[0] if len(deltas) == 1 else Deltas(tuple(deltas))


def _replica_name(serve: Any) -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside Serve (a unit test building the class directly)
        return "local"


def refusal_error(r: Refused) -> CadenceError:
    kind = ErrorKind(r.kind)
    cls = AdmissionError if r.admission else CadenceError
    return cls(kind, r.message, param=r.param, retry_after=r.retry_after)
