"""The simulator: the real engine core, scheduler and KV cache manager on virtual time.

Only two parts differ from a served engine: the executor (`SimExecutor`: a scripted token per
sampled row and a modelled step cost) and the clock (`VirtualClock`, advanced by that cost). A
workload's requests enter when virtual time reaches their arrival; an idle replica jumps straight
to its next arrival. Several replicas sit behind a router and step in virtual-time order: the
replica whose next step starts earliest goes next, and an arrival is routed before any step that
starts after it.

Most steps of a long run are alike: the same requests each decoding one token. A replica whose
next steps are such a stretch plans them at once and applies them lazily (see "decode stretches"
below and sim/fast_forward.py), with results identical to stepping one at a time.

The loop decides only from arrival times and the clock readings after each step, so driving it
with a real executor and a wall clock (see `sim/replay.py`) and then replaying that run's step
times reproduces the same scheduling decisions. No torch here.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

from cadence import routing
from cadence.bench.report import RequestRecord
from cadence.clock import VirtualClock
from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.errors import HTTP_STATUS, AdmissionError, ErrorKind
from cadence.executor.cost_model import SimExecutor, SpecAcceptance, StepCostModel
from cadence.executor.step_scatter import ScatterDraws
from cadence.kv.hashing import block_hashers
from cadence.request import Request, SamplingParams
from cadence.routing import DIGEST_LIMIT, STATS_PERIOD_S, Router, check_router, fingerprints
from cadence.sched.adaptive import DraftModelCost
from cadence.sched.records import request_metrics
from cadence.sim.fast_forward import DecodeStretch, FastForward
from cadence.sim.synth import PromptSynth
from cadence.workload import Workload, WorkloadRequest

# HTTP status of a request that ended without success, by finish reason (evicted: refused from the queue).
_END_STATUS = {"deadline": 408, "evicted": 429}
OK_REASONS = ("stop", "length")
_INF = math.inf
# Longest decode stretch planned at once: its step times are a list, and a request arriving early
# wastes the rest of the plan.
MAX_STRETCH_STEPS = 512


def sim_max_model_len(given: int | None, cost_model: StepCostModel | None) -> int:
    """The simulated engines' context: the one given, else the profile's model's, else 8192."""
    return given or int((cost_model.metadata if cost_model else {}).get("max_model_len", 0)) or 8192


@dataclass(frozen=True)
class SimOptions:
    """How the fleet and the load are modelled (the engine options are an `EngineConfig`).

    `concurrency` with `closed_loop`: that many users, each sending its next request when the
    previous one ends. Without `closed_loop`: an open loop capped at that many requests in flight.

    `fast_forward`: run stretches of identical decode steps in one go (the same results; off, every
    step runs alone, which tests compare against). Off whatever it says when the engine speculates:
    its steps are not those stretches.

    `spec_acceptance`: how drafts are accepted when the engine speculates (`SpecAcceptance`; the
    draws are seeded by `seed`); required then.

    `step_scatter`: multiply each step's predicted time by a draw from the profile's measured
    step-time scatter (`StepCostModel.step_scatter`; the draws are seeded by `seed`, one stream per
    replica). Off, or a profile without one: every step costs the mean of its shape.

    `spec_draft_ratio`: with a draft model (`"method": "draft_model"`), what its decode pass costs
    beside a served decode step (`cadence serve` takes their weight bytes); required then. Each step is charged the draft model's time for the requests drafted
    for, and adaptive k weighs it, as `cadence serve` prices it (`DraftModelCost`).

    `contended_overhead`: (per step, per running request) seconds: the serving overhead a
    replica's step pays, in place of the profile's, while every other replica is busy: replicas
    sharing one machine's cores slow each other down only while both compute. With a share of the
    others busy, that share of the difference is added; a per-request term of None keeps the
    profile's. Fleets with it step one step at a time.
    """

    replicas: int = 1
    router: str = "round-robin"
    max_model_len: int | None = None  # None: the profile's (the model's context, capped like serve)
    seed: int = 0
    concurrency: int | None = None
    closed_loop: bool = False
    fast_forward: bool = True
    spec_acceptance: SpecAcceptance | None = None
    step_scatter: bool = True
    spec_draft_ratio: float | None = None
    contended_overhead: tuple[float, float | None] | None = None

    def validate(self) -> SimOptions:
        if self.replicas < 1:
            raise ValueError("replicas: must be >= 1")
        check_router(self.router)
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency: must be >= 1")
        if self.closed_loop and not self.concurrency:
            raise ValueError("concurrency: a closed loop needs a number of users")
        r = self.spec_draft_ratio
        if r is not None and not (math.isfinite(r) and r > 0):
            raise ValueError(f"spec_draft_ratio (--spec-draft-ratio): must be > 0 (a draft model's decode pass over "
                             f"a served decode step), got {r}")
        co = self.contended_overhead
        if co is not None and not (len(co) == 2 and all(v is None or (math.isfinite(v) and v >= 0) for v in co)
                                   and co[0] is not None):
            raise ValueError(f"contended_overhead (--contended-overhead): (seconds a step, seconds a running request "
                             f"or None for the profile's), each >= 0, got {co}")
        return self


