"""`cadence.fleet:app`, the Serve application builder: `cadence serve`'s flags as arguments."""

from __future__ import annotations

import pytest

from cadence.cli import serve_parser
from cadence.fleet import app, serve_argv


def test_builder_arguments_become_serve_flags() -> None:
    known = serve_parser()._option_string_actions
    argv = serve_argv({"replicas": 3, "tiny": True, "enable_prefix_caching": False, "verbose": False,
                       "max-num-seqs": "8"}, known)
    assert argv == ["--replicas", "3", "--tiny", "--no-enable-prefix-caching", "--max-num-seqs", "8"]


def test_the_application_carries_the_options() -> None:
    application = app({"replicas": 3, "router": "least-loaded", "replica-threads": 1, "max-num-seqs": 8,
                       "max-queue-len": 4, "tiny": True})
    replica = application._bound_deployment.init_args[0]._bound_deployment  # the replicas' deployment
    assert replica.num_replicas == 3
    assert replica._deployment_config.max_ongoing_requests == 8 + 4
    assert replica._deployment_config.request_router_config.request_router_kwargs == {"policy": "least-loaded"}
    engine_config = replica.init_args[0]
    assert engine_config.scheduler.max_num_seqs == 8 and engine_config.model.num_threads == 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="bad arguments"):
        app({"router": "random"})
    with pytest.raises(ValueError, match="replicas"):
        app({"replicas": 0})
