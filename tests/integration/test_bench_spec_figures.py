"""`cadence bench` reports speculative decoding's figures from the server's /metrics counters."""

from __future__ import annotations

import json

import httpx
import pytest
from test_metrics import samples

from cadence.bench.cli import main as bench_main
from cadence.bench.speculative import EXACT_LENGTH_HINT

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
COUNTERS = ("cadence:spec_decode_num_drafts_total", "cadence:spec_decode_num_draft_tokens_total",
            "cadence:spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def spec_server(server_factory):
    return server_factory({"speculative_config": SPEC})


def _counters(url: str) -> list[float]:
    s = samples(httpx.get(url + "/metrics").text)
    return [s[(name, ())] for name in COUNTERS]


def _bench(url: str, out, *extra: str) -> dict:
    argv = ["--base-url", url, "--workload", "chat", "--num-requests", "6", "--concurrency", "2",
            "--temperature", "0", "--seed", "5", "--max-output-tokens", "48", "--no-progress", "--out", str(out),
            *extra]
    assert bench_main(argv) == 0
    return json.loads((out / "summary.json").read_text())


def test_the_summary_reports_the_runs_spec_counters(spec_server, tmp_path, capsys) -> None:
    before = _counters(spec_server.url)
    summary = _bench(spec_server.url, tmp_path, "--no-exact-output")
    after = _counters(spec_server.url)
    rows, proposed, accepted = (int(a - b) for a, b in zip(after, before, strict=True))
    spec = summary["speculative"]
    assert proposed > 0, "no drafts proposed: the test would not exercise the figures"
    assert (spec["verification_rows"], spec["draft_tokens"], spec["accepted_tokens"]) == (rows, proposed, accepted)
    assert 0 <= accepted <= proposed
    assert spec["acceptance_rate"] == pytest.approx(accepted / proposed)
    assert spec["mean_k"] == pytest.approx(proposed / rows)
    assert spec["accepted_per_row"] == pytest.approx(accepted / rows)
    printed = capsys.readouterr().out
    assert f"draft tokens {proposed}  accepted {accepted}" in printed
    assert EXACT_LENGTH_HINT not in printed


def test_exact_lengths_on_a_speculating_server_print_the_hint(spec_server, tmp_path, capsys) -> None:
    summary = _bench(spec_server.url, tmp_path)
    assert summary["speculative"] is None  # min_tokens: no request speculated
    assert f"note: {EXACT_LENGTH_HINT}" in capsys.readouterr().out


def test_a_server_without_speculation_gives_no_section(server, tmp_path, capsys) -> None:
    summary = _bench(server.url, tmp_path, "--no-exact-output")
    assert "speculative" in summary and summary["speculative"] is None
    printed = capsys.readouterr().out
    assert "speculative" not in printed and "draft tokens" not in printed


def test_exact_lengths_on_a_server_that_does_not_speculate_print_no_hint(server, tmp_path, capsys) -> None:
    summary = _bench(server.url, tmp_path)
    assert summary["speculative"] is None
    assert EXACT_LENGTH_HINT not in capsys.readouterr().out


def test_metrics_say_how_far_the_server_speculates(server, spec_server) -> None:
    name = ("cadence:spec_decode_num_speculative_tokens", ())
    assert samples(httpx.get(spec_server.url + "/metrics").text)[name] == SPEC["num_speculative_tokens"]
    assert samples(httpx.get(server.url + "/metrics").text)[name] == 0
