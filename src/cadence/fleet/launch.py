"""`cadence serve --replicas N`: start (or join) Ray, deploy the replicas on Ray Serve, and serve
the HTTP ingress in this process; stop on a signal.

The replica pools are Serve applications without HTTP (Serve's proxy is not started); this
process holds Serve handles to them, so the fleet's request router runs here, and serves the
FastAPI app of `cadence serve` over a `FleetClient` on uvicorn, with a single server's head limits,
draining and second-signal stop (server/app.py `DrainingServer`).

Ray starts in this process unless `--ray-address` names a running cluster (`ray start --head` on
one machine, `ray start --address HEAD:6379` on the others). SIGTERM drains as a single server
does: new requests get 503 while those in flight get the shutdown timeout to finish; then Serve
and Ray stop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from cadence.config import EngineConfig, ServerConfig

log = logging.getLogger("cadence.fleet")

APP_NAME = "cadence"
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # replicas exchange small messages: keep Ray's store small

# The environment a local Ray starts with (its processes inherit it; a variable already set wins).
# Ray's and Serve's background work runs on the engines' cores, whatever the traffic: Ray's own
# metrics export (cadence's /metrics are the engines') is off, and Serve's controller reconciles
# twice a second rather than ten times (health checks, replacing a dead replica and deploys
# notice within half a second more).
LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


# Head processes of a local Ray that a fleet never uses, stopped once it is up (ray.init has no
# option to leave them out): the dashboard's API server (ray.init's include_dashboard=False still
# starts it, to report usage stats, which are off), and the log monitor (it forwards workers'
# output to drivers that ask for it; this one does not, log_to_driver=False). Each costs a
# process (about 100 MiB) and CPU on the engines' cores. Serve's Python API (serve.run,
# handles) needs neither; `serve status`/`serve deploy` talk to a dashboard, a cluster's own.
UNUSED_HEAD_PROCESSES = ("dashboard", "log_monitor")


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: a local Ray in this process
    num_cpus: int | None = None  # a local Ray's CPUs (None: Ray's count)
    object_store_bytes: int | None = None  # a local Ray's object store (None: OBJECT_STORE_BYTES)


# An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS)
# answers with a SETTINGS frame of its own (RFC 9113, 3.4).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
HTTP2_SETTINGS_TYPE = 4


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A clear error at once when nothing answers at a cluster's address, or something that is not
    Ray's GCS does (Ray itself retries for minutes, deaf to signals, each try 40 s there)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--ray-address: expected HOST:PORT (e.g. the head's 10.0.0.1:6379), got {address!r}")
    try:
        conn = socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout)
    except OSError as e:
        raise ValueError(f"--ray-address: nothing answers at {address} ({e.strerror or e}); start the cluster "
                         f"with `ray start --head` there, or leave the flag out for a local Ray") from None
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return  # (a TLS cluster's GCS does not answer a plain preface)
        answer = _first_bytes(conn, HTTP2_PREFACE, 9)
    if len(answer) < 9 or answer[3] != HTTP2_SETTINGS_TYPE:
        heard = "nothing" if not answer else repr(answer[:24])
        raise ValueError(f"--ray-address: {address} answers, but not as a Ray cluster ({heard} within "
                         f"{timeout:g} s to gRPC's greeting); give the head's GCS port (`ray start --head` "
                         f"prints it, 6379 by default)")


def resolve_auto_address() -> str:
    """`--ray-address auto`: the cluster Ray finds on this machine (`RAY_ADDRESS`, else the latest
    `ray start --head` here), or a clear error in cadence's words (Ray's names its own `--address`)."""
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address_or_die("auto")
    except ConnectionError:
        raise ValueError("--ray-address auto: no running Ray cluster found on this machine (RAY_ADDRESS is unset "
                         "and no `ray start --head` runs here); start one with `ray start --head`, give the "
                         "head's HOST:PORT, or leave the flag out for a local Ray") from None


def _first_bytes(conn: socket.socket, greeting: bytes, count: int) -> bytes:
    """Up to `count` bytes the peer sends after `greeting` (fewer when it closes or stays silent
    for the socket's timeout)."""
    got = b""
    try:
        conn.sendall(greeting)
        while len(got) < count:
            chunk = conn.recv(count - len(got))
            if not chunk:
                break
            got += chunk
    except OSError:  # (a timeout, a reset)
        pass
    return got


def check_port_free(host: str, port: int) -> None:
    """A clear error before Ray starts when the endpoint's port is taken (uvicorn would find out
    only once the replicas are up, after Ray's start and the models' loading)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds it)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"--port: cannot serve on {host}:{port} ({e.strerror or e})") from None


def start_ray(opts: RayOptions) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if not opts.address:
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)
    if opts.address:
        address = resolve_auto_address() if opts.address == "auto" else opts.address
        check_reachable(address)
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        # "local": a Ray of its own, always. Without an address Ray would join whatever it finds
        # (RAY_ADDRESS, a `ray start` cluster, another fleet's Ray on this machine), and refuse
        # num_cpus there; joining is what --ray-address is for.
        ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=False,
                 object_store_memory=opts.object_store_bytes or OBJECT_STORE_BYTES, log_to_driver=False)
        stop_unused_head_processes()


def stop_unused_head_processes() -> None:
    """Stop the `UNUSED_HEAD_PROCESSES` of the Ray this process started (through Ray's node,
    which then no longer counts them among its processes: its shutdown stops the rest)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    for name in UNUSED_HEAD_PROCESSES:
        stop = getattr(node, f"kill_{name}", None)
        if stop is None:  # (another Ray version: the process stays, which costs only its CPU)
            log.info("Ray's %s process stays (this Ray cannot stop it)", name)
            continue
        try:
            stop(check_alive=False)
        except Exception as e:
            log.warning("Ray's %s process could not be stopped (%s)", name, e)


def pool_app(deployment: str) -> str:
    """The Serve application a replica pool is deployed as (by its deployment's name)."""
    from cadence.fleet.deploy import PREFILL_NAME

    return APP_NAME + "-prefill" if deployment == PREFILL_NAME else APP_NAME


def deploy_pools(engine_config: EngineConfig, server_config: ServerConfig, fleet: Any) -> Any:
    """Deploy the replica pools, each an application without HTTP route, with Serve's HTTP proxy
    off; return the `Ingress` over handles obtained in this process."""
    from ray import serve

    from cadence.fleet.deploy import build_pools, max_held
    from cadence.fleet.ingress import build_ingress

    pools = build_pools(engine_config, server_config, fleet)
    serve.start(proxy_location="Disabled")
    for name, root in pools.roots().items():
        serve.run(root, name=pool_app(name), route_prefix=None)
    handles = {name: serve.get_deployment_handle(name, app_name=pool_app(name)) for name in pools.roots()}
    replicas, *prefill = handles.values()
    info = replicas.info.remote().result(timeout_s=120)
    return build_ingress(replicas, info, engine_config, server_config, prefill=prefill[0] if prefill else None,
                         kv_transfer_timeout_s=pools.kv_transfer_timeout_s, behind_proxy=False,
                         max_held=max_held(fleet, engine_config))


def _ingress_server(ingress: Any, server_config: ServerConfig) -> Any:
    from cadence.server.app import DrainingServer, uvicorn_config

    return DrainingServer(uvicorn_config(ingress.app, server_config), ingress.client, ingress.app.state.serving,
                          server_config.shutdown_timeout)


@dataclass
class _Running:
    server: Any  # DrainingServer
    thread: threading.Thread
    ingress: Any


_RUNNING: list[_Running] = []  # the ingress start_fleet serves in a thread, until stop_fleet


def start_fleet(engine_config: EngineConfig, server_config: ServerConfig, fleet: Any, ray_opts: RayOptions,
                timeout: float = 60.0) -> Any:
    """Start Ray (or join it), deploy the fleet and serve its ingress on the server's host:port from
    a thread of this process until `stop_fleet()`. Returns the `Ingress`."""
    start_ray(ray_opts)
    ingress = deploy_pools(engine_config, server_config, fleet)
    server = _ingress_server(ingress, server_config)
    thread = threading.Thread(target=server.run, name="cadence-fleet-ingress", daemon=True)
    thread.start()
    _RUNNING.append(_Running(server, thread, ingress))
    deadline = time.monotonic() + timeout
    while not server.started and thread.is_alive():  # (uvicorn only sets a flag once it listens)
        if time.monotonic() > deadline:
            raise TimeoutError("the fleet's ingress did not start listening")
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"the fleet's ingress could not serve on {server_config.host}:{server_config.port}")
    return ingress


