"""`cadence bench` and `cadence sim` options as a vLLM user writes them: what each flag selects,
what it records for `compare`, and the combinations refused by name. Nothing here needs a server:
the options are read as the CLI reads them, and the few HTTP answers are made in process."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import httpx
import pytest

from cadence.bench import report
from cadence.bench.cli import config_from_args, resolve_model
from cadence.bench.client import BenchConfig, _meta, prepare_workload
from cadence.bench.prompts import PromptBuilder, ServerTokenizer
from cadence.bench.report import RequestRecord
from cadence.chat_client import Client
from cadence.cli import build_parser, main

NOBODY = ["--base-url", "http://127.0.0.1:9", "--no-progress"]  # nothing listens: any connection fails


def _bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def _config(*argv: str) -> BenchConfig:
    return config_from_args(_bench_args(*NOBODY, *argv))


def _gaps(cfg: BenchConfig) -> list[float]:
    times = [r.arrival_time for r in prepare_workload(cfg).requests]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


# -- --burstiness -------------------------------------------------------------------------------


def test_burstiness_alone_selects_gamma_arrivals_of_that_shape() -> None:
    """vLLM's --burstiness is the gamma shape: 0.25 gives gaps with a coefficient of variation of 2."""
    cfg = _config("--rate", "4", "--burstiness", "0.25", "--num-requests", "4000", "--seed", "3")
    assert cfg.arrival == "gamma" and cfg.burstiness == 0.25
    gaps = _gaps(cfg)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.08)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(2.0, rel=0.1)
    assert _gaps(cfg) == gaps  # seeded


def test_burstiness_above_one_is_smoother_than_poisson() -> None:
    gaps = _gaps(_config("--rate", "4", "--burstiness", "16", "--num-requests", "4000"))
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)


@pytest.mark.parametrize(("argv", "says"), [
    (["--rate", "2", "--arrival", "poisson", "--burstiness", "0.5"], "--burstiness 0.5 with --arrival poisson"),
    (["--concurrency", "2", "--arrival", "none", "--burstiness", "0.5"], "not with --arrival none"),
    (["--trace", "traces/azure_llm_2023_conv.csv", "--arrival", "trace", "--burstiness", "2"],
     "not with --arrival trace"),
    (["--concurrency", "2", "--burstiness", "0.5"], "--burstiness: shapes the gaps between arrivals at a rate"),
    (["--request-rate", "inf", "--burstiness", "0.5"], "give a finite --rate"),
    (["--rate", "2", "--burstiness", "0"], "--burstiness: must be > 0"),
])
def test_burstiness_that_would_be_ignored_is_refused(argv: list[str], says: str, capsys) -> None:
    assert main(["bench", *NOBODY, "--num-requests", "3", *argv]) == 2
    assert says in capsys.readouterr().err


def test_poisson_named_with_burstiness_one_is_poisson() -> None:
    assert _config("--rate", "2", "--arrival", "poisson", "--burstiness", "1").arrival == "poisson"


