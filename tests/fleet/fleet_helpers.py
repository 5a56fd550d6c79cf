"""Helpers of the fleet tests: a local Ray cluster and a fleet of tiny engines, started and stopped
by the tests themselves.

One Ray cluster at a time (idle Ray is over a GiB): the module's fixture starts it with a few
CPUs, deploys the fleet (replicas with fractional CPUs, the tiny random model), and shuts Ray
down after the module.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cadence.config import EngineConfig, ServerConfig  # noqa: E402
from cadence.fleet.deploy import FleetOptions  # noqa: E402
from cadence.fleet.launch import RayOptions, start_fleet, stop_fleet  # noqa: E402

TINY_ENGINE = {"num_kv_blocks": 512, "max_model_len": 1024, "device": "cpu", "dtype": "float32",
               "num_threads": 1, "max_num_seqs": 4, "max_queue_len": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Fleet:
    url: str
    engine_config: EngineConfig
    server_config: ServerConfig
    options: FleetOptions

    def replica_handle(self) -> Any:
        from ray import serve

        from cadence.fleet.deploy import REPLICA_NAME
        from cadence.fleet.launch import pool_app

        return serve.get_deployment_handle(REPLICA_NAME, app_name=pool_app(REPLICA_NAME))

    def replica_ids(self, timeout: float = 30.0) -> list[str]:
        """The replicas as this process's fleet router sees them (it learns them on its first call)."""
        from cadence.fleet.state import replica_ids

        handle = self.replica_handle()
        handle.info.remote().result()
        end = time.monotonic() + timeout
        while len(replica_ids()) < self.options.replicas:
            if time.monotonic() > end:
                raise TimeoutError(f"the router knows {replica_ids()}")
            time.sleep(0.05)
        return replica_ids()

    def replica_call(self, method: str) -> dict[str, Any]:
        """`method` on every replica, by replica id."""
        from cadence.fleet.protocol import Target

        handle = self.replica_handle()
        return {rid: getattr(handle, method).remote(Target(rid)).result(timeout_s=30) for rid in self.replica_ids()}


@contextlib.contextmanager
def running_fleet(router: str = "prefix-affinity", fleet_options: dict[str, Any] | None = None,
                  engine_options: dict[str, Any] | None = None, **server_options: Any) -> Iterator[Fleet]:
    """Ray and a fleet of two tiny replicas (or as `fleet_options` say), stopped on exit."""
    engine_config = EngineConfig.from_options(**{**TINY_ENGINE, **(engine_options or {})})
    server_config = ServerConfig(host="127.0.0.1", port=free_port(), **server_options)
    options = FleetOptions(**{"replicas": 2, "router": router, "replica_cpus": 0.5, "ingress_cpus": 0.5,
                              "max_queued_requests": 2, "tiny": True, **(fleet_options or {})})
    try:
        start_fleet(engine_config, server_config, options, RayOptions(num_cpus=2))
        yield Fleet(f"http://127.0.0.1:{server_config.port}", engine_config, server_config, options)
    finally:
        stop_fleet()


def complete(client: httpx.Client, prompt: str, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (and no `replica` label unless asked)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"([^{\s]+)(?:\{(.*)\})? (\S+)$", line)
        assert m, line
        if m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if "replica" in found and "replica" not in labels:
            continue
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total
