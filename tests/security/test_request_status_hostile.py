"""GET /v1/requests/{id} against hostile callers: a tenant's key asking for another tenant's
request, unknown ids, huge and odd ids. Each gets the one 404 an unknown id gets, never a 500
and never a hint that the id exists."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app
from conftest import TINY

ACME = {"authorization": "Bearer k-acme"}
GLOBEX = {"authorization": "Bearer k-globex"}
ADMIN = {"authorization": "Bearer k-admin"}


@pytest.fixture(scope="module")
def tenants_client() -> Iterator[TestClient]:
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    config = ServerConfig(api_keys=("k-admin", "k-acme", "k-globex"), api_key_tenants=(("k-acme", "acme"), ("k-globex", "globex")))
    app = create_app(engine, config)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client
    finally:
        engine.shutdown(timeout=10)


def acme_request(client: TestClient) -> str:
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True}, headers=ACME)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == r.json()["id"]
    return r.json()["id"]


def test_a_tenant_sees_its_own_finished_request(tenants_client: TestClient) -> None:
    rid = acme_request(tenants_client)
    r = tenants_client.get(f"/v1/requests/{rid}", headers=ACME)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == rid and body["state"] == "finished" and body["finish_reason"] == "length"
    assert body["output_tokens"] == 2 and body["prompt_tokens_computed"] == body["prompt_tokens"]


def test_another_tenants_request_is_a_404_like_an_unknown_one(tenants_client: TestClient) -> None:
    rid = acme_request(tenants_client)
    theirs = tenants_client.get(f"/v1/requests/{rid}", headers=GLOBEX)
    unknown = tenants_client.get("/v1/requests/cmpl-0123456789abcdef0123456789abcdef", headers=GLOBEX)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.content == unknown.content  # the same body: nothing says the id exists
    assert rid not in theirs.text
    # A key without a tenant (the operator's) sees every tenant's requests.
    assert tenants_client.get(f"/v1/requests/{rid}", headers=ADMIN).status_code == 200


def test_without_a_key_it_is_refused(tenants_client: TestClient) -> None:
    rid = acme_request(tenants_client)
    assert tenants_client.get(f"/v1/requests/{rid}").status_code == 401


@pytest.mark.parametrize("rid", [
    "x" * 5000,
    "*",  # what the engine calls every request internally
    "%00",
    "..%5C..%5Cetc%5Cpasswd",
    "%F0%9F%92%A5",
    "%FF%FE",
    "cmpl-%0D%0AX-Evil:%201",
    "'; DROP TABLE requests; --",
])
def test_odd_ids_are_404(tenants_client: TestClient, rid: str) -> None:
    r = tenants_client.get(f"/v1/requests/{rid}", headers=ADMIN)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "not_found" and r.json()["error"]["param"] == "request_id"
    assert "x-evil" not in r.headers
