"""The fleet's ingress without Ray: a `FleetClient` over a stand-in for the Serve handle to the
replica deployment, whose methods are the test's own functions. For tests of what the ingress
itself does with a request (its admission, its id, its abort)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from cadence.config import EngineConfig
from cadence.fleet.client import FleetClient
from cadence.fleet.replica import ReplicaInfo
from cadence.model.loader import default_model_path
from cadence.model.tokenizer import Tokenizer


class StandInHandle:
    """The replicas' handle: `handle.NAME.remote(*args)` is `methods[NAME](*args)`, and
    `handle.options(...)` (streaming, a target) is the handle itself."""

    def __init__(self, **methods: Callable[..., Any]) -> None:
        for name, method in methods.items():
            setattr(self, name, SimpleNamespace(remote=method))

    def options(self, **_: Any) -> StandInHandle:
        return self


def fleet_client(handle: StandInHandle, tokenizer: Tokenizer | None = None) -> FleetClient:
    """An ingress's `FleetClient` over `handle`, for the default model's tokenizer (replicas with
    1,024-token contexts), holding at most 8 requests."""
    tokenizer = tokenizer or Tokenizer.from_model_path(default_model_path())
    info = ReplicaInfo("tiny", 1024, 1024, tokenizer.vocab_size, 16, "sha256")
    return FleetClient(handle, info, tokenizer, EngineConfig.from_options(max_model_len=1024), max_held=8)