def test_sim_reads_burstiness_as_the_gamma_shape(tmp_path: Path, capsys) -> None:
    argv = ["sim", "--workload", "chat", "--num-requests", "40", "--max-output-tokens", "8", "--rate", "5",
            "--burstiness", "0.25", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gamma arrivals at 5 req/s, seed 0, burstiness 0.25 (gamma shape" in out
    summary = report_json(tmp_path)
    assert summary["meta"]["arrival"] == "gamma" and summary["meta"]["burstiness"] == 0.25


def report_json(out: Path) -> dict:
    import json

    return json.loads((out / "summary.json").read_text())


# -- compare sees every setting that changes what is sent --------------------------------------


def _meta_of(*argv: str) -> dict:
    cfg = _config("--rate", "2", "--num-requests", "5", *argv)
    assert cfg.workload is not None
    return _meta(cfg, "m", cfg.workload, PromptBuilder(), 5, 5)


@pytest.mark.parametrize(("argv", "key"), [
    (["--max-output-tokens", "16"], "max_output_tokens"),
    (["--max-prompt-tokens", "64"], "max_prompt_tokens"),
    (["--scale-output", "0.5"], "scale_output"),
    (["--scale-lengths", "0.5"], "scale_lengths"),
    (["--temperature", "0.7"], "temperature"),
    (["--top-p", "0.9"], "top_p"),
    (["--no-exact-output"], "force_output_lengths"),
    (["--endpoint", "chat"], "endpoint"),
    (["--workload", "shared-prefix"], "workload"),
    (["--burstiness", "0.5"], "burstiness"),
])
def test_compare_notes_a_setting_that_changes_what_is_sent(argv: list[str], key: str) -> None:
    diffs = report.setting_differences(_meta_of(), _meta_of(*argv))
    assert [d.split(":")[0] for d in diffs if d.startswith(key)] == [key], diffs


def test_compare_warns_for_each_differing_setting() -> None:
    a = {"meta": _meta_of("--seed", "1")}
    b = {"meta": _meta_of("--seed", "2", "--max-output-tokens", "16", "--temperature", "0")}
    (line,) = report.compare_warnings(a, b)
    assert "differ in 3 settings" in line and "max_output_tokens: None vs 16" in line and "temperature" in line


# -- one load point: the sweep options are refused elsewhere ------------------------------------


_SIM = ["sim", "--workload", "chat", "--num-requests", "5"]


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", *NOBODY, "--rates", "1,2"], "--rates: only with `cadence bench sweep`"),
    (["bench", *NOBODY, "--concurrencies", "1,2"], "--concurrencies: only with `cadence bench sweep`"),
    ([*_SIM, "--rates", "1,2"], "--rates: only with `cadence bench sweep`; `cadence sim` runs one load point"),
    ([*_SIM, "--concurrencies", "2"], "--concurrencies: only with `cadence bench sweep`"),
    (["sim", "plan", *_SIM[1:], "--rates", "1,9", "--slo", "ttft_p95=1"], "`cadence sim plan` runs one load point"),
    (["sim", "plan", *_SIM[1:], "--rate", "5", "--replicas", "3", "--slo", "ttft_p95=1"],
     "--replicas: `cadence sim plan` searches the number of replicas itself"),
])
def test_sweep_options_outside_a_sweep_are_refused(argv: list[str], says: str, capsys) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_sim_help_does_not_offer_sweep_options(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim", "--help"])
    assert "--rates" not in capsys.readouterr().out


def test_save_result_to_two_directories_is_refused(tmp_path: Path, capsys) -> None:
    argv = ["bench", *NOBODY, "--rate", "1", "--save-result", "--out", str(tmp_path / "a"),
            "--result-dir", str(tmp_path / "b")]
    assert main(argv) == 2
    assert "two different directories" in capsys.readouterr().err


# -- why requests failed ------------------------------------------------------------------------


def _failed(i: int, error: str, status: int | None) -> RequestRecord:
    return RequestRecord(index=i, status=status, error=error, send_time=0.0, end_time=0.1)


def test_the_table_gives_the_three_commonest_error_reasons_with_counts() -> None:
    recs = [_failed(0, "HTTP 404: the model 'x' does not exist; this server serves 'y'", 404)] * 5
    recs += [_failed(1, "HTTP 400: prompt: too long " + "z" * 300, 400)] * 3
    recs += [_failed(2, "ReadTimeout: timed out", None)] * 2 + [_failed(3, "HTTP 500: boom", 500)]
    table = report.format_table(report.summarize(recs, {}))
    lines = table.splitlines()
    at = lines.index("errors by reason (most common first):")
    assert lines[at + 1].split(maxsplit=1) == ["5", "HTTP 404: the model 'x' does not exist; this server serves 'y'"]
    assert lines[at + 2].split()[0] == "3" and lines[at + 2].endswith("...") and len(lines[at + 2]) < 140
    assert lines[at + 3].split(maxsplit=1) == ["2", "ReadTimeout: timed out"]
    assert "boom" not in table  # the fourth reason is left out


def test_an_error_answer_is_recorded_by_its_message() -> None:
    body = b'{"error": {"message": "the model \'x\' does not exist", "type": "invalid_request_error"}}'
    assert report.error_detail(body) == "the model 'x' does not exist"
    assert report.error_detail(b'{"detail": "Not Found"}') == "Not Found"
    assert report.error_detail(b"plain words") == "plain words"


def test_a_tokenize_refusal_is_said_with_its_reason() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "the model 'wrong' does not exist; this server "
                                                              "serves 'smollm2'", "code": "model_not_found"}})

    tok, why = ServerTokenizer.probe_explained("http://srv", "wrong", transport=httpx.MockTransport(answer))
    assert tok is None
    assert why == "HTTP 404 from /tokenize: the model 'wrong' does not exist; this server serves 'smollm2'"
    method = PromptBuilder(None, tokenizer_refused=why).method
    assert "the server's /tokenize refused: HTTP 404" in method and "approximate" in method


