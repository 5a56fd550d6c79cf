"""The fleet's HTTP ingress: the FastAPI app of `cadence serve` over a `FleetClient`.

Two hosts run it, with the same code:

- `cadence serve --replicas N` runs it in its own process, on uvicorn (with the head limits of a
  single server), talking to the replica deployments through Serve handles obtained there; Serve's
  HTTP proxy is not started. Every streamed token crosses Ray once, replica to this process.
- The importable Serve application (`serve run cadence.fleet:app`) runs it in its
  `CadenceIngress` deployment, behind Serve's HTTP proxy.

Importing this module imports nothing of Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cadence.config import EngineConfig, ServerConfig
from cadence.fleet.replica import ReplicaInfo


@dataclass(frozen=True)
class Ingress:
    """The app and the engine client under it (drained on SIGTERM)."""

    app: Any  # FastAPI
    client: Any  # FleetClient


def build_ingress(replicas: Any, info: ReplicaInfo, engine_config: EngineConfig, server_config: ServerConfig, *,
                  prefill: Any = None, kv_transfer_timeout_s: float = 30.0, behind_proxy: bool,
                  max_held: int | None = None) -> Ingress:
    """The ingress app over the handle `replicas` (the decode pool when `prefill`, the prefill
    pool's handle, is given). `behind_proxy`: Serve's HTTP proxy is in front, and itself sends
    back the request's X-Request-Id. `max_held`: the requests it holds at once (deploy.max_held)."""
    from cadence.fleet import state
    from cadence.fleet.client import FleetClient, ReplicaHeaderMiddleware
    from cadence.model.loader import default_model_path
    from cadence.model.tokenizer import Tokenizer
    from cadence.server.app import create_app

    model = engine_config.model.model
    tokenizer = Tokenizer.from_model_path(model if model else default_model_path())
    if prefill is not None:
        from cadence.fleet.pd_client import PDFleetClient

        client: FleetClient = PDFleetClient(prefill, replicas, info, tokenizer, engine_config, kv_transfer_timeout_s,
                                              max_held)
    else:
        client = FleetClient(replicas, info, tokenizer, engine_config, max_held)
    app = create_app(client, server_config, render_metrics=client.render_metrics)
    for handle in (replicas, prefill):
        if handle is not None:
            state.routes_to(handle.deployment_name)
    app.state.exporter.watch_routing_decisions(state.routing_decisions)  # (the router runs in this process)
    app.add_middleware(ReplicaHeaderMiddleware, echo_request_id=not behind_proxy)
    return Ingress(app, client)
