"""`cadence.fleet:app`, the Serve application builder: `cadence serve`'s flags as arguments."""

from __future__ import annotations

import pytest

from cadence.cli import serve_parser
from cadence.fleet import app, serve_argv
from cadence.fleet.deploy import CONTROL_ONGOING


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
    # The engine's seats, and room beside them for the ingress's subscription and short calls.
    assert replica._deployment_config.max_ongoing_requests == 8 + 4 + CONTROL_ONGOING
    assert replica._deployment_config.request_router_config.request_router_kwargs == {"policy": "least-loaded"}
    engine_config = replica.init_args[0]
    assert engine_config.scheduler.max_num_seqs == 8 and engine_config.model.num_threads == 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="bad arguments"):
        app({"router": "random"})
    with pytest.raises(ValueError, match="replicas"):
        app({"replicas": 0})


def test_a_disaggregated_application_has_two_pools() -> None:
    application = app({"prefill-replicas": 2, "decode-replicas": 3, "replica-threads": 1, "kv-transfer-timeout": 9,
                       "max-num-seqs": 8, "max-queue-len": 4, "tiny": True})
    ingress = application._bound_deployment
    decode = ingress.init_args[0]._bound_deployment
    prefill = ingress.init_kwargs["prefill"]._bound_deployment
    assert (prefill.name, prefill.num_replicas) == ("CadencePrefill", 2)
    assert (decode.name, decode.num_replicas) == ("CadenceDecode", 3)
    assert prefill._deployment_config.request_router_config.request_router_kwargs == {"policy": "prefix-affinity"}
    assert decode._deployment_config.request_router_config.request_router_kwargs == {"policy": "least-loaded"}
    assert ingress.init_kwargs["kv_transfer_timeout_s"] == 9