@dataclass
class ReplicaStats:
    index: int
    requests: int = 0
    steps: int = 0
    busy_s: float = 0.0  # virtual seconds spent in steps (summed per run of back-to-back steps)
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_drafts: int = 0  # verification rows (speculative decoding)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class SimResult:
    records: list[RequestRecord]
    replicas: list[ReplicaStats]
    wall_s: float  # real seconds the simulation took
    virtual_s: float  # simulated seconds from the first arrival to the last step
    steps: int = 0
    t0: float = 0.0  # clock reading at the start: record times are relative to it
    notes: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)  # a P/D fleet's: each replica's pool (sim/disagg.py)
    transfers: dict[str, Any] = field(default_factory=dict)  # a P/D fleet's KV transfers (sim/disagg.py)
    routing: dict[str, int] = field(default_factory=dict)  # a fleet's routing choices by outcome (Router.decisions)


class SimReplica:
    __slots__ = ("index", "core", "clock", "executor", "ff", "stats", "in_heap", "last_end", "busy_from", "stretch",
                 "finish_points", "entry", "digest", "digest_time")

    def __init__(self, index: int, core: EngineCore, clock: Any, executor: Any) -> None:
        self.index, self.core, self.clock, self.executor = index, core, clock, executor
        self.ff = FastForward.of(core)  # None where the executor costs no decode runs
        self.last_end = -_INF  # clock reading after its last step
        # Where its current run of back-to-back steps started (None before the first step): busy
        # time is added per run, one subtraction however many steps it holds.
        self.busy_from: float | None = None
        self.stats = ReplicaStats(index)
        self.in_heap = False
        # Decode steps planned and not yet applied (see Simulator._coast); its heap entry is the
        # start of the next of them that finishes requests, else the end of the last of them.
        self.stretch: DecodeStretch | None = None
        # Its stretch's steps that finish requests and have not come up yet, each with the rows it
        # finishes (the next one last, to pop).
        self.finish_points: list[tuple[int, list[int]]] = []
        self.entry = 0.0  # where its heap entry is, while coasting
        # Its published prefix digest (routing.ReplicaStats.digest) and when it was taken.
        self.digest: frozenset[int] = frozenset()
        self.digest_time = -_INF


