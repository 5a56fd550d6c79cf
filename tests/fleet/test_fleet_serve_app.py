"""`cadence.fleet:app`, the application for Serve's own tools (`serve run`, `serve deploy`): its
ingress deployment serves the fleet's routes behind Serve's HTTP proxy."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from fleet_helpers import complete, free_port, metric

from cadence.fleet import app
from cadence.fleet.launch import APP_NAME, RayOptions, start_ray, stop_fleet

pytestmark = pytest.mark.slow

ARGS = {"replicas": 1, "replica-threads": 1, "tiny": True, "num-kv-blocks": 512, "max-model-len": 1024,
        "device": "cpu", "dtype": "float32", "max-num-seqs": 4, "max-queue-len": 2}


def test_serve_run_of_the_application_serves_through_serves_proxy() -> None:
    from ray import serve

    port = free_port()
    try:
        start_ray(RayOptions(num_cpus=2))
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(ARGS), name=APP_NAME, route_prefix="/")  # what `serve run cadence.fleet:app` does
        actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        assert any("PROXY" in name.upper() for name in actors), actors
        assert any("CadenceIngress" in name for name in actors), actors
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            end = time.monotonic() + 60
            while c.get("/v1/models").status_code != 200:  # (the proxy answers 404 until it routes here)
                assert time.monotonic() < end, "the proxy did not route to the application"
                time.sleep(0.2)
            r = complete(c, "through the proxy", ignore_eos=True)
            assert r.status_code == 200, r.text
            assert r.headers["x-cadence-replica"]
            (rid,) = r.headers.get_list("x-request-id")  # the proxy's, the only one
            assert c.get(f"/v1/requests/{rid}").json()["output_tokens"] == 6
            mine = c.post("/v1/completions", json={"prompt": "mine", "max_tokens": 2},
                          headers={"X-Request-Id": "client-chosen-9"})
            assert mine.headers.get_list("x-request-id") == ["client-chosen-9"]
            assert metric(c.get("/metrics").text, "cadence:finished_requests_total") >= 2
    finally:
        stop_fleet()
