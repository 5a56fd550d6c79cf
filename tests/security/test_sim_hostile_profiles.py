"""The simulator and planner against hand-edited profiles, absurd traces and huge runs: each is
refused with a message naming the field, or served as the engine would serve it, never quietly
turned into wrong latencies, a hang or an exhausted memory."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from cadence.config import EngineConfig
from cadence.executor.cost_model import StepCostModel
from cadence.sim import simulator as simulator_module
from cadence.sim.cli import LONG_RUN_REQUESTS, _warn_long_run
from cadence.sim.plan import unloaded_ttft
from cadence.sim.profile import default_profile_path
from cadence.sim.simulator import SimOptions, Simulator
from cadence.workload import Workload, WorkloadRequest

SHIPPED = json.loads(Path(default_profile_path()).read_text())


def _write(tmp_path: Path, edit) -> Path:
    d = copy.deepcopy(SHIPPED)
    edit(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))  # (json writes NaN and Infinity as Python reads them back)
    return path


def _coef(name: str, value):
    return lambda d: d["cost_model"]["coefficients"].__setitem__(name, value)


@pytest.mark.parametrize(("edit", "message"), [
    (_coef("prefill_tokens", -0.01), r"coefficients: \['prefill_tokens'\] must be finite and >= 0"),
    (_coef("prefill_tokens", float("nan")), r"coefficients: \['prefill_tokens'\] must be finite and >= 0"),
    (_coef("decode_context", float("inf")), r"coefficients: \['decode_context'\] must be finite and >= 0"),
    (_coef("prefill_tokens", "0.001"), r"coefficients\.prefill_tokens: expected a number of seconds"),
    (lambda d: d["cost_model"].__setitem__("min_cost", -1), r"min_cost: must be finite and > 0"),
    (lambda d: d["cost_model"].__setitem__("request_path", {"per_request": "3ms"}),
     r"request_path\.per_request: expected a number of seconds, got '3ms'"),
    (lambda d: d["cost_model"].__setitem__("request_path", None), r"request_path: expected an object of terms"),
    (lambda d: d.__setitem__("kv_bytes_per_token", 0), r"kv_bytes_per_token: must be a whole number > 0, got 0"),
    (lambda d: d.__setitem__("kv_bytes_per_token", "abc"), r"kv_bytes_per_token: must be a whole number > 0"),
])
def test_a_hand_edited_profile_is_refused_naming_the_field(tmp_path, edit, message) -> None:
    path = _write(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as e:
        StepCostModel.load(path)
    assert str(e.value).startswith(str(path))


def test_an_old_profile_without_the_per_token_term_still_loads(tmp_path) -> None:
    path = _write(tmp_path, lambda d: d["cost_model"].__setitem__("request_path", {"per_request": 0.003}))
    model = StepCostModel.load(path)
    assert model.request_delay_for(500) == 0.003


def test_a_prompt_no_replica_can_hold_is_refused_without_being_built(monkeypatch) -> None:
    built: list[int] = []
    real = simulator_module.PromptSynth.prompt

    def spy(self, index, req):
        built.append(req.prompt_tokens)
        return real(self, index, req)

    monkeypatch.setattr(simulator_module.PromptSynth, "prompt", spy)
    model = StepCostModel.load(default_profile_path())
    w = Workload("w", (WorkloadRequest(arrival_time=0.0, prompt_tokens=100, output_tokens=4),
                       WorkloadRequest(arrival_time=0.1, prompt_tokens=5_000_000, output_tokens=4)))
    res = Simulator(EngineConfig(), model, SimOptions(max_model_len=1000)).run(w)
    ok, refused = res.records
    assert ok.status == 200 and refused.status == 400
    assert refused.error == ("invalid_request: prompt (5000000 tokens) + max_tokens (4) = 5000004 exceeds "
                             "max_model_len (1000)")
    assert built == [100]  # the refused prompt was never synthesised


def test_the_unloaded_floor_leaves_out_requests_longer_than_the_context() -> None:
    model = StepCostModel("tokens", {"const": 0.1}, {"kv_bytes_per_token": 1000})
    w = Workload("w", (WorkloadRequest(arrival_time=0.0, prompt_tokens=10, output_tokens=5),
                       WorkloadRequest(arrival_time=0.0, prompt_tokens=10**7, output_tokens=5)))
    # (Without the bound this prices 19,532 chunks of the refused prompt.)
    assert unloaded_ttft(w, EngineConfig(), model, max_model_len=4096) == pytest.approx([0.1])


def test_a_run_of_millions_of_requests_says_so_before_it_starts(capsys) -> None:
    _warn_long_run(200_000_000)
    err = capsys.readouterr().err
    assert "200,000,000 requests" in err and "2,000 minutes" in err
    _warn_long_run(LONG_RUN_REQUESTS)
    assert capsys.readouterr().err == ""


def test_a_trace_repeated_into_millions_of_requests_says_so_before_it_is_built(tmp_path, monkeypatch, capsys) -> None:
    from cadence.sim import cli as sim_cli

    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,2\n"
                     "2023-11-16 18:15:47.6805900,10,2\n")

    def stop(w, n):  # the repeat itself is what would take the minutes: the note must come first
        raise RuntimeError("repeated")

    monkeypatch.setattr("cadence.sim.workloads.repeat_workload", stop)
    from cadence.cli import build_parser

    args = build_parser().parse_args(["sim", "--trace", str(trace), "--repeat", "600000"])
    with pytest.raises(RuntimeError, match="repeated"):
        sim_cli.prepare_workload(args)
    assert "1,200,000 requests (the workload x --repeat)" in capsys.readouterr().err


_GOOD = {"median": 0.95, "low": 0.8, "high": 1.1, "cells": 9, "within": 7}


def _validation(ratios: dict, loads=(0.3,), **extra):
    block = {"date": "2026-12-02", "machine": "x", "workloads": ["chat"], "seeds": [1], "loads": list(loads),
             "ratios": ratios, **extra}
    return lambda d: d.__setitem__("validation", block)


_REAL = {"within": 8, "cells": 12, "repeats": 2}


@pytest.mark.parametrize(("edit", "message"), [
    (_validation({"ttft_p90": {**_GOOD, "low": 0.0}}), r"validation\.ratios\.ttft_p90\.low: a ratio sim/real must be"),
    (_validation({"ttft_p90": {**_GOOD, "low": -1.0}}), r"validation\.ratios\.ttft_p90\.low: a ratio sim/real must be"),
    (_validation({"ttft_p90": {**_GOOD, "high": float("nan")}}), r"validation\.ratios\.ttft_p90\.high"),
    (_validation({"ttft_p90": {**_GOOD, "low": 1.5, "high": 0.5}}), r"low <= median <= high"),
    (_validation({"ttft_p90": {**_GOOD, "within": 99}}), r"0 <= within <= cells"),
    (_validation({"ttft_p90": {"median": 1.0}}), r"validation\.ratios\.ttft_p90: expected the fields"),
    (_validation({"ttft": _GOOD}), r"validation\.ratios: 'ttft' is not METRIC_pQ"),
    (_validation({"ttft_p90": _GOOD}, loads=["a"]), r"validation\.loads: expected a list of fractions"),
    (_validation({"ttft_p90": _GOOD}, real_vs_real={**_REAL, "within": 13}), r"real_vs_real: .*0 <= within <= cells"),
    (_validation({"ttft_p90": _GOOD}, real_vs_real={**_REAL, "within": -1}), r"real_vs_real: .*0 <= within <= cells"),
    (_validation({"ttft_p90": _GOOD}, real_vs_real={**_REAL, "repeats": 1}), r"real_vs_real: .*repeats >= 2"),
    (_validation({"ttft_p90": _GOOD}, real_vs_real={**_REAL, "cells": 12.0}), r"real_vs_real: expected whole numbers"),
    (_validation({"ttft_p90": _GOOD}, real_vs_real={**_REAL, "within": True}), r"real_vs_real: expected whole numbers"),
    (_validation({"ttft_p90": _GOOD}, real_vs_real={"within": 8, "cells": 12}), r"real_vs_real: expected the fields"),
    (_validation({"ttft_p90": _GOOD}, real_vs_real=0.67), r"validation\.real_vs_real: expected the fields"),
])
@pytest.mark.parametrize("command", [["sim"], ["sim", "plan", "--slo", "ttft_p95=1", "--max-replicas", "1"]])
def test_a_validation_block_that_lies_is_refused_before_the_run(tmp_path, capsys, edit, message, command) -> None:
    from cadence.cli import main

    path = _write(tmp_path, edit)
    rc = main([*command, "--workload", "chat", "--num-requests", "4", "--rate", "1", "--profile", str(path)])
    out, err = capsys.readouterr()
    assert rc == 2 and "ttft" not in out  # refused before any report or plan row
    assert re.search(message, err) and err.startswith(f"cadence: error: {path}: "), err


@pytest.mark.parametrize(("files", "message"), [
    ({}, r"--from-served .*: no breakdown\.json \(run benchmarks/serving_breakdown\.py"),
    ({"breakdown.json": "not json"}, r"breakdown\.json: not JSON"),
    ({"breakdown.json": '{"runs": 3}'}, r"breakdown\.json: expected an object with a list of 'runs'"),
    ({"breakdown.json": '{"runs": []}', "steps_0.jsonl": "garbage\n"}, r"steps_0\.jsonl:1: not JSON"),
    ({"breakdown.json": '{"runs": []}', "steps_0.jsonl": '{"duration": 0.01, "prefill_tokens": 4}\n'
      '{"duration": "x", "prefill_tokens": 4}\n'}, r"steps_0\.jsonl:2: not a step record .*duration"),
    ({"breakdown.json": '{"runs": []}', "steps_0.jsonl": '{"duration": 0.01, "prefill_tokens": -5}\n'},
     r"steps_0\.jsonl:1: not a step record .*whole numbers >= 0"),
])
def test_a_damaged_served_breakdown_is_refused_naming_the_file(tmp_path, capsys, files, message) -> None:
    from cadence.cli import main

    d = tmp_path / "breakdown"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    assert main(["calibrate", "--from-served", str(d), "--out", str(tmp_path / "out.json")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out.json").exists()


_NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def test_plan_simulates_a_speculating_engine_at_the_given_acceptance(capsys) -> None:
    from cadence.cli import main

    rc = main(["sim", "plan", "--workload", "chat", "--num-requests", "6", "--rate", "2", "--slo", "ttft_p95=5",
               "--max-replicas", "1", "--speculative-config", _NGRAM, "--spec-acceptance-rate", "0.7"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "cheapest: 1 replica" in out


@pytest.mark.parametrize("command", [["sim"], ["sim", "plan", "--slo", "ttft_p95=5", "--max-replicas", "1"]])
def test_an_acceptance_rate_without_speculation_is_refused(capsys, command) -> None:
    from cadence.cli import main

    rc = main([*command, "--workload", "chat", "--num-requests", "4", "--rate", "1", "--spec-acceptance-rate", "0.7"])
    assert rc == 2
    assert "--spec-acceptance-rate): only with speculative_config (--speculative-config)" in capsys.readouterr().err
