"""Bad input at the edges, without a model: engine options, sampling parameters, and the numeric
flags of `cadence bench` / `cadence sim` / `cadence calibrate`. Each must be refused with a
ValueError or TypeError (or exit status 2 and one line on stderr) naming the field or flag, never
accepted as something else, and never after work was done."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cadence.cli import main
from cadence.config import EngineConfig, parse_size
from cadence.request import SamplingParams

# -- engine options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_num_seqs": 2.5}, "max_num_seqs"),  # was accepted: a float where an integer is meant
        ({"max_num_seqs": "8"}, "max_num_seqs"),  # was "'>=' not supported between 'str' and 'int'"
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),  # was accepted, and truthy
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),  # was a TypeError naming nothing
        ({"deadline_aging": float("nan")}, "deadline_aging"),
        ({"policy": 3}, "policy"),
        ({"tenant_weights": (("a",),)}, "tenant_weights"),  # was "not enough values to unpack"
        ({"tenant_weights": {"a": -1.0}}, "tenant_weights"),
    ],
)
def test_engine_options_of_the_wrong_type_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        EngineConfig.from_options(**options)


def test_engine_options_take_the_spellings_the_command_line_takes() -> None:
    cfg = EngineConfig.from_options(kv_cache_memory="512MiB", tenant_weights={"alice": 2, "bob": 1.5})
    assert cfg.cache.kv_cache_memory == 512 << 20
    assert cfg.scheduler.tenant_weights == (("alice", 2), ("bob", 1.5))
    assert EngineConfig.from_options(kv_cache_memory=1e9).cache.kv_cache_memory == 10**9
    assert EngineConfig.from_options(model=Path("/models/m.gguf")).model.model == "/models/m.gguf"
    assert parse_size("1e9") == 10**9 and parse_size("2GiB") == 2 << 30
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_options(max_num_seq=3)


# -- sampling parameters --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"stop": 5}, "stop"),  # was "'int' object is not iterable"
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),  # was "invalid literal for int()"
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"n": True}, "n"),  # bools were taken for 1
        ({"max_tokens": True}, "max_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"temperature": True}, "temperature"),
        ({"ignore_eos": "no"}, "ignore_eos"),  # was accepted, and truthy
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_sampling_params_of_the_wrong_type_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kw)


def test_sampling_params_accept_json_shapes() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3], logit_bias={"7": 1, 8: -2.5})
    assert p.stop == ("a", "b") and p.stop_token_ids == (3,) and p.logit_bias == ((7, 1), (8, -2.5))
    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias=None).stop == ()


# -- cadence bench / sim / sim plan / calibrate flags ----------------------------------------------

_SIM = ["sim", "--workload", "chat", "--num-requests", "5"]
_NOBODY = ["--base-url", "http://127.0.0.1:9", "--num-requests", "3"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([*_SIM, "--rate", "0"], "--rate: must be > 0"),  # was "give --rate ...": 0 read as absent
        ([*_SIM, "--concurrency", "0"], "--concurrency: must be >= 1"),
        ([*_SIM, "--rate", "5", "--repeat", "0"], "--repeat: must be >= 1"),  # was ignored, exit 0
        ([*_SIM, "--rate", "5", "--repeat", "-3"], "--repeat: must be >= 1"),
        ([*_SIM, "--rate", "5", "--replicas", "0"], "--replicas: must be >= 1"),
        ([*_SIM, "--rate", "5", "--duration", "-1"], "--duration: must be > 0"),  # was 0 requests, exit 1
        ([*_SIM, "--rate", "5", "--rate-scale", "-1"], "--rate-scale: must be > 0"),
        (["sim", "--workload", "chat", "--num-requests", "0", "--rate", "5"], "--num-requests: must be >= 1"),
        ([*_SIM, "--rate", "5", "--profile", "/no/such/profile.json"], "--profile /no/such/profile.json: no such file"),
        (["sim", "plan", *_SIM[1:], "--rate", "5"], "--slo: give at least one objective"),
        (["sim", "plan", *_SIM[1:], "--rate", "5", "--slo", "ttft_p95=1", "--max-replicas", "0"],
         "--max-replicas: must be >= 1"),  # was "no configuration met the SLOs with up to 0 replicas"
        (["sim", "plan", *_SIM[1:], "--rate", "5", "--slo", "ttft_p95=1", "--max-error-rate", "-1"],
         "--max-error-rate: must be a fraction"),
        (["sim", "plan", *_SIM[1:], "--rate", "5", "--slo", "ttft_p95=1", "--grid", "max_num_seqs=a,b"],
         "max_num_seqs takes int values"),  # was "invalid literal for int()"
        (["sim", "plan", *_SIM[1:], "--rate", "5", "--slo", "ttft_p95=1", "--grid", "max_num_seqs="],
         "no values to try"),  # was an empty search reported as "no configuration met the SLOs"
        (["sim", "plan", *_SIM[1:], "--rate", "5", "--slo", "ttft_p95=1", "--grid", "enable_prefix_caching=maybe"],
         "takes true or false"),
        (["bench", *_NOBODY, "--rate", "-1"], "--rate: must be > 0"),  # was a connection attempt first
        (["bench", *_NOBODY, "--rate", "2", "--temperature", "-1"], "--temperature: must be in [0, 2]"),
        (["bench", *_NOBODY, "--rate", "2", "--request-timeout", "0"], "--request-timeout: must be > 0"),
        (["bench", *_NOBODY, "--rate", "2", "--drain-timeout", "-1"], "--drain-timeout: must be >= 0"),
        (["bench", *_NOBODY, "--rate", "2", "--tokenizer", "/no/such"], "--tokenizer: /no/such: no such file"),
        (["bench", *_NOBODY, "--rate", "2", "--requests-file", "/no/such.jsonl"], "--requests-file: /no/such.jsonl"),
        (["calibrate", "--tiny", "--repeats", "-1"], "--repeats: must be >= 1"),  # was "no median" after timing
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], says: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_plan_grid_reads_booleans_as_booleans() -> None:
    from cadence.sim.cli import _parse_grid

    # "false" was passed on as a (truthy) string: the plan simulated prefix caching on.
    assert _parse_grid(["enable_prefix_caching=false,true", "max_num_seqs=8,16"]) == {
        "enable_prefix_caching": [False, True], "max_num_seqs": [8, 16]}
    with pytest.raises(ValueError, match="--grid max_num_seqs=0: max_num_seqs"):
        _parse_grid(["max_num_seqs=0,8"])


def test_sim_profile_that_is_not_an_object_is_a_clear_error(tmp_path, capsys) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("[]\n")  # was an AttributeError traceback
    assert main([*_SIM, "--rate", "5", "--profile", str(bad)]) == 2
    assert f"{bad}: malformed profile" in capsys.readouterr().err


def test_kv_cache_memory_fraction_resolves_to_bytes_and_is_logged(monkeypatch, caplog) -> None:
    """A share of the memory available after the weights load, as bytes of KV cache, said in the log."""
    import logging

    from cadence.engine import builder
    from cadence.engine.builder import build_engine

    monkeypatch.setattr(builder, "available_memory", lambda device: 8 << 30)
    with caplog.at_level(logging.INFO):
        engine = build_engine(EngineConfig.from_options(kv_cache_memory_fraction=0.001, dtype="float32"), tiny=True)
    per_block = engine.core.executor.kv_bytes_per_block(16)
    assert engine.core.num_blocks == int((8 << 30) * 0.001) // per_block
    assert "0.001 of the 8.00 GiB available on cpu" in caplog.text
    with pytest.raises(ValueError, match="kv_cache_memory_fraction: must be in"):
        EngineConfig.from_options(kv_cache_memory_fraction=1.5)
    assert builder.available_memory(torch.device("cpu")) > 0  # the real /proc/meminfo reading
