"""--activation-dtype: bad values are refused naming the option, and int8 where it cannot apply is a
start-up error saying why (never a silent run on the bfloat16 path)."""

from __future__ import annotations

import random

import pytest

from cadence import LLM
from cadence.cli import build_parser, engine_config_from_args, main
from cadence.config import EngineConfig
from cadence.model.cpu_kernels import cpu_kernels, has_vnni


def test_flag_and_option_values():
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["serve"])).model.activation_dtype == "auto"
    assert engine_config_from_args(parse(["serve", "--activation-dtype", "int8"])).model.activation_dtype == "int8"
    assert EngineConfig.from_options(activation_dtype="int8").model.activation_dtype == "int8"


@pytest.mark.parametrize("value", ["int4", "INT8", "", "bfloat16; rm -rf /", "i" * 10_000])
def test_unknown_values_are_refused_by_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--activation-dtype", value])
    assert exc.value.code == 2
    assert "--activation-dtype: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["int4", 8, None, b"int8"])
def test_unknown_values_are_refused_by_the_config(value):
    with pytest.raises(ValueError, match="^activation_dtype:"):
        EngineConfig.from_options(activation_dtype=value)


def test_int8_on_a_model_without_quantized_layers_fails_start_up():
    """The tiny random model has bfloat16 weights only: nothing to run on int8 activations (on a CPU
    without the kernels or VNNI, that is the reason given instead)."""
    with pytest.raises(ValueError, match="^activation_dtype: int8 needs ") as exc:
        LLM(tiny=True, activation_dtype="int8", dtype="bfloat16", num_kv_blocks=16)
    if cpu_kernels() is not None and has_vnni():
        assert "needs a GGUF checkpoint with Q4_1, Q4_0 or Q8_0 matrices" in str(exc.value)


def test_int8_in_float32_fails_start_up():
    with pytest.raises(ValueError, match=r"^activation_dtype: int8 needs --dtype bfloat16 on the CPU \(this model is "
                                         r"float32 on cpu\)"):
        LLM(tiny=True, activation_dtype="int8", dtype="float32", num_kv_blocks=16)


def test_serve_refuses_before_listening(capsys):
    port = random.randrange(18000, 19000)
    code = main(["serve", "--tiny", "--dtype", "float32", "--activation-dtype", "int8", "--host", "127.0.0.1",
                 "--port", str(port), "--num-kv-blocks", "16"])
    assert code == 2
    assert "cadence: error: activation_dtype: int8 needs --dtype bfloat16" in capsys.readouterr().err
