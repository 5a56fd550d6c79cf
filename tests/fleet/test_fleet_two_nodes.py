"""A fleet over a two-node Ray cluster (Ray's test cluster utility fakes the nodes on this machine)."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import ray
from fleet_helpers import TINY_ENGINE, Fleet, free_port
from ray.cluster_utils import Cluster

from cadence.config import EngineConfig, ServerConfig
from cadence.fleet.deploy import FleetOptions
from cadence.fleet.launch import RayOptions, start_fleet, stop_fleet

pytestmark = pytest.mark.slow


def test_replicas_on_both_nodes_serve_requests() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, include_dashboard=False)
        engine_config = EngineConfig.from_options(**TINY_ENGINE)
        server_config = ServerConfig(host="127.0.0.1", port=free_port())
        # One CPU per replica on one-CPU nodes: Ray must put them on different nodes.
        options = FleetOptions(replicas=2, router="least-loaded", replica_cpus=1.0, tiny=True)
        try:
            start_fleet(engine_config, server_config, options, RayOptions(address=cluster.address))
            fleet = Fleet(f"http://127.0.0.1:{server_config.port}", engine_config, server_config, options)
            served: Counter[str] = Counter()
            with httpx.Client(base_url=fleet.url, timeout=60) as c:
                for i in range(8):
                    r = c.post("/v1/completions", json={"prompt": f"node test {i}", "max_tokens": 3})
                    assert r.status_code == 200, r.text
                    served[r.headers["x-cadence-replica"]] += 1
            nodes = fleet.replica_call("node_id")
        finally:
            stop_fleet()
    finally:
        cluster.shutdown()
    assert set(served) == set(nodes) and len(set(nodes.values())) == 2, (served, nodes)