class _Client:
    """The load generator's side: when each request is sent (open loop, capped, or closed loop)."""

    def __init__(self, reqs: tuple[WorkloadRequest, ...], opts: SimOptions,
                 delays: Sequence[float] | None = None) -> None:
        self._reqs = reqs
        self._cap = opts.concurrency if not opts.closed_loop else None
        self._closed = opts.closed_loop
        # Request i reaches its engine delays[i] after it is sent (the request path for its prompt).
        self.delays: Sequence[float] = delays if delays is not None else [0.0] * len(reqs)
        self._heap: list[tuple[float, int]] = []  # (time it reaches the engine, index)
        self._held: deque[int] = deque()  # arrived while the open-loop cap was reached
        self.in_flight = 0
        d = self.delays
        if self._closed:
            self._next = min(opts.concurrency or 1, len(reqs))
            self._heap = [(d[i], i) for i in range(self._next)]
        else:
            self._next = len(reqs)
            self._heap = [((r.arrival_time or 0.0) + d[i], i) for i, r in enumerate(reqs)]
            heapq.heapify(self._heap)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else _INF

    def pop_due(self, now: float) -> list[int]:
        """Indices that reach the engine at `now` (sent `delay` earlier)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, i = heapq.heappop(self._heap)
            if self._cap is not None and self.in_flight >= self._cap:
                self._held.append(i)
                continue
            self.in_flight += 1
            out.append(i)
        return out

    def on_done(self, now: float) -> None:
        """A request ended (or was refused) at `now`: free its slot for the next one."""
        self.in_flight -= 1
        if self._closed and self._next < len(self._reqs):
            heapq.heappush(self._heap, (now + self.delays[self._next], self._next))
            self._next += 1
        elif self._held:
            i = self._held.popleft()
            heapq.heappush(self._heap, (now + self.delays[i], i))


ExecutorFactory = Callable[[Any], Any]  # clock -> Executor


def check_kv_cache_dtype(config: EngineConfig, cost_model: StepCostModel) -> None:
    """A profile prices K/V bytes and attention as calibrated: --kv-cache-dtype int8 needs a profile
    calibrated with it (its kv_bytes_per_token is the 8-bit cache's), not one of the model's dtype."""
    wanted = config.cache.kv_cache_dtype
    calibrated = str(cost_model.metadata.get("kv_cache_dtype", "auto"))
    if wanted == "int8" and calibrated != "int8":
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype): int8, but the profile was calibrated with a "
                         f"{calibrated} KV cache; calibrate one with --kv-cache-dtype int8")


def _draft_model_cost(config: EngineConfig, options: SimOptions, *, custom_executor: bool) -> DraftModelCost | None:
    """How a draft model's time is priced (`SimOptions.spec_draft_ratio`), or None without one."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        if options.spec_draft_ratio is not None:
            raise ValueError("spec_draft_ratio (--spec-draft-ratio): only with a draft model "
                             "(--speculative-config with \"method\": \"draft_model\")")
        return None
    if options.spec_draft_ratio is None:
        if custom_executor:
            return None
        raise ValueError("spec_draft_ratio (--spec-draft-ratio): required with a draft model: its decode pass over "
                         "a served decode step (0.69 for `make_draft`'s default draft of the default model, by weight "
                         "bytes), which prices its time")
    return DraftModelCost(options.spec_draft_ratio, spec.num_speculative_tokens)


class Simulator:
    """Runs a workload through N engine cores. One `run` per instance."""

    def __init__(self, config: EngineConfig, cost_model: StepCostModel | None, options: SimOptions = SimOptions(), *,
                 executor_factory: ExecutorFactory | None = None, clock_factory: Callable[[], Any] = VirtualClock,
                 on_step: Callable[[int, EngineCore, float], None] | None = None) -> None:
        self.config = config.validate()
        self.options = options.validate()
        speculates = config.speculative_config is not None
        if speculates and options.spec_acceptance is None and executor_factory is None:
            raise ValueError("spec_acceptance_rate (--spec-acceptance-rate): required with speculative_config (the simulator has no model "
                             "to verify drafts: give the rate it accepts them at)")
        if not speculates and options.spec_acceptance is not None:
            raise ValueError("spec_acceptance_rate (--spec-acceptance-rate): only with speculative_config "
                             "(--speculative-config); without it the engine drafts nothing")
        drafting = _draft_model_cost(config, options, custom_executor=executor_factory is not None)
        if executor_factory is None:
            if cost_model is None:
                raise ValueError("cost_model: required unless an executor factory is given")
            check_kv_cache_dtype(config, cost_model)
            indices = iter(range(options.replicas))  # each replica's executor: its own seed and draws
            scatter = cost_model.step_scatter if options.step_scatter else None

            def sim_executor(clock: Any) -> SimExecutor:
                i = next(indices)
                return SimExecutor(cost_model, clock=clock, spec_acceptance=options.spec_acceptance,
                                   seed=options.seed + i, draft_cost=drafting,
                                   scatter=None if scatter is None else ScatterDraws(scatter, f"{options.seed}/{i}"))

            executor_factory = sim_executor
        max_len = sim_max_model_len(options.max_model_len, cost_model)
        self.max_model_len = max_len
        self._cost_model = cost_model  # its request path delays each request (`_request_delays`)
        # The fleet's router, fed what a real fleet's would see (see `_route`).
        self.router = Router(options.router)
        self._hash_chain = block_hashers(config.cache.prefix_caching_hash_algo)[1]
        self._block_size = config.cache.block_size
        self.on_step = on_step
        self.replicas: list[SimReplica] = []
        for i in range(options.replicas):
            clock = clock_factory()
            ex = executor_factory(clock)
            core = EngineCore(config, ex, clock=clock, max_model_len=max_len, eos_token_ids=frozenset(),
                              snapshot_gauges=False, decode_ids=True)
            if cost_model is not None:  # adaptive speculation prices drafts with the same model
                core.scheduler.step_cost = cost_model.predict
                core.scheduler.step_cost_prices_shared = cost_model.prices_shared_context
            if drafting is not None and core.scheduler.speculation is not None:
                core.scheduler.speculation.draft_cost_ratio = drafting.ratio  # adaptive k weighs drafting
            self.replicas.append(SimReplica(i, core, clock, ex))
        self._params: dict[int, SamplingParams] = {}
        self._live: dict[str, tuple[RequestRecord, SimReplica]] = {}
        self._times: dict[str, MutableSequence[float]] = {}  # each live request's token times (its record's array)
        # Tokens beyond one per step (speculative decoding): each step's tokens get one time, as the
        # chunk a server streams them in does.
        self._extra_tokens: dict[str, int] = {}
        self._steps = 0
        # A step hook must see every step, so it turns the fast-forward off.
        # Speculating steps are not stretches of plain decodes (drafts come and go): stepped one by one.
        # Contention between co-located replicas depends on the others' state at each step's start:
        # stepped one by one, each step priced then.
        self._contention = _contention(options, cost_model)
        self._fast_forward = options.fast_forward and on_step is None and not speculates and self._contention is None
        self.fast_forwarded_steps = 0  # steps applied as parts of stretches
        self.stretches_cut = 0  # stretches cut short by an arrival
        self.finished_mid_stretch = 0  # requests that finished in a stretch that went on without them
        self.joined_stretches = 0  # requests whose last prompt chunk and first token came in a stretch

    # -- requests in -------------------------------------------------------------------------------

    def _sampling(self, n: int) -> SamplingParams:
        sp = self._params.get(n)
        if sp is None:  # one frozen params object per output length: validation is not free
            sp = self._params[n] = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        return sp

    def _first_leg_tokens(self, wr: WorkloadRequest) -> int:
        """Output tokens the replica a request is routed to produces (a P/D fleet's prefill: one)."""
        return wr.output_tokens

    def _refuse_too_long(self, rec: RequestRecord, wr: WorkloadRequest, t: float) -> bool:
        """Answer a request no replica could ever hold with the engine's 400, before its prompt is
        made: a trace line of a billion tokens would otherwise be built in memory to be refused."""
        core = self.replicas[0].core
        max_tokens = self._first_leg_tokens(wr)
        total = wr.prompt_tokens + max_tokens
        if total <= core.max_request_tokens:
            return False
        # The engine's own wording (admission checks the context first, then the KV cache).
        limit = (f"max_model_len ({core.max_model_len})" if total > core.max_model_len
                 else f"the KV cache capacity ({core.max_request_tokens} tokens)")
        rec.status = HTTP_STATUS[ErrorKind.INVALID_REQUEST]
        rec.error = (f"{ErrorKind.INVALID_REQUEST.value}: prompt ({wr.prompt_tokens} tokens) + max_tokens "
                     f"({max_tokens}) = {total} exceeds {limit}")
        self._client.on_done(t - self._t0)
        return True

    def _send(self, i: int, t: float) -> None:
        """Request i reaches the fleet's engines at virtual time t: route it and queue it on its replica."""
        wr = self._workload.requests[i]
        rec = RequestRecord(index=i, tenant=wr.tenant, priority=wr.priority, deadline=wr.deadline,
                            prompt_tokens=wr.prompt_tokens, output_tokens_asked=wr.output_tokens,
                            scheduled_time=wr.arrival_time, send_time=t - self._t0 - self._client.delays[i],
                            output_count_source="usage",
                            token_times=array("d"))
        self._records.append(rec)
        if self._refuse_too_long(rec, wr, t):
            return
        prompt = self._synth.prompt(i, wr)
        rep = self.replicas[self._route(prompt, t)] if len(self.replicas) > 1 else self.replicas[0]
        if rep.stretch is not None:
            self._cut(rep, t)
        if not rep.in_heap:  # idle: its clock jumps to the arrival
            rep.clock.advance_to(t)
        req = Request(str(i), prompt, self._sampling(self._first_leg_tokens(wr)), arrival_time=t,
                      priority=wr.priority, tenant=wr.tenant,
                      deadline=None if wr.deadline is None else t + wr.deadline)
        try:
            rep.core.add_request(req)
        except AdmissionError as e:
            rec.status, rec.error, rec.retry_after = HTTP_STATUS[e.kind], f"{e.kind.value}: {e.message}", e.retry_after
            self._client.on_done(t - self._t0)
            return
        self._outstanding[rep.index] += 1
        rep.stats.requests += 1
        self._live[req.request_id] = (rec, rep)
        self._times[req.request_id] = rec.token_times
        if not rep.in_heap:
            # An idle replica may still be finishing its last step (its clock is ahead of t).
            rep.in_heap = True
            heapq.heappush(self._heap, (max(t, rep.last_end), rep.index))

    def _request_delays(self, workload: Workload) -> list[float]:
        """Each request's path to its engine: the profile's constant plus its cost per prompt token."""
        cm = self._cost_model
        if cm is None:
            return [0.0] * len(workload.requests)
        if not cm.request_delay_per_token:
            return [cm.request_delay] * len(workload.requests)
        return [cm.request_delay_for(r.prompt_tokens) for r in workload.requests]

    def _route(self, prompt: list[int], t: float) -> int:
        """The replica for a prompt sent at `t`, chosen by the fleet's router from the stats a real
        fleet's router has: each replica's requests (running, waiting), free blocks and, for
        prefix-affinity, the digest of its cache as last published (every STATS_PERIOD_S)."""
        router = self.router
        if not router.wants_prefixes:  # (each replica's running + waiting is its sent, unfinished requests)
            return router.route_by_load(self._outstanding)
        # (The simulator's requests carry no cache salt.)
        chain = fingerprints(self._hash_chain(prompt, self._block_size, None, ()))
        return router.route(chain, [self._replica_stats(rep, t) for rep in self.replicas])

    def _replica_stats(self, rep: SimReplica, t: float) -> routing.ReplicaStats:
        core = rep.core
        waiting = len(core.scheduler.waiting)
        if t - rep.digest_time >= STATS_PERIOD_S:
            if rep.stretch is not None:  # the cache as of `t`: the steps that started before it have run
                self._cut(rep, t)
            rep.digest = frozenset(fingerprints(core.kv.cached_hashes(DIGEST_LIMIT)))
            rep.digest_time = t
        # Sent and not finished, as the router counts them (a coasting replica's finished
        # requests are done for the router before its steps are applied).
        return routing.ReplicaStats(self._outstanding[rep.index] - waiting, waiting, core.kv.num_free_blocks, rep.digest)

    # -- the loop ----------------------------------------------------------------------------------

    @staticmethod
    def _busy(rep: SimReplica, start: float, end: float) -> None:
        """Steps ran on `rep` from `start` to `end`: a new run of busy time unless they follow its last step."""
        if start != rep.last_end:
            if rep.busy_from is not None:
                rep.stats.busy_s += rep.last_end - rep.busy_from
            rep.busy_from = start
        rep.last_end = end

    def _step(self, rep: SimReplica) -> None:
        ex = rep.executor
        ex.last_step_cost = 0.0
        t_before = rep.clock.now()
        if self._contention is not None:
            # The others computing now: stepping back to back while they have work (in the heap), or
            # in a last step that ends after this one starts (steps are applied at their start).
            busy = sum(1 for o in self.replicas if o is not rep and (o.in_heap or o.last_end > t_before))
            share = busy / (len(self.replicas) - 1)
            ex.extra_overhead = (share * self._contention[0], share * self._contention[1])
        deltas = rep.core.step()
        t = rep.clock.now()
        self._busy(rep, t_before, t)
        self._steps += 1
        st = rep.stats
        st.steps += 1
        ls = rep.core.last_stats
        st.preemptions += ls.num_preemptions
        st.prefix_cache_queries += ls.prefix_cache_queries
        st.prefix_cache_hits += ls.prefix_cache_hits
        if ls.num_drafts:
            st.spec_drafts += ls.num_drafts
            st.spec_draft_tokens += ls.num_draft_tokens
            st.spec_accepted_tokens += ls.num_accepted_tokens
        rel = t - self._t0
        # The engine streams one chunk per request per step: one time each, and the token count is
        # the number of times (set when the request ends), plus the extra tokens of verification rows. Plain decodes that went on come as
        # ids (most tokens of a run), the rest as deltas.
        times = self._times
        decoded = rep.core.last_decoded
        for rid in decoded:
            times[rid].append(rel)
        live = self._live
        for d in deltas:
            rec = live[d.request_id][0]
            if d.new_token_ids:
                if rec.first_token_time is None:
                    rec.first_token_time = rel
                rec.token_times.append(rel)
                if len(d.new_token_ids) > 1:  # a verification row's: one chunk, as a server streams them
                    self._extra_tokens[d.request_id] = self._extra_tokens.get(d.request_id, 0) + len(d.new_token_ids) - 1
            if d.finish_reason is not None:
                self._finish(d, rec, rep, rel)
        if self.on_step is not None:
            self.on_step(rep.index, rep.core, t)
        if rep.core.has_unfinished_requests() and (ex.last_step_cost or deltas or decoded):
            heapq.heappush(self._heap, (t, rep.index))
        else:
            # Idle, or stalled (nothing could be scheduled): it re-enters when a request arrives.
            rep.in_heap = False

    # -- decode stretches --------------------------------------------------------------------------
    #
    # A replica whose next steps would each schedule the same plain decodes (FastForward.plan)
    # coasts: its heap entry moves to where the stretch's effects outside the
    # replica happen, and the steps are applied when it comes up at its end, or, when a request
    # reaches it sooner, up to the first step that starts at or after that arrival. Nothing else
    # reaches into a replica, and its stretch steps reach nothing outside it but through the
    # requests they finish; so each step that finishes requests keeps its place in the order (an
    # entry at its start, where their records end and the router and the client learn of it,
    # while the steps themselves wait), and a stretch ends where the next step starts (or, if its
    # last step finishes requests, at that step's start, as a single step would). Applying steps
    # late then changes no result: the records, the routing, the closed loop's sends and every
    # replica's stats are those of stepping one at a time.

    def _coast(self, rep: SimReplica) -> bool:
        """Plan a stretch of decode steps on `rep` (its turn has come); False if none."""
        ff = rep.ff
        stretch = ff.plan(MAX_STRETCH_STEPS) if ff is not None else None
        if stretch is None:
            return False
        rep.stretch = stretch
        rep.finish_points = list(reversed(stretch.finish_groups().items()))  # the next one last
        self._push_entry(rep)
        return True

    def _push_entry(self, rep: SimReplica) -> None:
        """Queue coasting `rep` where its stretch next has an effect: the start of the next step that
        finishes requests, else the stretch's end."""
        stretch, ff = rep.stretch, rep.ff
        assert stretch is not None and ff is not None
        if rep.finish_points:
            step = rep.finish_points[-1][0]
            ff.cost(stretch, step)
            rep.entry = stretch.step_ends[step - 1] if step else stretch.start_time
        else:
            ff.cost(stretch, stretch.num_steps)
            rep.entry = stretch.step_ends[-1]
        heapq.heappush(self._heap, (rep.entry, rep.index))

    def _arrive(self, rep: SimReplica) -> None:
        """Coasting `rep` came up: the requests its next finishing step ends are done (the steps wait,
        but for the last one's: the stretch is applied); or, at its end, apply it and step on as
        `_step` would."""
        stretch = rep.stretch
        assert stretch is not None
        if not rep.finish_points:  # its end: the next step starts now
            self._land(rep, stretch.num_steps)
            if not self._coast(rep):
                self._step(rep)
            return
        step, rows = rep.finish_points.pop()
        self._finish_rows(rep, stretch, step, rows)
        if step < stretch.num_steps - 1:
            self.finished_mid_stretch += len(rows)
            self._push_entry(rep)
            return
        self._land(rep, stretch.num_steps)
        if rep.core.has_unfinished_requests():
            heapq.heappush(self._heap, (rep.last_end, rep.index))
        else:
            rep.in_heap = False

    def _finish_rows(self, rep: SimReplica, stretch: DecodeStretch, step: int, rows: list[int]) -> None:
        """The records of the requests (`rows` of the stretch) that its step `step` finishes (by
        length, the steps not applied yet): their token times to that step's end, then their end."""
        assert rep.ff is not None  # (a stretch was planned by it)
        rep.ff.cost(stretch, step + 1)
        rels = self._rels(stretch.step_ends[: step + 1])
        rel = rels[-1]
        times, live, join = self._times, self._live, stretch.join
        joined = len(stretch.requests) - 1 if join >= 0 else -1
        for i in rows:
            req = stretch.requests[i]
            rid = req.request_id
            rec = live[rid][0]
            if i == joined:  # its tokens from its join step on
                self.joined_stretches += 1
                rec.first_token_time = rels[join]
                times[rid].extend(rels[join:])
            else:
                times[rid].extend(rels)
            self._end(rid, rec, rep, rel, "length", request_metrics(req).queue_time, None)

    def _rels(self, ends: list[float]) -> array:
        """Clock readings as record times (relative to the start of the run)."""
        t0 = self._t0
        # (A virtual clock starts at 0, and t - 0.0 is t: no subtraction to make.)
        return array("d", ends) if t0 == 0.0 else array("d", [t - t0 for t in ends])

    def _cut(self, rep: SimReplica, t: float) -> None:
        """A request reaches coasting `rep` at `t`: apply the stretch's steps that start before it
        (they ran first; the requests they finish are done already) and drop the rest; the
        replica's next step starts where they end."""
        stretch = rep.stretch
        assert stretch is not None
        ends = stretch.step_ends  # (costed at least to the step its heap entry is at, which t does not pass)
        last = len(ends) - 1
        # Step 0 starts at start_time and step j at ends[j - 1].
        m = 1 + bisect.bisect_left(ends, t, 0, last) if stretch.start_time < t else 0
        if m < stretch.num_steps:
            self.stretches_cut += 1
            heap = self._heap
            heap.remove((rep.entry, rep.index))
            heapq.heapify(heap)
            heapq.heappush(heap, (ends[m - 1] if m else stretch.start_time, rep.index))
        self._land(rep, m)

    def _land(self, rep: SimReplica, m: int) -> None:
        """Apply the first `m` steps of `rep`'s stretch and record them as `_step` would have (the
        requests they finish have been recorded as done, each at its step's start)."""
        stretch, ff = rep.stretch, rep.ff
        assert stretch is not None and ff is not None
        rep.stretch = None
        deltas = ff.apply(stretch, m)
        # (Finished requests were recorded at their finishing steps; a joined row's first token is below.)
        assert all(d.finish_reason is None or (d.request_id not in self._live and d.finish_reason.value == "length")
                   for d in deltas)
        if not m:
            return
        st = rep.stats
        st.steps += m
        self._steps += m
        self.fast_forwarded_steps += m
        ends = stretch.step_ends if m == len(stretch.step_ends) else stretch.step_ends[:m]
        self._busy(rep, stretch.start_time, ends[-1])
        rels = self._rels(ends)
        times = self._times
        rids = stretch.request_ids
        join = stretch.join
        if join >= 0:  # the last row joined in step `join` (if the steps reached it)
            rid = rids.pop()
            if m > join and rid in times:
                self.joined_stretches += 1
                self._live[rid][0].first_token_time = rels[join]
                times[rid].extend(rels[join:])
        for rid in rids:
            rec_times = times.get(rid)  # (none for those finished)
            if rec_times is not None:
                rec_times.extend(rels)

    def _finish(self, d: Any, rec: RequestRecord, rep: SimReplica, rel: float) -> None:
        m = d.metrics
        if d.retry_after is not None:
            rec.retry_after = d.retry_after
        self._end(d.request_id, rec, rep, rel, d.finish_reason.value, None if m is None else m.queue_time, d.error)

    def _end(self, rid: str, rec: RequestRecord, rep: SimReplica, rel: float, reason: str, queue_time: float | None,
             error: str | None) -> None:
        del self._live[rid], self._times[rid]
        rec.output_tokens = len(rec.token_times) + self._extra_tokens.pop(rid, 0)
        rec.finish_reason = reason
        rec.end_time = rel
        if queue_time is not None:
            rec.queue_time = queue_time
        if reason in OK_REASONS:
            rec.status = 200
        else:
            rec.status = _END_STATUS.get(reason, 500)
            rec.error = f"{reason}: {error}" if error else reason
        self._outstanding[rep.index] -= 1
        self._client.on_done(rel)

    def run(self, workload: Workload) -> SimResult:
        wall0 = time.perf_counter()
        self._workload = workload
        self._synth = PromptSynth(workload.prefix_block_tokens, self.options.seed)
        self._client = client = _Client(workload.requests, self.options, self._request_delays(workload))
        self._records: list[RequestRecord] = []
        self._outstanding = [0] * len(self.replicas)
        self._heap: list[tuple[float, int]] = []
        self._t0 = t0 = self.replicas[0].clock.now()
        # The loop makes millions of short-lived containers (steps' outputs, deltas, tuples) and no
        # reference cycles (a run with the collector off leaves nothing for gc.collect() to find):
        # reference counting frees everything, and the cyclic collector, rescanning the growing
        # records at each full collection, would only cost time (3% of a 20,000-request run with
        # a youngest generation of 100,000; 6% at the default 700).
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._loop(client, t0)
        finally:
            if was_enabled:
                gc.enable()
        self._fail_stalled()
        for rep in self.replicas:  # close each replica's last run of steps
            if rep.busy_from is not None:
                rep.stats.busy_s += rep.last_end - rep.busy_from
                rep.busy_from = None
        records = sorted(self._records, key=lambda r: r.index)
        end = max((r.clock.now() for r in self.replicas), default=t0)
        stats = [r.stats for r in self.replicas]
        return SimResult(records, stats, time.perf_counter() - wall0, end - t0, self._steps, t0,
                         notes=self._spec_notes(stats),
                         routing=self.router.decision_counts() if len(self.replicas) > 1 else {})

    def _spec_notes(self, stats: list[ReplicaStats]) -> list[str]:
        """A line on speculation, when the engine speculates (as /metrics would count it)."""
        if self.config.speculative_config is None:
            return []
        rows = sum(s.spec_drafts for s in stats)
        drafted = sum(s.spec_draft_tokens for s in stats)
        accepted = sum(s.spec_accepted_tokens for s in stats)
        if not rows:
            return ["speculative decoding: no drafts verified (k was 0 at every step)"]
        return [f"speculative decoding: {rows} verification rows, {drafted} draft tokens (mean k {drafted / rows:.2f}), "
                f"{accepted} accepted (acceptance {accepted / drafted:.1%})"]

    def _loop(self, client: _Client, t0: float) -> None:
        """Step replicas and send requests in virtual-time order until nothing is left to do."""
        heap, replicas, ff = self._heap, self.replicas, self._fast_forward
        while True:
            a = client.next_time()  # relative to t0, as the workload's arrival times are
            ta = t0 + a
            if heap and heap[0][0] < ta:
                _, i = heapq.heappop(heap)
                rep = replicas[i]
                if rep.stretch is not None:  # it coasted to here
                    self._arrive(rep)
                elif not (ff and self._coast(rep)):
                    self._step(rep)
            elif a < _INF:
                for i in client.pop_due(a):
                    self._send(i, ta)
            else:
                break

    def _fail_stalled(self) -> None:
        """Requests left when nothing can run any more never finish: report them as errors."""
        for rid, (rec, _rep) in list(self._live.items()):
            rec.status, rec.error = 503, "stalled: the engine could not schedule it"
            rec.output_tokens = len(rec.token_times) + self._extra_tokens.pop(rid, 0)
            del self._live[rid], self._times[rid]


def _contention(options: SimOptions, cost_model: StepCostModel | None) -> tuple[float, float] | None:
    """What a step pays beyond the profile's overhead with every other replica busy, per step and
    per running request (`SimOptions.contended_overhead`); None without it or a fleet."""
    co = options.contended_overhead
    if co is None or options.replicas < 2 or cost_model is None:
        return None
    own = cost_model.overhead
    per_seq = co[1] - own.get("per_seq", 0.0) if co[1] is not None else 0.0
    return co[0] - own.get("per_step", 0.0), per_seq


def simulate(workload: Workload, config: EngineConfig, cost_model: StepCostModel,
             options: SimOptions = SimOptions()) -> SimResult:
    """Convenience: one simulation of `workload` on `options.replicas` engines."""
    return Simulator(config, cost_model, options).run(workload)
