"""A client's `X-Request-Id` at the fleet's ingress (the FastAPI app over a `FleetClient`, with a
stand-in for the Serve handle to the replicas): the ingress names the request by it and
remembers it for `GET /v1/requests/{id}`, so one longer than any id that route takes is refused
before any replica sees it, and nothing of it is kept."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from fleet_stand_in import StandInHandle, fleet_client

from cadence.config import ServerConfig
from cadence.engine.output_processor import StreamDelta
from cadence.fleet.client import FleetClient, ReplicaHeaderMiddleware
from cadence.fleet.protocol import Admitted
from cadence.model.loader import default_model_path
from cadence.model.tokenizer import Tokenizer
from cadence.server.app import create_app
from cadence.server.request_status import MAX_REQUEST_ID_CHARS


class _Stream:
    """A replica's streamed answer: its admission, then one finished delta."""

    def __init__(self, request_id: str) -> None:
        self.items: list[Any] = [Admitted("r1"), StreamDelta(request_id, " x", [7], finish_reason="length",
                                                               num_prompt_tokens=3, num_output_tokens=1)]

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.items.clear()


class _Handle(StandInHandle):
    """The replica deployment's handle: `generate` calls are recorded and answered at once."""

    def __init__(self) -> None:
        super().__init__(generate=self._generate)
        self.calls: list[Any] = []

    def _generate(self, call: Any) -> _Stream:
        self.calls.append(call)
        return _Stream(call.request_id)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def _ingress(tokenizer: Tokenizer) -> tuple[TestClient, FleetClient, _Handle]:
    handle = _Handle()
    client = fleet_client(handle, tokenizer)
    client.subscribe_streams = False  # (the stand-in answers each call with its own stream: Admitted, then deltas)
    app = create_app(client, ServerConfig(host="127.0.0.1", port=0), render_metrics=client.render_metrics)
    app.add_middleware(ReplicaHeaderMiddleware, echo_request_id=True)
    return TestClient(app), client, handle


def _complete(http: TestClient, request_id: str) -> Any:
    return http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1},
                     headers={"X-Request-Id": request_id})


def test_an_x_request_id_longer_than_the_status_route_takes_is_refused(tokenizer) -> None:
    http, client, handle = _ingress(tokenizer)
    r = _complete(http, "r" * (MAX_REQUEST_ID_CHARS + 1))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and "X-Request-Id" in error["message"], error
    assert str(MAX_REQUEST_ID_CHARS) in error["message"], error
    assert handle.calls == []  # no replica saw it
    assert client._serve_ids == {}  # nothing of it is kept


def test_an_x_request_id_at_the_limit_names_the_request(tokenizer) -> None:
    http, client, handle = _ingress(tokenizer)
    rid = "r" * MAX_REQUEST_ID_CHARS
    r = _complete(http, rid)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    assert len(handle.calls) == 1 and client._serve_ids.get(rid) == r.json()["id"]
    assert client.num_in_flight == 0  # (what the ingress holds is let go with the response)
