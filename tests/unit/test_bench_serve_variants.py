"""benchmarks/bench_serve.py's serve-flag variants: parsing, turn order, figures and the ratio table."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_figures_read_from_a_summary_and_the_step_log(tmp_path: Path) -> None:
    s = {"itl": {"p50": 9.0}, "prompt_tokens": 8192, "completed": 2, "ttft": {"p50": 2.0},
         "output_token_throughput": 123.0}
    steps = [{"prefill_tokens": 4096, "decode_seqs": 5, "duration": 3.0},  # decodes beside a prompt chunk
             {"prefill_tokens": 0, "decode_seqs": 32, "duration": 0.1},
             {"prefill_tokens": 0, "decode_seqs": 32, "duration": 0.3},
             {"prefill_tokens": 0, "decode_seqs": 32, "duration": 0.2},
             {"prefill_tokens": 0, "decode_seqs": 31, "duration": 0.05}]  # a stream has finished
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    assert bench_serve.CELLS["decode2k"].read(s, 32, tmp_path) == pytest.approx(160.0)  # 32 / median 0.2 s
    assert bench_serve.CELLS["prefill4k"].read(s, 1, tmp_path) == pytest.approx(2048.0)
    assert bench_serve.CELLS["chat8"].read(s, 8, tmp_path) == 123.0
    # every variant of the long-context decode gets room for all 32 contexts at once
    assert bench_serve.CELLS["decode2k"].serve_extra[:2] == ("--kv-cache-memory", "2GiB")


def test_a_decode_cell_without_an_all_stream_step_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "steps.jsonl").write_text(json.dumps({"prefill_tokens": 512, "decode_seqs": 3, "duration": 1}) + "\n")
    with pytest.raises(RuntimeError, match="no step decoded all 32 streams"):
        bench_serve.CELLS["decode2k"].read({}, 32, tmp_path)


def test_the_table_gives_per_round_values_and_ratios_to_the_first_variant() -> None:
    figures = {"chat1": {"bf16": [100.0, 80.0], "kv8": [110.0, 104.0]}}
    mm = {"chat1": {"bf16": [1.0, 0.5], "kv8": [0.98, 0.97]}}
    table = bench_serve.variant_table(["chat1"], ["bf16", "kv8"], figures, mm)
    kv8 = next(line for line in table.splitlines() if line.startswith("kv8"))
    assert "110.0 [0.98]" in kv8 and "104.0 [0.97]" in kv8
    assert "1.10 1.30" in kv8 and kv8.endswith("1.20x")
    bf16 = next(line for line in table.splitlines() if line.startswith("bf16"))
    assert "80.0 [0.50]" in bf16 and bf16.endswith("1.00x")


def _warm_args(tmp_path: Path, **kw: object) -> object:
    import argparse

    base = dict(variants="off=;draft=--x 1", cells="chat32", rounds=2, warm=True, port=9100, serve_args="",
                bench_args="", num_requests=0, seed=1)
    return argparse.Namespace(**{**base, **kw})


def test_warm_keeps_one_server_per_variant_up_and_alternates_the_runs(tmp_path: Path, monkeypatch) -> None:
    from contextlib import contextmanager

    events: list[tuple] = []

    @contextmanager
    def serving(server, port, logs, serve_extra=()):
        events.append(("up", server.name, port))
        yield
        events.append(("down", server.name, port))

    def bench_once(port, conc, workload, d, label, args, seed=None):
        events.append(("run", port, label, seed))
        return {"output_token_throughput": float(port)}

    monkeypatch.setattr(bench_serve, "serving", serving)
    monkeypatch.setattr(bench_serve, "bench_once", bench_once)
    monkeypatch.setattr(bench_serve, "matmul_probe", lambda: lambda: 100.0)
    bench_serve.run_variants(_warm_args(tmp_path), tmp_path)
    ups = [e for e in events if e[0] == "up"]
    assert ups == [("up", "off", 9100), ("up", "draft", 9101)]  # each started once, on its own port
    runs = [(e[2], e[3]) for e in events if e[0] == "run" and "warm-up" not in e[2]]
    # alternating, each round its own seed (no prefix-cache hits on an earlier round's prompts)
    assert runs == [("off chat32 round 1", 1), ("draft chat32 round 1", 1), ("draft chat32 round 2", 2),
                    ("off chat32 round 2", 2)]
    assert [e[0] for e in events[-2:]] == ["down", "down"]  # stopped after the last run
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["figures"]["chat32"] == {"off": [9100.0, 9100.0], "draft": [9101.0, 9101.0]}


def test_warm_stops_its_servers_when_a_run_fails(tmp_path: Path, monkeypatch) -> None:
    from contextlib import contextmanager

    downs: list[str] = []

    @contextmanager
    def serving(server, port, logs, serve_extra=()):
        try:
            yield
        finally:
            downs.append(server.name)

    def bench_once(port, conc, workload, d, label, args, seed=None):
        if "round" in label:
            raise RuntimeError("bench failed")
        return {"output_token_throughput": 1.0}

    monkeypatch.setattr(bench_serve, "serving", serving)
    monkeypatch.setattr(bench_serve, "bench_once", bench_once)
    monkeypatch.setattr(bench_serve, "matmul_probe", lambda: lambda: 100.0)
    with pytest.raises(RuntimeError, match="bench failed"):
        bench_serve.run_variants(_warm_args(tmp_path), tmp_path)
    assert sorted(downs) == ["draft", "off"]


def test_warm_refuses_cells_that_need_servers_of_their_own_flags(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="decode2k"):
        bench_serve.run_variants(_warm_args(tmp_path, cells="chat32,decode2k"), tmp_path)
