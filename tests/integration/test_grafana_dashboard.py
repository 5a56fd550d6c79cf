"""examples/grafana_dashboard.json: a valid Grafana dashboard whose every query names a series the
server really exports (checked against a scrape of a live server after a small workload)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from test_metrics import samples

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json"
METRIC = re.compile(r"\b(cadence:[a-z0-9_]+)")


def _panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p.get("targets", [])]


def test_the_dashboard_is_a_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 16
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] >= 1, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    for expr in _exprs():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        assert METRIC.search(expr), expr


def test_every_query_names_a_series_the_server_exports(server_factory):
    live = server_factory(slo_ttft=10.0)
    for i in range(4):
        body = {"prompt": f"hello {i}", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(live.url + "/v1/completions", json=body, headers={"X-Tenant": f"t{i % 2}"},
                          timeout=60).status_code == 200
    assert httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    assert live.wait_idle()
    exported = {name for name, _ in samples(httpx.get(live.url + "/metrics").text)}
    named = {m for expr in _exprs() for m in METRIC.findall(expr)}
    assert len(named) >= 14
    missing = sorted(named - exported)
    assert not missing, f"the dashboard queries series the server does not export: {missing}"
