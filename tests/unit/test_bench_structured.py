"""`cadence bench --structured-fraction`: that fraction of the requests, chosen by the seed, carry a
response_format (the built-in extraction schema, or --response-format's), and nothing else about
the requests changes, so a mixed run and a plain one with the same seed send the same prompts and
lengths. No server: the sends are recorded in process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema
import pytest

from cadence.bench import client as bench_client
from cadence.bench.cli import config_from_args
from cadence.bench.client import EXTRACTION_RESPONSE_FORMAT, EXTRACTION_SCHEMA, BenchConfig, run_benchmark
from cadence.cli import build_parser


def _sent(monkeypatch, cfg: BenchConfig) -> tuple[list[dict], list]:
    """The bodies a run sends (in workload order) and its records, with every answer a 200."""
    bodies: dict[int, dict] = {}

    async def stream(_client, _path, body, _headers, rec, _t0) -> None:
        bodies[rec.index] = body
        rec.status, rec.end_time, rec.output_tokens, rec.output_count_source = 200, 0.0, body["max_tokens"], "usage"

    monkeypatch.setattr(bench_client, "_stream", stream)
    result = run_benchmark(cfg)
    return [bodies[i] for i in sorted(bodies)], result.records


def _config(**kw) -> BenchConfig:
    return BenchConfig(model="m", tokenizer="none", arrival="none", concurrency=4, num_requests=40, progress=False,
                       endpoint="chat", **kw)


def test_the_fraction_of_requests_carries_the_extraction_schema(monkeypatch):
    bodies, records = _sent(monkeypatch, _config(structured_fraction=0.5, seed=7))
    structured = [i for i, b in enumerate(bodies) if "response_format" in b]
    assert len(structured) == 20
    assert [r.index for r in records if r.structured] == structured
    assert all(bodies[i]["response_format"] == EXTRACTION_RESPONSE_FORMAT for i in structured)
    assert structured != list(range(structured[0], structured[0] + 20))  # spread over the run, not one block
    jsonschema.Draft202012Validator.check_schema(EXTRACTION_SCHEMA)
    # The rest of each body is what the plain run with the same seed sends: same prompts, same lengths.
    plain, _ = _sent(monkeypatch, _config(seed=7))
    assert [{k: v for k, v in b.items() if k != "response_format"} for b in bodies] == plain
    assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] for b in bodies)


def test_the_choice_is_the_seeds(monkeypatch):
    def chosen(seed: int) -> list[int]:
        bodies, _ = _sent(monkeypatch, _config(structured_fraction=0.25, seed=seed))
        return [i for i, b in enumerate(bodies) if "response_format" in b]

    assert chosen(3) == chosen(3) and len(chosen(3)) == 10
    assert chosen(3) != chosen(4)
    for fraction, count in ((0.0, 0), (1.0, 40), (0.01, 0), (0.49, 20)):
        bodies, _ = _sent(monkeypatch, _config(structured_fraction=fraction))
        assert sum("response_format" in b for b in bodies) == count, fraction


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "--base-url", "http://127.0.0.1:9", "--no-progress", *argv])


def test_the_options_and_what_the_report_records(monkeypatch, tmp_path: Path):
    cfg = config_from_args(_args("--structured-fraction", "0.5", "--num-requests", "10"))
    assert cfg.structured_fraction == 0.5 and cfg.response_format is None
    assert config_from_args(_args("--num-requests", "10")).structured_fraction == 0.0
    own = {"type": "json_schema", "json_schema": {"name": "mine", "schema": {"type": "object"}}}
    path = tmp_path / "fmt.json"
    path.write_text(json.dumps(own))
    cfg = config_from_args(_args("--response-format", str(path), "--num-requests", "10"))
    assert cfg.structured_fraction == 1.0 and cfg.response_format == own  # a file alone: every request
    cfg.model, cfg.tokenizer = "m", "none"
    bodies, _ = _sent(monkeypatch, cfg)
    assert all(b["response_format"] == own for b in bodies)
    meta = run_benchmark(cfg).summary["meta"]
    assert meta["structured_fraction"] == 1.0 and meta["response_format"] == "mine"
    assert any("10 of 10 requests sent response_format 'mine'" in n for n in meta["notes"]), meta["notes"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--structured-fraction", "1.5"], "--structured-fraction: must be in [0, 1]"),
    (["--structured-fraction", "-0.1"], "--structured-fraction: must be in [0, 1]"),
    (["--response-format", "/nonexistent/fmt.json"], "--response-format: /nonexistent/fmt.json: no such file"),
])
def test_bad_values_are_refused_by_name(argv: list[str], says: str):
    with pytest.raises(ValueError) as info:
        config_from_args(_args(*argv))
    assert says in str(info.value)


@pytest.mark.parametrize("content", [
    EXTRACTION_SCHEMA,  # a bare schema, not a response_format object
    {"type": "json_object", "json_schema": {"name": "x", "schema": EXTRACTION_SCHEMA}},  # the server refuses the pair
])
def test_a_file_that_is_not_a_response_format_is_refused(tmp_path: Path, content: dict):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="--response-format: .* must hold"):
        config_from_args(_args("--response-format", str(path)))


def test_a_constrained_request_that_stops_where_its_json_ends_is_not_blamed_on_the_server(monkeypatch):
    async def stream(_client, _path, body, _headers, rec, _t0) -> None:
        short = "response_format" in body  # its JSON complete halfway: the grammar's end stops it
        rec.status, rec.end_time, rec.finish_reason = 200, 0.0, "stop" if short else "length"
        rec.output_tokens = body["max_tokens"] // 2 if short else body["max_tokens"]
        rec.output_count_source = "usage"

    monkeypatch.setattr(bench_client, "_stream", stream)
    warnings = run_benchmark(_config(structured_fraction=0.5)).summary["warnings"]
    assert any(w.startswith("20 of 20 completed requests with a response_format stopped before the asked length")
               for w in warnings), warnings
    assert not any("does not honour" in w for w in warnings), warnings
