"""The fleet's Ray Serve deployments: N replica deployments (one `AsyncEngine` each), placed by
`CadenceRequestRouter` (`build_pools`), and for Serve's own tools an application with an ingress
deployment owning HTTP behind Serve's proxy (the same FastAPI app as `cadence serve`, over a
`FleetClient`; `build_fleet`). `cadence serve --replicas N` deploys the pools alone and serves
the ingress in its own process (fleet/launch.py).

Queues are bounded at both levels: a replica takes at most its engine's `max_num_seqs` plus its
queue (`max_queue_len`) at once, so Serve never throttles below what continuous batching can use
and cadence's own admission decides within a replica; beyond that the ingress holds at most
`max_queued_requests` more (its `FleetClient` counts them: `max_held`) and answers the rest 429
with Retry-After.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cadence.config import EngineConfig, ServerConfig
from cadence.fleet.replica import CadenceReplica, ReplicaObservability
from cadence.routing import STATS_PERIOD_S, check_router

INGRESS_NAME = "CadenceIngress"
REPLICA_NAME = "CadenceReplica"
PREFILL_NAME = "CadencePrefill"  # the pools of a fleet with disaggregated prefill and decode
DECODE_NAME = "CadenceDecode"
CONTROL_CALLS = 64  # room in Serve's queue for the ingress's own calls (metrics, request status)
# Room beside a replica's seats in Serve's limit of calls running there at once, for the ingress's
# subscription and its short calls (aborts, metrics, a request's status): a subscription that
# waited behind a burst's requests would fail the requests it was to carry.
CONTROL_ONGOING = 8


@dataclass(frozen=True)
class FleetOptions:
    """`replicas`: engines; `router`: one of cadence.routing.ROUTERS; `replica_cpus`: the CPUs Ray
    reserves for each (fractions allowed); `max_queued_requests`: requests the ingress holds for
    the replicas beyond what they take (then 429); `health_check_period_s`: how often Serve asks
    each replica whether its engine loop runs."""

    replicas: int = 2
    router: str = "prefix-affinity"
    replica_cpus: float = 1.0
    ingress_cpus: float = 0.0  # (it tokenizes and forwards: it does not reserve a core from the replicas)
    max_queued_requests: int = 256
    health_check_period_s: float = 5.0
    tiny: bool = False
    # Disaggregated prefill and decode (both > 0): the two pools replace `replicas`.
    prefill_replicas: int = 0
    decode_replicas: int = 0
    kv_transfer_timeout_s: float = 30.0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0 or self.decode_replicas > 0

    @property
    def num_replicas(self) -> int:
        """Engines in all (both pools when disaggregated)."""
        return self.prefill_replicas + self.decode_replicas if self.disaggregated else self.replicas

    def validate(self) -> FleetOptions:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        check_router(self.router)
        if not self.replica_cpus > 0:
            raise ValueError("replica_cpus: must be > 0")
        if not self.ingress_cpus >= 0:
            raise ValueError("ingress_cpus: must be >= 0")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests: must be >= 1")
        if self.disaggregated and (self.prefill_replicas < 1 or self.decode_replicas < 1):
            raise ValueError(f"prefill_replicas and decode_replicas: both must be >= 1 (got {self.prefill_replicas} "
                             f"and {self.decode_replicas})")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError("kv_transfer_timeout_s: must be > 0")
        return self


@serve.ingress()
class CadenceIngress:
    """The ingress as a Serve deployment, behind Serve's HTTP proxy (the `serve run` application;
    `cadence serve --replicas` hosts the same app in its own process, fleet/launch.py)."""

    def __init__(self, replicas: Any, engine_config: EngineConfig, server_config: ServerConfig,
                 prefill: Any = None, kv_transfer_timeout_s: float = 30.0, max_held: int | None = None) -> None:
        """`replicas`: the replica deployment (the decode pool when `prefill`, the prefill pool, is
        given); `max_held`: the requests the ingress holds at once (`max_held`)."""
        self._replicas = replicas
        self._max_held = max_held
        self._prefill = prefill
        self._kv_transfer_timeout_s = kv_transfer_timeout_s
        self._engine_config = engine_config
        self._server_config = server_config

    async def __serve_build_asgi_app__(self) -> Any:
        from cadence.fleet.ingress import build_ingress

        info = await self._replicas.info.remote()
        ingress = build_ingress(self._replicas, info, self._engine_config, self._server_config,
                                prefill=self._prefill, kv_transfer_timeout_s=self._kv_transfer_timeout_s,
                                behind_proxy=True, max_held=self._max_held)
        return ingress.app


@dataclass(frozen=True)
class Pools:
    """The bound replica deployments: `replicas` (the decode pool when `prefill`, the prefill pool,
    is given), and the transfer timeout of a disaggregated fleet."""

    replicas: Any
    prefill: Any = None
    kv_transfer_timeout_s: float = 30.0

    def roots(self) -> dict[str, Any]:
        """Each pool by its deployment's name (deployed as an application of its own when the
        ingress runs outside Serve)."""
        if self.prefill is None:
            return {REPLICA_NAME: self.replicas}
        return {DECODE_NAME: self.replicas, PREFILL_NAME: self.prefill}


def build_pools(engine_config: EngineConfig, server_config: ServerConfig, options: FleetOptions) -> Pools:
    """The replica deployments of the fleet, bound to their arguments."""
    options.validate()
    engine_config.validate()
    server_config.validate()
    replica_args = (engine_config, options.tiny, server_config.metrics_compat, ReplicaObservability.of(server_config))
    if options.disaggregated:
        from cadence.fleet.pd import PDReplica

        # The prefill pool routes by prefix (where the prompt's blocks are cached), the decode pool
        # by load; a decode replica also answers each request's KV reservation (one more call).
        prefill = _replica_deployment(PDReplica, PREFILL_NAME, options.prefill_replicas, options.router,
                                      options, engine_config, server_config)
        decode = _replica_deployment(PDReplica, DECODE_NAME, options.decode_replicas, "least-loaded",
                                     options, engine_config, server_config)
        return Pools(decode.bind(*replica_args), prefill.bind(*replica_args), options.kv_transfer_timeout_s)
    replica = _replica_deployment(CadenceReplica, REPLICA_NAME, options.replicas, options.router, options,
                                  engine_config, server_config)
    return Pools(replica.bind(*replica_args))


def build_fleet(engine_config: EngineConfig, server_config: ServerConfig, options: FleetOptions) -> Any:
    """The bound Serve application with its ingress deployment behind Serve's HTTP proxy (what
    `serve.run` takes; `serve run cadence.fleet:app`)."""
    pools = build_pools(engine_config, server_config, options)
    sched = engine_config.scheduler
    ingress_args: dict[str, Any] = {"max_held": max_held(options, engine_config)}
    if pools.prefill is not None:
        ingress_args.update(prefill=pools.prefill, kv_transfer_timeout_s=pools.kv_transfer_timeout_s)
    # The ingress only forwards: it takes what the replicas and their queue can hold, and twice
    # that again, so that a request over the replicas' bounds gets cadence's own 429 (JSON, with
    # Retry-After). Serve's proxy holds requests while it routes them to the ingress; beyond four
    # times that it answers 429 itself (plain text, with Retry-After).
    ingress_capacity = 2 * (options.max_queued_requests
                            + options.num_replicas * (sched.max_num_seqs + sched.max_queue_len))
    ingress = serve.deployment(
        CadenceIngress,
        name=INGRESS_NAME,
        num_replicas=1,
        ray_actor_options={"num_cpus": options.ingress_cpus},
        max_ongoing_requests=ingress_capacity,
        max_queued_requests=4 * ingress_capacity,
        backpressure_config={"status_code": 429, "retry_after_s": 1.0},
        graceful_shutdown_timeout_s=server_config.shutdown_timeout,
    )
    return ingress.bind(pools.replicas, engine_config, server_config, **ingress_args)


def max_held(options: FleetOptions, engine_config: EngineConfig) -> int:
    """The requests the ingress holds at once: every replica's seats (`max_num_seqs` running plus
    `max_queue_len` waiting) and `max_queued_requests` more; beyond it, 429."""
    sched = engine_config.scheduler
    return options.max_queued_requests + options.num_replicas * (sched.max_num_seqs + sched.max_queue_len)


def _replica_deployment(cls: type, name: str, num_replicas: int, router: str, options: FleetOptions,
                        engine_config: EngineConfig, server_config: ServerConfig) -> Any:
    sched = engine_config.scheduler
    return serve.deployment(
        cls,
        name=name,
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": options.replica_cpus},
        # (a decode replica's reservations and imports are calls too: room for one of each per seat)
        max_ongoing_requests=(sched.max_num_seqs + sched.max_queue_len) * (2 if options.disaggregated else 1)
        + CONTROL_ONGOING,
        # The ingress bounds what it holds itself (`max_held`): Serve's bound, which counts a
        # request as queued while it is being routed, only stops what gets past it (calls for
        # metrics and request status besides).
        max_queued_requests=max_held(options, engine_config) + CONTROL_CALLS,
        health_check_period_s=options.health_check_period_s,
        graceful_shutdown_timeout_s=server_config.shutdown_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class="cadence.fleet.router:CadenceRequestRouter",
            request_router_kwargs={"policy": router},
            request_routing_stats_period_s=STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0,
        ),
    )
