"""`cadence serve --replicas N`: start (or join) Ray, run the fleet on Ray Serve, stop on a signal.

Ray starts in this process unless `--ray-address` names a running cluster (`ray start --head` on
one machine, `ray start --address HEAD:6379` on the others). SIGTERM drains as a single server
does: the ingress refuses new requests (503) while those in flight get the shutdown timeout to
finish (Serve's graceful shutdown), then Ray stops.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

from cadence.config import EngineConfig, ServerConfig

log = logging.getLogger("cadence.fleet")

APP_NAME = "cadence"
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # replicas exchange small messages: keep Ray's store small


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: a local Ray in this process
    num_cpus: int | None = None  # a local Ray's CPUs (None: Ray's count)
    object_store_bytes: int | None = None  # a local Ray's object store (None: OBJECT_STORE_BYTES)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A clear error at once when nothing answers at a cluster's address (Ray itself retries for
    minutes, deaf to signals, and then starts a local instance)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--ray-address: expected HOST:PORT (e.g. the head's 10.0.0.1:6379), got {address!r}")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"--ray-address: nothing answers at {address} ({e.strerror or e}); start the cluster "
                         f"with `ray start --head` there, or leave the flag out for a local Ray") from None


def start_ray(opts: RayOptions) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if opts.address:
        if opts.address != "auto":
            check_reachable(opts.address)
        ray.init(address=opts.address, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(num_cpus=opts.num_cpus, include_dashboard=False, object_store_memory=opts.object_store_bytes or OBJECT_STORE_BYTES,
                 log_to_driver=False)


def start_fleet(engine_config: EngineConfig, server_config: ServerConfig, fleet: Any, ray_opts: RayOptions,
                after_ray: Any = None) -> None:
    """Start Ray (or join it) and run the fleet's application, serving HTTP on the server's host:port;
    `after_ray()` is called once Ray is up, before the application is deployed."""
    from ray import serve

    from cadence.fleet.deploy import build_fleet

    start_ray(ray_opts)
    if after_ray is not None:
        after_ray()
    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    serve.run(build_fleet(engine_config, server_config, fleet), name=APP_NAME, route_prefix="/")


def stop_fleet() -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():  # (serve.shutdown would start a Ray only to find nothing to stop)
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def drain_fleet(timeout: float) -> None:
    """Drain the ingress (see CadenceIngress.drain), waiting at most `timeout` seconds plus a margin."""
    from ray import serve

    from cadence.fleet.deploy import INGRESS_NAME

    try:
        ingress = serve.get_deployment_handle(INGRESS_NAME, app_name=APP_NAME)
        ended = ingress.drain.remote(timeout).result(timeout_s=timeout + 15)
    except Exception:  # the fleet is going away in any case
        log.exception("draining the fleet failed")
        return
    if ended:
        log.warning("shutdown timeout: ended %d requests with an error", ended)


def run_fleet(engine_config: EngineConfig, server_config: ServerConfig, fleet: Any, ray_opts: RayOptions) -> int:
    """Serve until SIGTERM (drained, as a single server drains) or SIGINT; return the exit code."""
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(sig: int, _frame: Any) -> None:
        if stop.is_set():  # a second signal: stop now, without waiting for the drain
            raise SystemExit(130 if sig == signal.SIGINT else 0)
        signals.append(sig)
        stop.set()

    def catch_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    try:  # signals keep their defaults until Ray is up (ray.init would replace these handlers anyway)
        start_fleet(engine_config, server_config, fleet, ray_opts, after_ray=catch_signals)
    except BaseException:
        stop_fleet()
        raise
    log.info("fleet of %d replicas (%s routing) on http://%s:%d", fleet.num_replicas, fleet.router,
             server_config.host, server_config.port)
    try:
        while not stop.wait(0.5):  # (a timed wait lets the signal handlers run)
            pass
        if signals[0] == signal.SIGTERM:
            log.info("SIGTERM: draining the fleet (up to %.1f s)", server_config.shutdown_timeout)
            drain_fleet(server_config.shutdown_timeout)
    finally:
        stop_fleet()
    return 0
