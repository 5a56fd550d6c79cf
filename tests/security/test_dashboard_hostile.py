"""The dashboard against hostile clients, on `cadence serve --tiny` in its own process: tenants
invented to grow it, a tenant name written as markup, a tenant's key looking for the others."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ADMIN = {"authorization": "Bearer k-admin"}


def complete(url: str, headers: dict[str, str], **body: object) -> httpx.Response:
    payload = {"model": "tiny", "prompt": "hello", "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=60)


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", headers=ADMIN, timeout=10).json()["data"][0]["id"]


def test_invented_tenants_do_not_grow_the_dashboard(cli_server_factory):
    server = cli_server_factory("--api-key", "k-admin", "--max-tenant-labels", "2")
    model = served_model(server.url)
    for i in range(12):
        r = complete(server.url, {**ADMIN, "x-tenant": f"invented-{i}"}, model=model)
        assert r.status_code == 200, r.text
    service = httpx.get(f"{server.url}/dashboard/data", headers=ADMIN, timeout=10).json()["service"]
    assert service["finished"] == 12
    assert set(service["by_tenant"]) == {"invented-0", "invented-1", "other"}
    assert service["by_tenant"]["other"] == 10 * 2 and service["output_tokens"] == 12 * 2


def test_a_tenant_key_never_learns_another_tenant(cli_server_factory):
    server = cli_server_factory("--api-key", "k-admin", "--api-key-tenant", "k-acme=acme",
                                "--api-key-tenant", "k-globex=globex")
    model = served_model(server.url)
    assert complete(server.url, {"authorization": "Bearer k-globex"}, model=model).status_code == 200
    assert complete(server.url, ADMIN, model=model, user="secret-customer").status_code == 200
    seen = httpx.get(f"{server.url}/dashboard/data", headers={"authorization": "Bearer k-acme"}, timeout=10)
    assert seen.status_code == 200
    body = seen.text
    assert "globex" not in body and "secret-customer" not in body
    assert seen.json()["service"]["output_tokens"] == 4  # the totals still count everyone
    everyone = httpx.get(f"{server.url}/dashboard/data", headers=ADMIN, timeout=10).json()
    assert set(everyone["service"]["by_tenant"]) == {"globex", "secret-customer"}


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_markup_in_a_tenant_name_stays_text(cli_server_factory, tmp_path):
    server = cli_server_factory("--api-key", "k-admin")
    model = served_model(server.url)
    name = "<img src=x onerror=\"document.title='owned'\">"
    assert complete(server.url, ADMIN, model=model, user=name).status_code == 200
    data = httpx.get(f"{server.url}/dashboard/data", headers=ADMIN, timeout=10).json()
    assert name in data["service"]["by_tenant"]  # (JSON: the name as given)
    done = subprocess.run(
        [str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000", "--dump-dom",
         f"{server.url}/dashboard#key=k-admin"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-state="ok"' in dom and 'data-errors="0"' in dom, dom[:2000]
    assert "<img" not in dom and "owned" not in dom  # drawn on a canvas, never parsed as HTML
    assert "<title>cadence dashboard</title>" in dom