def test_a_model_the_server_does_not_list_fails_before_the_load(monkeypatch) -> None:
    listing = {"object": "list", "data": [{"id": "smollm2"}, {"id": "alias"}]}
    monkeypatch.setattr("cadence.bench.cli.httpx.get", lambda url, **kw: httpx.Response(
        200, json=listing, request=httpx.Request("GET", url)))
    with pytest.raises(ValueError, match=r"--model 'wrong': .* lists 'smollm2', 'alias'; give one of them"):
        resolve_model(BenchConfig(base_url="http://srv", model="wrong"))
    cfg = BenchConfig(base_url="http://srv", model="alias")
    resolve_model(cfg)
    assert cfg.model == "alias"


# -- vLLM's defaults and spellings --------------------------------------------------------------


def test_no_rate_sends_every_request_at_time_zero_as_vllm() -> None:
    cfg = _config("--num-requests", "6")
    w = prepare_workload(cfg)
    assert cfg.arrival == "poisson" and cfg.rate == float("inf") and cfg.concurrency is None
    assert [r.arrival_time for r in w.requests] == [0.0] * 6
    assert "all 6 requests arrive at time 0" in w.notes[-1]
    assert _meta(cfg, "m", w, PromptBuilder(), 6, 6)["rate"] == "inf"  # JSON has no infinity


def test_request_rate_inf_with_a_cap_is_an_open_loop_at_time_zero() -> None:
    cfg = _config("--request-rate", "inf", "--max-concurrency", "3", "--num-requests", "5")
    w = prepare_workload(cfg)
    assert cfg.concurrency == 3 and all(r.arrival_time == 0.0 for r in w.requests)
    assert not any("closed loop" in n for n in w.notes)


@pytest.mark.parametrize("url", ["http://h:1/v1", "http://h:1/v1/", "http://h:1", "http://h:1/"])
def test_base_url_with_or_without_v1(url: str) -> None:
    assert _bench_args("--base-url", url).base_url == url
    assert config_from_args(_bench_args("--base-url", url, "--num-requests", "1")).base_url == "http://h:1"
    assert Client(url).base_url == "http://h:1/v1"


def test_vllm_endpoint_paths_and_disable_tqdm() -> None:
    assert _config("--endpoint", "/v1/chat/completions", "--disable-tqdm").endpoint == "chat"
    cfg = _config("--endpoint", "/v1/completions", "--disable-tqdm")
    assert cfg.endpoint == "completions" and cfg.progress is False


def test_percentile_table_rows_are_named_as_asked() -> None:
    from cadence.bench.cli import _percentile_request

    args = _bench_args("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50")
    names, pcts = _percentile_request(args)
    assert names == ["ttft", "e2el"] and pcts == [50.0]
    rec = RequestRecord(index=0, status=200, send_time=0.0, first_token_time=0.1, token_times=[0.1, 0.2],
                        end_time=0.3, output_tokens=2)
    rows = report.format_percentiles([rec], [report.VLLM_METRICS[n] for n in names], pcts, names).splitlines()
    assert [r.split()[0] for r in rows[1:]] == ["ttft", "e2el"]


# -- the simulator routes as the fleet does -------------------------------------------------------


@pytest.mark.parametrize("argv", [["sim"], ["sim", "plan"]])
def test_sim_and_plan_route_with_prefix_affinity_by_default(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).router == "prefix-affinity"


def test_a_server_without_tokenize_is_not_said_to_refuse() -> None:
    tok, why = ServerTokenizer.probe_explained(
        "http://srv", "m", transport=httpx.MockTransport(lambda r: httpx.Response(404, json={"detail": "Not Found"})))
    assert tok is None and why is None
