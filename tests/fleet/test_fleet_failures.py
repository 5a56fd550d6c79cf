"""A replica dying mid-stream, and a dead engine failing its health check."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import ray
from fleet_helpers import TINY_ENGINE

from cadence.config import EngineConfig
from cadence.fleet.replica import CadenceReplica

pytestmark = pytest.mark.slow


def _replica_actor(replica_id: str):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if "CadenceReplica" in entry["name"] and entry["name"].endswith(replica_id):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise LookupError(replica_id)


def test_a_replica_killed_mid_stream_ends_its_streams_and_is_replaced(fleet) -> None:
    before = set(fleet.replica_ids())
    body = {"prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            victim = r.headers["x-cadence-replica"]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    ray.kill(_replica_actor(victim), no_restart=True)
        # The stream ended (no hang) with an error event, then [DONE].
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "unavailable" or "replica" in error["message"], error
        # New requests are served meanwhile (by the other replica), and Serve brings a new one up.
        end = time.monotonic() + 120
        while True:
            r = c.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 3})
            now = set(fleet.replica_ids())
            if r.status_code == 200 and len(now) == 2 and victim not in now:
                break
            assert time.monotonic() < end, (r.status_code, now)
            time.sleep(0.5)
    assert now != before
    with httpx.Client(base_url=fleet.url, timeout=60) as c:
        served_by = {c.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2}).headers["x-cadence-replica"]
                     for i in range(6)}
    assert victim not in served_by


def test_a_dead_engine_fails_the_health_check() -> None:
    replica = CadenceReplica(EngineConfig.from_options(**TINY_ENGINE), tiny=True)  # (outside Serve)
    replica.check_health()  # a running engine passes
    replica.engine.shutdown(timeout=10)  # its loop thread stops, as it does when the engine dies
    with pytest.raises(RuntimeError, match="engine loop is not running"):
        replica.check_health()