def _close_ingress(ingress: Any) -> None:
    ingress.client.shutdown()
    tracer = ingress.app.state.tracer
    if tracer is not None:
        tracer.shutdown()


def stop_fleet() -> None:
    """Stop the ingress `start_fleet` serves (if any), then Serve and Ray."""
    import ray
    from ray import serve

    while _RUNNING:
        running = _RUNNING.pop()
        running.server.should_exit = True
        running.thread.join(30)
        _close_ingress(running.ingress)
    if not ray.is_initialized():  # (serve.shutdown would start a Ray only to find nothing to stop)
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _stop_starting(signum: int, frame: Any) -> None:
    """SIGTERM before the port opens: unwind the start, which stops what has started of Serve and Ray."""
    log.info("SIGTERM while the fleet starts: stopping it")
    raise SystemExit(128 + signum)


def _stop_serving(server: Any, signum: int, frame: Any) -> None:
    """SIGTERM outside uvicorn's own handling: the ingress server stops once started (`run_fleet`)."""
    server.should_exit = True


def run_fleet(engine_config: EngineConfig, server_config: ServerConfig, fleet: Any, ray_opts: RayOptions) -> int:
    """Serve until SIGTERM (drained, as a single server drains) or SIGINT; return the exit code."""
    check_port_free(server_config.host, server_config.port)
    signal.signal(signal.SIGTERM, _stop_starting)
    try:
        start_ray(ray_opts)
        # (again: the driver's Ray installs its own, which aborts the process and leaves Ray's
        # processes behind; uvicorn's takes over once the port opens)
        signal.signal(signal.SIGTERM, _stop_starting)
        ingress = deploy_pools(engine_config, server_config, fleet)
        server = _ingress_server(ingress, server_config)
    except BaseException:
        stop_fleet()
        raise
    # Until uvicorn takes SIGTERM (it drains from then on), one stops the server as soon as it has
    # started: nothing is in flight yet. uvicorn gives this handler back when it returns, and a
    # further SIGTERM then only flags a stopped server, so it cannot cut Serve's and Ray's shutdown short.
    signal.signal(signal.SIGTERM, partial(_stop_serving, server))
    log.info("fleet of %d replica%s (%s routing) on http://%s:%d", fleet.num_replicas,
             "" if fleet.num_replicas == 1 else "s", fleet.router,
             server_config.host, server_config.port)
    try:
        server.run()  # (in the main thread: uvicorn takes SIGTERM and SIGINT, DrainingServer drains)
    finally:
        _close_ingress(ingress)
        stop_fleet()
    return 130 if server.interrupted else 0
