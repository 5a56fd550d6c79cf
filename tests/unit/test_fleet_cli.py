"""`cadence serve`'s fleet flags refuse what cannot work, at once and by name."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from cadence.cli import main
from cadence.fleet.launch import check_reachable


def test_an_unreachable_ray_address_is_a_clear_error_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="nothing answers at 127.0.0.1:1"):
        check_reachable("127.0.0.1:1")
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        check_reachable("no-port-here")
    # Through the command: exit 2 with the message, no local Ray started, within seconds (it retried
    # for minutes, deaf to SIGTERM, then started a local Ray with its dashboard).
    proc = subprocess.run([sys.executable, "-m", "cadence.cli", "serve", "--tiny", "--replicas", "2",
                           "--ray-address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--ray-address: nothing answers at 127.0.0.1:1" in proc.stderr, proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("answer", [None, b"HTTP/1.0 400 Bad Request\r\n\r\n"], ids=["silent", "http1"])
def test_a_ray_address_that_answers_but_not_as_ray_is_a_clear_error_at_once(answer: bytes | None) -> None:
    # Something else listening there (a web server, a port that accepts and says nothing): Ray's
    # connect would retry for minutes, deaf to signals, each try 40 s.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"

        def answer_once() -> None:
            conn, _ = listener.accept()
            with conn:
                if answer is not None:
                    conn.recv(1024)
                    conn.sendall(answer)
                time.sleep(3)

        server = threading.Thread(target=answer_once, daemon=True)
        server.start()
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=f"--ray-address: {address} answers, but not as a Ray cluster"):
            check_reachable(address, timeout=2.0)
        assert time.monotonic() - t0 < 5
        server.join()


def test_a_port_in_use_is_a_clear_error_before_ray_starts(capsys) -> None:
    import ray

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--tiny", "--replicas", "1", "--port", str(port)]) == 2
    assert f"--port: cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err
    assert not ray.is_initialized() and time.monotonic() - t0 < 10


@pytest.mark.parametrize("flags,says", [
    (["--router", "least-loaded"], "--router: a fleet option"),
    (["--replica-threads", "2"], "--replica-threads: a fleet option"),
    (["--replicas", "2", "--replica-threads", "0"], "--replica-threads: must be >= 1"),
    (["--replicas", "2", "--max-queued-requests", "0"], "--max-queued-requests: must be >= 1, got 0"),
])
def test_fleet_flags_without_a_fleet_or_out_of_range_are_refused(flags, says, capsys) -> None:
    assert main(["serve", "--tiny", *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("flags,says", [
    (["--prefill-replicas", "1"], "--prefill-replicas and --decode-replicas: give both"),
    (["--decode-replicas", "2"], "--prefill-replicas and --decode-replicas: give both"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"], "--replicas: not with"),
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "--prefill-replicas: must be >= 1"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-timeout", "0"],
     "--kv-transfer-timeout: must be > 0"),
    (["--replicas", "2", "--kv-transfer-timeout", "5"], "--kv-transfer-timeout: an option of disaggregated"),
    (["--kv-transfer-timeout", "5"], "--kv-transfer-timeout: a fleet option"),
])
def test_disaggregation_flags_that_cannot_work_are_refused(flags, says, capsys) -> None:
    assert main(["serve", "--tiny", *flags]) == 2
    assert says in capsys.readouterr().err


def test_disaggregation_flags_make_two_pools() -> None:
    from cadence.cli import fleet_options, serve_configs, serve_parser

    args = serve_parser().parse_args(["--tiny", "--prefill-replicas", "2", "--decode-replicas", "3",
                                      "--kv-transfer-timeout", "7.5", "--replica-threads", "1"])
    engine_cfg, fleet = fleet_options(args, serve_configs(args)[0])
    assert (fleet.prefill_replicas, fleet.decode_replicas, fleet.kv_transfer_timeout_s) == (2, 3, 7.5)
    assert fleet.disaggregated and fleet.num_replicas == 5 and engine_cfg.model.num_threads == 1


def _env_at_ray_init(monkeypatch, address: str | None) -> dict[str, str]:
    """The environment `start_ray` hands Ray (what its processes inherit), with `ray.init` recorded
    rather than run."""
    import ray

    from cadence.fleet.launch import RayOptions, start_ray

    seen: dict[str, str] = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(os.environ))
    monkeypatch.setattr("cadence.fleet.launch.check_reachable", lambda address: None)
    for key in ("RAY_USAGE_STATS_ENABLED", "RAY_enable_metrics_collection"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")  # an operator's own setting
    start_ray(RayOptions(address=address))
    return seen


def test_a_local_ray_starts_with_its_background_work_cut(monkeypatch) -> None:
    env = _env_at_ray_init(monkeypatch, None)
    assert env["RAY_enable_metrics_collection"] == "0"
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"  # the operator's value wins
    # A cluster joined by address keeps the environment its own `ray start` had.
    env = _env_at_ray_init(monkeypatch, "10.0.0.1:6379")
    assert "RAY_enable_metrics_collection" not in env


def test_a_sigterm_after_the_fleet_is_up_but_before_uvicorn_listens_stops_it_cleanly(monkeypatch) -> None:
    # Between the ingress being built and uvicorn taking SIGTERM, the signal was ignored: the fleet
    # went on serving. Now the server stops as soon as it has started, and the fleet is stopped.
    import signal

    import uvicorn

    from cadence.fleet import launch

    async def app(scope, receive, send):  # (never called: nothing connects)
        raise AssertionError("no request expected")

    class Server(uvicorn.Server):
        interrupted = False

        def run(self, sockets=None):
            signal.raise_signal(signal.SIGTERM)  # the SIGTERM lands before uvicorn installs its handlers
            super().run(sockets)

    server = Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning"))
    stopped = []
    monkeypatch.setattr(launch, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(launch, "start_ray", lambda opts: None)
    monkeypatch.setattr(launch, "deploy_pools", lambda *a: object())
    monkeypatch.setattr(launch, "_ingress_server", lambda ingress, config: server)
    monkeypatch.setattr(launch, "_close_ingress", lambda ingress: None)
    monkeypatch.setattr(launch, "stop_fleet", lambda: stopped.append(True))
    before = signal.getsignal(signal.SIGTERM)
    try:
        t0 = time.monotonic()
        from types import SimpleNamespace

        from cadence.config import EngineConfig, ServerConfig

        fleet = SimpleNamespace(num_replicas=2, router="least-loaded")
        assert launch.run_fleet(EngineConfig(), ServerConfig(), fleet, None) == 0
        assert server.started and server.should_exit and stopped == [True]
        assert time.monotonic() - t0 < 10
        signal.raise_signal(signal.SIGTERM)  # after uvicorn returned: flags the stopped server, nothing more
    finally:
        signal.signal(signal.SIGTERM, before)


def test_ray_address_auto_finds_the_cluster_ray_would_and_says_so_in_cadences_words(monkeypatch) -> None:
    from ray._private import services

    from cadence.fleet.launch import resolve_auto_address

    # Nothing to find: cadence's flag named, not Ray's `--address`.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    with pytest.raises(ValueError, match=r"--ray-address auto: no running Ray cluster found") as e:
        resolve_auto_address()
    assert "`--address`" not in str(e.value)
    # RAY_ADDRESS names one: auto is that address, checked like any other (a dead one refused at once).
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert resolve_auto_address().endswith(":1")  # (Ray gives a local host as the node's own address)
    proc = subprocess.run([sys.executable, "-m", "cadence.cli", "serve", "--tiny", "--replicas", "2",
                           "--ray-address", "auto"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert proc.returncode == 2 and "--ray-address: nothing answers at " in proc.stderr, proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
