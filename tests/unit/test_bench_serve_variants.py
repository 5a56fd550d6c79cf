"""benchmarks/bench_serve.py's serve-flag variants: parsing, turn order, figures and the ratio table."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

bench_serve = load_benchmark("bench_serve")


def test_variants_parse_into_names_and_flags_with_an_empty_reference() -> None:
    got = bench_serve.parse_variants("bf16=;kv8=--kv-cache-dtype int8; both=--kv-cache-dtype int8 "
                                     "--activation-dtype int8")
    assert got == [("bf16", []), ("kv8", ["--kv-cache-dtype", "int8"]),
                   ("both", ["--kv-cache-dtype", "int8", "--activation-dtype", "int8"])]


@pytest.mark.parametrize("spec, words", [
    ("bf16=", "at least two"),
    ("bf16=;kv8", "'kv8' is not NAME=FLAGS"),
    ("bf16=;=--kv-cache-dtype int8", "is not NAME=FLAGS"),
    ("a=;a=--x", "'a' is named twice"),
])
def test_bad_variants_are_refused_naming_the_part(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match="--variants") as e:
        bench_serve.parse_variants(spec)
    assert words in str(e.value)


def test_each_variant_takes_each_place_in_turn() -> None:
    names = ["a", "b", "c"]
    firsts = [bench_serve.turned(names, k)[0] for k in range(3)]
    assert sorted(firsts) == names
    assert bench_serve.turned(names, 4) == ["b", "c", "a"]


def test_figures_read_from_a_summary() -> None:
    s = {"itl": {"p50": 0.1}, "prompt_tokens": 8192, "completed": 2, "ttft": {"p50": 2.0},
         "output_token_throughput": 123.0}
    assert bench_serve.CELLS["decode2k"].read(s, 32) == pytest.approx(320.0)
    assert bench_serve.CELLS["prefill4k"].read(s, 1) == pytest.approx(2048.0)
    assert bench_serve.CELLS["chat8"].read(s, 8) == 123.0
    # every variant of the long-context decode gets room for all 32 contexts at once
    assert bench_serve.CELLS["decode2k"].serve_extra == ("--kv-cache-memory", "2GiB")


def test_the_table_gives_per_round_values_and_ratios_to_the_first_variant() -> None:
    figures = {"chat1": {"bf16": [100.0, 80.0], "kv8": [110.0, 104.0]}}
    mm = {"chat1": {"bf16": [1.0, 0.5], "kv8": [0.98, 0.97]}}
    table = bench_serve.variant_table(["chat1"], ["bf16", "kv8"], figures, mm)
    kv8 = next(line for line in table.splitlines() if line.startswith("kv8"))
    assert "110.0 [0.98]" in kv8 and "104.0 [0.97]" in kv8
    assert "1.10 1.30" in kv8 and kv8.endswith("1.20x")
    bf16 = next(line for line in table.splitlines() if line.startswith("bf16"))
    assert "80.0 [0.50]" in bf16 and bf16.endswith("1.00x")
