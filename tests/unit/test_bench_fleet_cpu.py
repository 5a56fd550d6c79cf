"""benchmarks/bench_fleet.py's CPU accounting: every process of a server's tree is found and
counted by role, the way Ray titles its workers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _load():
    return load_benchmark("bench_fleet")


def test_roles_follow_ray_process_titles():
    bf = _load()
    assert bf._role(["ray::ServeReplica:cadence:CadenceIngress.handle_request_with_rejection"]) == "ingress"
    assert bf._role(["ray::ServeReplica:cadence:CadenceReplica.handle_request"]) == "replica"
    assert bf._role(["ray::ProxyActor.receive_asgi_messages"]) == "HTTP proxy"
    assert bf._role(["ray::ServeController.run_control_loop"]) == "Serve controller"
    assert bf._role(["ray::IDLE"]) == "other Ray workers"
    assert bf._role(["/x/site-packages/ray/core/src/ray/raylet/raylet", "--flag"]) == "Ray system (raylet, GCS)"
    assert bf._role(["/usr/bin/python", "-m", "cadence.cli", "serve"]) == "cadence serve"


def test_a_busy_grandchild_is_counted_under_its_root():
    bf = _load()
    # A child that starts a grandchild which spins for a while: the grandchild's CPU is the tree's.
    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess,sys; subprocess.run([sys.executable,'-c',{spin!r}])"])
    try:
        before = bf.tree_cpu(parent.pid)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            roles = bf.cpu_by_role(before, bf.tree_cpu(parent.pid))
            if len(bf.tree_cpu(parent.pid)) == 2 and sum(roles.values()) >= 0.25:
                break
            time.sleep(0.1)
        assert len(bf.tree_cpu(parent.pid)) == 2  # the child and its grandchild
        assert sum(bf.cpu_by_role(before, bf.tree_cpu(parent.pid)).values()) >= 0.25
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()
