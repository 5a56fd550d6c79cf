"""Disaggregated prefill and decode (xPyD) on the simulator's virtual time.

A P/D fleet has two pools of the same engine (the same core, scheduler and KV cache manager as a
colocated replica). A request is routed to a prefill replica with the fleet's routing function
(prefix affinity by default) and runs there with `max_tokens=1`: that replica computes its prompt
and samples its first token, so its time to first token is the prefill side's, as in vLLM's
disaggregated serving. Its KV then moves to a decode replica picked by load (least-loaded over
the decode pool, the same routing function), which decodes the rest.

The move is modelled, not performed:

- The bytes are the prompt's blocks the decode replica does not hold already (the leading blocks
  found in its prefix cache travel for nothing), whole blocks, times the profile's
  `kv_bytes_per_token`. Its time is bytes / bandwidth + latency, on a link per decode replica:
  transfers into one replica go one after another, each waiting for the link to be free.
- The transfer counts against the decode replica's KV budget before it starts: the blocks it
  writes are allocated on that replica (as a request of its own, `<id>/kv`, through the KV
  manager), and it starts only when they, plus the blocks the request then needs for its last
  partial block and first token, are free beyond what the transfers already held still need. A
  request that finds too few waits for decode admission (its own wait, counted in the report),
  in priority order then in order of its prefill's end.
- When the transfer lands, its full blocks are published in the decode replica's prefix cache
  and the request joins that replica's queue with its prompt plus the first token; its admission
  hits every full prompt block, and its first step computes the last partial block and the first
  token (the prefix cache indexes full blocks only, so those few tokens are recomputed, though
  their bytes were counted in the transfer). The reservation is released once the request holds
  the blocks itself.

Priorities, tenants and deadlines travel with the request (the deadline is the same instant on
both sides); the decode replica's admission applies its own queue limits and policy.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Any

from cadence.bench.report import RequestRecord, percentile
from cadence.config import EngineConfig
from cadence.errors import HTTP_STATUS, AdmissionError
from cadence.executor.cost_model import DEFAULT_SIM_TOKEN, StepCostModel
from cadence.kv.manager import KVCacheManager
from cadence.request import Request
from cadence.routing import Router, fingerprints
from cadence.sim.pd import PDOptions, transfer_bytes, transfer_seconds
from cadence.sim.simulator import OK_REASONS, SimOptions, SimReplica, SimResult, Simulator
from cadence.workload import Workload, WorkloadRequest

PREFILL, DECODE = "prefill", "decode"
_HANDOFF, _LANDED = 0, 1  # the two kinds of hand-off event


@dataclass(eq=False)
class _Handoff:
    """One request between its prefill's end and its decode replica's admission."""

    rid: str
    rec: RequestRecord
    wr: WorkloadRequest
    tokens: list[int]  # the prompt and the first token: the decode side's request
    ready: float  # when its prefill ended (clock reading)
    prefill_queue_time: float | None
    decode: SimReplica | None = None
    seq: int = 0
    placeholder: Request | None = None  # the reservation on the decode replica, until admission
    tail: int = 0  # blocks its admission takes beyond the reservation
    nbytes: int = 0
    resident: int = 0  # prompt blocks the decode replica held already
    start: float = 0.0  # when its transfer started (after any wait for decode admission)
    landed: float = 0.0


@dataclass
class _Transfers:
    """What the hand-offs did, for the report."""

    nbytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # prefill end -> blocks in on the decode side
    admission_waits: list[float] = field(default_factory=list)  # of those that waited for blocks
    resident_blocks: int = 0
    refused: int = 0

    def summary(self, pd: PDOptions) -> dict[str, Any]:
        n = len(self.nbytes)
        return {"prefill_replicas": pd.prefill_replicas, "decode_replicas": pd.decode_replicas,
                "kv_transfer_bandwidth_gbps": pd.kv_transfer_bandwidth,
                "kv_transfer_latency_ms": pd.kv_transfer_latency_ms, "transfers": n,
                "bytes_total": sum(self.nbytes), "bytes_mean": sum(self.nbytes) / n if n else 0.0,
                "bytes_p95": percentile(self.nbytes, 95) if n else 0.0,
                "seconds_mean": sum(self.seconds) / n if n else 0.0,
                **{f"seconds_p{q}": percentile(self.seconds, q) if n else 0.0 for q in (50, 95, 99)},
                "resident_blocks_skipped": self.resident_blocks,
                "waited_for_decode_admission": len(self.admission_waits),
                "decode_admission_wait_p95_s": percentile(self.admission_waits, 95) if self.admission_waits else 0.0,
                "refused_by_decode": self.refused}


class PDSimulator(Simulator):
    """`Simulator` for a P/D fleet: replicas [0, P) prefill, [P, P + D) decode. One `run` per instance."""

    def __init__(self, config: EngineConfig, cost_model: StepCostModel | None, options: SimOptions = SimOptions(),
                 pd: PDOptions = PDOptions(), **kwargs: Any) -> None:
        self.pd = pd.validate()
        if config.speculative_config is not None:
            raise ValueError("speculative_config: a simulated P/D fleet does not model speculative decoding; "
                             "simulate a colocated fleet (--replicas) for it")
        if not config.cache.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: a decode replica takes the transferred KV as prefix-cache "
                             "blocks; P/D needs prefix caching on")
        super().__init__(config, cost_model, replace(options, replicas=pd.prefill_replicas + pd.decode_replicas),
                         **kwargs)
        self._np = pd.prefill_replicas
        self._decode_router = Router("least-loaded")
        rep = self.replicas[self._np]
        self._kv_bytes_per_token = rep.executor.kv_bytes_per_block(self._block_size) // self._block_size
        self._token = getattr(rep.executor, "token_id", DEFAULT_SIM_TOKEN)
        self._events: list[tuple[float, int, int, _Handoff]] = []
        self._seq = 0
        self._pending: dict[int, list[tuple[int, int, _Handoff]]] = {r.index: [] for r in self.decode_pool}
        self._held: dict[int, dict[str, _Handoff]] = {r.index: {} for r in self.decode_pool}
        self._held_tail = {r.index: 0 for r in self.decode_pool}
        self._link_free = {r.index: -math.inf for r in self.decode_pool}
        # Prefix-cache lookups the reservations made: not the requests', taken out of the stats.
        self._reserve_queries = {r.index: 0 for r in self.decode_pool}
        self._reserve_hits = {r.index: 0 for r in self.decode_pool}
        self.transfers = _Transfers()

    @property
    def prefill_pool(self) -> list[SimReplica]:
        return self.replicas[: self._np]

    @property
    def decode_pool(self) -> list[SimReplica]:
        return self.replicas[self._np :]

    def pool_of(self, index: int) -> str:
        return PREFILL if index < self._np else DECODE

    # -- the prefill side --------------------------------------------------------------------------

    def _first_leg_tokens(self, wr: WorkloadRequest) -> int:
        return 1

    def _route(self, prompt: list[int], t: float) -> int:
        """A prefill replica, as the colocated fleet's router would choose among them."""
        if self._np == 1:
            return 0
        router = self.router
        if not router.wants_prefixes:
            return router.route_by_load(self._outstanding[: self._np])
        chain = fingerprints(self._hash_chain(prompt, self._block_size, None, ()))
        return router.route(chain, [self._replica_stats(rep, t) for rep in self.prefill_pool])

    def _end(self, rid: str, rec: RequestRecord, rep: SimReplica, rel: float, reason: str, queue_time: float | None,
             error: str | None) -> None:
        if rep.index >= self._np:  # a decode leg ended: the request's end
            h = self._held[rep.index].get(rid)
            if h is not None:  # ended (a deadline) before its admission took the blocks
                self._release(rep, h)
            prefill_q = self._prefill_queue.pop(rid, None)
            if queue_time is not None and prefill_q is not None:
                queue_time += prefill_q
        elif reason in OK_REASONS and rec.output_tokens_asked > 1:  # its prompt is done: hand it off
            self._outstanding[rep.index] -= 1
            del self._live[rid], self._times[rid]  # (until its decode replica has it: `_landed`)
            wr = self._workload.requests[rec.index]
            tokens = self._synth.prompt(rec.index, wr)
            tokens.append(self._token)
            h = _Handoff(rid, rec, wr, tokens, self._t0 + rel, queue_time)
            self._in_transit[rid] = h
            self._push(h.ready, _HANDOFF, h)
            return
        super()._end(rid, rec, rep, rel, reason, queue_time, error)

    def _push(self, t: float, kind: int, h: _Handoff) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, h))

    # -- the hand-off ------------------------------------------------------------------------------

    def _handoff(self, h: _Handoff, t: float) -> None:
        """Its prefill ended at `t`: pick its decode replica and start its transfer, or queue it
        there for decode admission."""
        d = self._decode_router.route_by_load(self._outstanding[self._np :])
        rep = self.replicas[self._np + d]
        h.decode = rep
        self._outstanding[rep.index] += 1
        if rep.stretch is not None:  # its cache as of `t`
            self._cut(rep, t)
        self._seq += 1
        h.seq = self._seq
        heapq.heappush(self._pending[rep.index], (h.wr.priority, h.seq, h))
        self._start_transfers(rep, t)

    def _start_transfers(self, rep: SimReplica, t: float) -> None:
        """Start the waiting transfers into `rep` that its free blocks allow, in order."""
        pending = self._pending[rep.index]
        while pending:
            h = pending[0][2]
            if not self._reserve(rep, h):
                return
            heapq.heappop(pending)
            if t > h.ready:
                self.transfers.admission_waits.append(t - h.ready)
            self._send_kv(rep, h, t)

    def _reserve(self, rep: SimReplica, h: _Handoff) -> bool:
        """Allocate on `rep` the blocks `h`'s transfer writes, if they and its admission's fit."""
        kv: KVCacheManager = rep.core.kv
        bs = self._block_size
        ph = Request(f"{h.rid}/kv", h.tokens, self._sampling(1))
        hit, _ = kv.get_computed_blocks(ph)  # every full prompt block at most (the first token is extra)
        full = (len(h.tokens) - 1) // bs
        writes = (full - len(hit)) * bs
        tail = kv.num_blocks_needed(len(h.tokens)) - full
        take = kv.blocks_to_take(ph, writes, hit)
        if kv.num_free_blocks - self._held_tail[rep.index] < take + tail:
            return False
        assert kv.allocate_slots(ph, writes, hit) is not None, "free blocks checked above"
        self._reserve_queries[rep.index] += ph.num_tokens
        self._reserve_hits[rep.index] += len(hit) * bs
        h.placeholder, h.tail, h.resident = ph, tail, len(hit)
        self._held[rep.index][h.rid] = h
        self._held_tail[rep.index] += tail
        return True

    def _send_kv(self, rep: SimReplica, h: _Handoff, t: float) -> None:
        pd = self.pd
        h.nbytes = transfer_bytes(len(h.tokens) - 1, h.resident, self._block_size, self._kv_bytes_per_token)
        h.start = max(t, self._link_free[rep.index])
        wire = h.nbytes / (pd.kv_transfer_bandwidth * 1e9)
        self._link_free[rep.index] = h.start + wire
        h.landed = h.start + transfer_seconds(h.nbytes, pd.kv_transfer_bandwidth, pd.kv_transfer_latency_ms)
        self.transfers.nbytes.append(h.nbytes)
        self.transfers.seconds.append(h.landed - h.ready)
        self.transfers.resident_blocks += h.resident
        self._push(h.landed, _LANDED, h)

    def _landed(self, h: _Handoff, t: float) -> None:
        """Its blocks are in at `t`: publish them and queue the request on its decode replica."""
        rep = h.decode
        assert rep is not None and h.placeholder is not None
        ph = h.placeholder
        ph.num_computed_tokens = (len(h.tokens) - 1) // self._block_size * self._block_size
        rep.core.kv.cache_computed_blocks(ph)
        if rep.stretch is not None:
            self._cut(rep, t)
        if not rep.in_heap:
            rep.clock.advance_to(t)
        wr, rec = h.wr, h.rec
        deadline = None if wr.deadline is None else self._t0 + (rec.send_time or 0.0) + wr.deadline
        req = Request(h.rid, h.tokens, self._sampling(wr.output_tokens - 1), arrival_time=t, priority=wr.priority,
                      tenant=wr.tenant, deadline=deadline)
        try:
            rep.core.add_request(req)
        except AdmissionError as e:
            self.transfers.refused += 1
            self._release(rep, h)
            rec.status, rec.error, rec.retry_after = HTTP_STATUS[e.kind], f"{e.kind.value}: {e.message}", e.retry_after
            rec.output_tokens = len(rec.token_times)  # (the first token was out)
            del self._in_transit[h.rid]
            self._outstanding[rep.index] -= 1
            self._client.on_done(t - self._t0)
            self._start_transfers(rep, t)
            return
        self._prefill_queue[h.rid] = h.prefill_queue_time
        rep.stats.requests += 1
        del self._in_transit[h.rid]
        self._live[h.rid] = (rec, rep)
        self._times[h.rid] = rec.token_times
        if not rep.in_heap:
            rep.in_heap = True
            heapq.heappush(self._heap, (max(t, rep.last_end), rep.index))

    def _release(self, rep: SimReplica, h: _Handoff) -> None:
        """Drop `h`'s reservation (its request holds the blocks now, or has ended)."""
        del self._held[rep.index][h.rid]
        self._held_tail[rep.index] -= h.tail
        assert h.placeholder is not None
        rep.core.kv.free(h.placeholder)
        h.placeholder = None

    # -- the loop ----------------------------------------------------------------------------------

    def _coast(self, rep: SimReplica) -> bool:
        # A decode replica with transfers waiting or held steps one step at a time: each step may
        # free the blocks a waiting transfer needs, or admit a held one.
        i = rep.index
        if i >= self._np and (self._pending[i] or self._held[i]):
            return False
        return super()._coast(rep)

    def _step(self, rep: SimReplica) -> None:
        super()._step(rep)
        i = rep.index
        if i < self._np:
            return
        held = self._held[i]
        if held:
            tables = rep.core.kv.block_tables
            for rid in [rid for rid in held if rid in tables]:
                self._release(rep, held[rid])
        if self._pending[i]:
            self._start_transfers(rep, rep.clock.now())

    def _loop(self, client: Any, t0: float) -> None:
        """The colocated loop with the hand-offs' events: in virtual-time order, an event before a
        step that starts at its time, and before an arrival at the same time."""
        heap, replicas, ff, events = self._heap, self.replicas, self._fast_forward, self._events
        inf = math.inf
        while True:
            a = client.next_time()
            ta = t0 + a
            te = events[0][0] if events else inf
            if heap and heap[0][0] < ta and heap[0][0] < te:
                _, i = heapq.heappop(heap)
                rep = replicas[i]
                if rep.stretch is not None:
                    self._arrive(rep)
                elif not (ff and self._coast(rep)):
                    self._step(rep)
            elif te < inf and te <= ta:
                _, _, kind, h = heapq.heappop(events)
                if kind == _HANDOFF:
                    self._handoff(h, te)
                else:
                    self._landed(h, te)
            elif a < inf:
                for i in client.pop_due(a):
                    self._send(i, ta)
            else:
                break

    def _fail_stalled(self) -> None:
        """Hand-offs still waiting for decode admission when nothing can run any more never finish."""
        for h in self._in_transit.values():
            h.rec.status, h.rec.error = 503, "stalled: no decode replica could take its KV"
            h.rec.output_tokens = len(h.rec.token_times)
        self._in_transit.clear()
        super()._fail_stalled()

    def run(self, workload: Workload) -> SimResult:
        self._prefill_queue: dict[str, float | None] = {}
        self._in_transit: dict[str, _Handoff] = {}  # prefill done, not yet queued on its decode replica
        res = super().run(workload)
        for rep in self.decode_pool:  # the reservations' lookups were not requests'
            rep.stats.prefix_cache_queries -= self._reserve_queries[rep.index]
            rep.stats.prefix_cache_hits -= self._reserve_hits[rep.index]
        res.pools = [self.pool_of(r.index) for r in self.replicas]
        res.transfers = self.transfers.summary(self.pd)
        return res
