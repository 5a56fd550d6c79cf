"""`cadence serve` takes vLLM's spellings of its options (--dtype half, --max-model-len 32k,
--gpu-memory-utilization) and refuses a model given twice differently; the help's wording."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.cli import build_parser, main, serve_configs
from cadence.config import EngineConfig


def _engine(*flags: str) -> EngineConfig:
    return serve_configs(build_parser().parse_args(["serve", *flags]))[0]


@pytest.mark.parametrize("spelling, dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_dtype_takes_vllms_names(spelling: str, dtype: str) -> None:
    assert _engine("--dtype", spelling).model.dtype == dtype
    assert EngineConfig.from_options(dtype=spelling).model.dtype == dtype


@pytest.mark.parametrize("text, value", [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1m", 1_000_000),
                                         ("25.6k", 25600), ("2M", 2 << 20), (" 8k ", 8000)])
def test_max_model_len_reads_human_readable_counts(text: str, value: int) -> None:
    from cadence.config import parse_human_int

    assert parse_human_int(text) == value
    assert _engine("--max-model-len", text).model.max_model_len == value


@pytest.mark.parametrize("text", ["1.5K", "32kb", "k", "1e4", "32 k", "0x10"])
def test_max_model_len_refuses_what_vllm_refuses(text: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", text])
    assert "--max-model-len" in capsys.readouterr().err


def test_gpu_memory_utilization_is_the_kv_cache_memory_fraction(capsys) -> None:
    assert _engine("--gpu-memory-utilization", "0.5").cache.kv_cache_memory_fraction == 0.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-memory-fraction KV_CACHE_MEMORY_FRACTION, --gpu-memory-utilization" in text
    assert "on CPU of the RAM" in text and "half: float16" in text and "32K (32768)" in text


def test_model_given_twice(tmp_path: Path, capsys) -> None:
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    assert main(["serve", str(one), "--model", str(two)]) == 2
    err = capsys.readouterr().err
    assert "given twice" in err and str(one) in err and str(two) in err
    link = tmp_path / "link.gguf"
    one.touch()
    link.symlink_to(one)
    for same in (str(one), str(link)):
        assert _engine(str(one), "--model", same).model.model == same


def test_help_wording(capsys) -> None:
    for argv in (["--help"], ["chat", "--help"], ["complete", "--help"], ["generate", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "interactive a " not in text and "Interactive a " not in text
        assert "SAMPLE_SEED" not in text and "(none: the file's name)" not in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    assert "--sampling-seed SEED" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "SmolLM2-135M-Instruct for the default model" in " ".join(capsys.readouterr().out.split())
