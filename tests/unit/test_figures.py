"""benchmarks/figures.py: the registry matches the docs' markers, its scripts run, its formatters
turn real outputs into the docs' tables, and --update-docs touches only what lies between markers.

The simulator's outputs are made here by running `cadence sim` on a few requests. The timed model
benchmarks (bench_q4, bench_runner, bench_kernels, profile_step, bench_scheduling) are not run:
their formatters get what each script's own JSON helper builds from sample figures."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}


fig = load_benchmark("figures")


def _block(name: str) -> str:
    """What lies between the entry's markers in its doc."""
    text = (ROOT / fig.BY_NAME[name].doc).read_text()
    start = text.index(fig.MARK_OPEN.format(name)) + len(fig.MARK_OPEN.format(name))
    return text[start:text.index(fig.MARK_CLOSE, start)].strip("\n")


def _head(table: str) -> list[str]:
    return table.splitlines()[:2]


def _first_column(table: str) -> list[str]:
    return [line.split("|")[1].strip() for line in table.splitlines()[2:]]


def _sim(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, "-m", "cadence.cli", "sim", *args, "--out", str(out)],
                   check=True, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL)
    return out


def _headings(text: str) -> list[tuple[int, str]]:
    """(line number, heading) of every Markdown heading outside code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            out.append((i, line.lstrip("#").strip()))
    return out


# -- the registry and the docs --------------------------------------------------------------------


def test_every_marker_has_an_entry_and_every_entry_its_markers() -> None:
    marked = {}
    for doc in fig.doc_files():
        for name in fig.marked_names((ROOT / doc).read_text()):
            assert name not in marked, f"{name} marked twice ({marked.get(name)}, {doc})"
            marked[name] = doc
    assert set(marked) <= set(fig.BY_NAME), f"markers without an entry: {set(marked) - set(fig.BY_NAME)}"
    for f in fig.FIGURES:
        text = (ROOT / f.doc).read_text()
        if not f.marked:  # a figure in prose: its section exists, and nothing is marked for it
            assert f.name not in marked and f.section in [h for _, h in _headings(text)], f.name
            continue
        assert marked.get(f.name) == f.doc, f"{f.name}: no markers in {f.doc}"
        lines = text.splitlines()
        start = lines.index(fig.MARK_OPEN.format(f.name))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("<!--"))
        assert lines[end] == fig.MARK_CLOSE, f"{f.name}: {lines[end]!r} before its closing marker"
        assert lines[start + 1].startswith(("|", "```")) and end > start + 2, f"{f.name}: no table between markers"
        heading = [h for i, h in _headings(text) if i < start][-1]
        assert heading == f.section, f"{f.name}: under {heading!r}, the registry says {f.section!r}"


def test_entries_say_how_long_and_what_they_need() -> None:
    for f in fig.FIGURES:
        assert f.commands and f.minutes > 0
        if f.needs:  # something the repository does not hold: skipped without it, with the reason
            assert (f.available() is None) == (fig.llama_server_binary() is not None)
        else:
            assert f.available() is None, f.name


def _scripts() -> list[list[str]]:
    """Each distinct program the registry's commands run: a benchmarks/ script, or a cadence command."""
    seen: dict[str, list[str]] = {}
    for f in fig.FIGURES:
        for cmd in f.commands:
            words = shlex.split(fig.shell_command(cmd))
            if words[0] == "bash":
                prog = words[:2]
            elif (words := words[words.index(sys.executable) + 1:])[0].startswith("benchmarks/"):
                prog = words[:1]
            else:  # -m cadence.cli and its subcommands (sim, sim plan)
                n = next(i for i, w in enumerate(words) if i >= 2 and w.startswith("-"))
                prog = words[:n]
            opts = [w for w in shlex.split(f.extra) if w.startswith("--")]
            seen.setdefault(" ".join(prog), []).extend(opts)
    return [[k, *sorted(set(v))] for k, v in sorted(seen.items())]


@pytest.mark.parametrize("script", _scripts(), ids=lambda s: s[0])
def test_scripts_exist_and_answer_help(script: list[str]) -> None:
    prog, *options = script
    words = prog.split()
    script_path = words[1] if words[0] == "bash" else words[0]
    if script_path.startswith("benchmarks/"):
        assert (ROOT / script_path).is_file()
    proc = subprocess.run([*([] if words[0] == "bash" else [sys.executable]), *words, "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    for opt in options:  # what `run` adds to the doc's command must be an option of the script
        assert opt in proc.stdout, f"{prog} --help does not list {opt}"


def test_list_names_every_entry_and_the_reason_to_skip(capsys) -> None:
    assert fig.main(["list"]) == 0
    out = capsys.readouterr().out
    for f in fig.FIGURES:
        assert f.name in out and all(c in out for c in f.commands)
    if fig.llama_server_binary() is None:
        assert "skipped here: no llama-server on PATH" in out
    with pytest.raises(SystemExit):
        fig.main(["run", "no-such-figure"])


# -- formatters, on real outputs ------------------------------------------------------------------


def test_simulator_entries_run_and_make_the_docs_tables(tmp_path: Path) -> None:
    """figure() runs each entry's commands (cheaper ones, same shape) and writes the result file."""
    small = {
        "sim-mooncake": tuple(f"cadence sim --workload shared-prefix --num-requests 24 --rate 8 --replicas 2 "
                              f"--router {r}" for r in ("prefix-affinity", "round-robin")),
        "sim-scale": ("cadence sim --workload chat --num-requests 20 --rate 5 --replicas 2",
                      "cadence sim --workload chat --num-requests 20 --rate 5 --repeat 2 --replicas 2"),
        "sim-plan-infeasible": ("cadence sim plan --trace traces/azure_llm_2023_code.csv --num-requests 40 "
                                "--rate-scale 10 --slo ttft_p95=0.01",),
        "sim-plan-azure": ("cadence sim plan --workload chat --num-requests 40 --rate 2 --slo ttft_p95=5 "
                           "--max-replicas 4",),
    }
    for name, commands in small.items():
        f = dataclasses.replace(fig.BY_NAME[name], commands=commands)
        assert fig.figure(f, rerun=True, update=False, results=tmp_path)
        result = (tmp_path / f"{name}.md").read_text()
        table = f.format(tmp_path / "raw" / name)
        assert table in result
        doc = _block(name)
        assert all(c in result for c in commands)
        assert re.search(r"^- machine: \S+, .+, \d+ CPUs$", result, re.M)
        assert re.search(r"^- load average \(1, 5, 15 min\): [\d. ]+ before, [\d. ]+ after$", result, re.M)
        ran = json.loads((tmp_path / "raw" / name / "run0.json").read_text())
        assert f"- date: {ran['date']}\n" in result and ran["status"] in f.ok_status
        if doc.startswith("```"):
            first = doc.splitlines()[1].split()[0]  # "planning" or "$"
            assert table.startswith("```\n" + first) and table.endswith("\n```")
        else:
            assert _head(table) == _head(doc)
    scale = (tmp_path / "sim-scale.md").read_text()
    assert re.search(r"^\| x1 \| 20 \| 2 \| [\d.]+ s \|$", scale, re.M)
    assert re.search(r"^\| x5 \| 40 \| 2 \| [\d.]+ s \|$", scale, re.M)
    routers = (tmp_path / "sim-mooncake.md").read_text()
    assert "| `prefix-affinity` | 24 / 24 |" in routers and "| `round-robin` | 24 / 24 |" in routers


def _pair(tmp: Path, labels: tuple[str, str], flags: tuple[list[str], list[str]], common: list[str]) -> Path:
    for label, extra in zip(labels, flags, strict=True):
        _sim(tmp / label, *common, *extra, "--label", label, "--seed", "1")
    return tmp


def test_knob_tables_from_summaries(tmp_path: Path) -> None:
    """knobs.py's runs are `cadence bench` summaries; `cadence sim` writes the same report."""
    chat = ["--workload", "chat", "--rate", "4", "--num-requests", "20"]
    seqs = _pair(tmp_path / "seqs", ("seqs16", "seqs64"), (["--max-num-seqs", "16"], ["--max-num-seqs", "64"]), chat)
    prefix = _pair(tmp_path / "prefix", ("no-cache", "cache"), (["--no-enable-prefix-caching"], []),
                   ["--workload", "shared-prefix", "--rate", "1", "--num-requests", "12", "--slo", "ttft=1"])
    chunked = _pair(tmp_path / "chunked", ("unchunked", "chunked"),
                    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4608"], []),
                    ["--workload", "long-prompt-mix", "--rate", "0.4", "--num-requests", "10", "--slo", "itl=0.5"])
    policy = _pair(tmp_path / "policy", ("fcfs", "fair"), (["--policy", "fcfs"], ["--policy", "fair"]),
                   ["--workload", "mixed-tenants", "--rate", "3", "--num-requests", "30", "--slo", "ttft=2"])
    for name, out, fmt in (("knobs-seqs", seqs, fig.fmt_knobs_seqs), ("knobs-prefix", prefix, fig.fmt_knobs_prefix),
                           ("knobs-chunked", chunked, fig.fmt_knobs_chunked)):
        table = fmt(out)
        assert _head(table) == _head(_block(name)), name
        assert _first_column(table) == _first_column(_block(name)), name
    table = fig.fmt_knobs_policy(policy)
    assert _head(table) == _head(_block("knobs-policy"))
    tenants = json.loads((policy / "fcfs" / "summary.json").read_text())["per_tenant"]
    assert _first_column(table)[0].startswith("`batch` (") and len(_first_column(table)) == len(tenants) + 2
    assert _first_column(table)[-2:] == _first_column(_block("knobs-policy"))[-2:]


def test_static_sweep_table(tmp_path: Path) -> None:
    """Two sweeps as `cadence bench sweep` writes them (sweep.json: a summary per offered rate)."""
    for label, mode in (("static", "static"), ("continuous", "continuous")):
        points = []
        for rate in (0.5, 2):
            run = _sim(tmp_path / label / f"rate_{rate:g}", "--workload", "chat", "--rate", str(rate),
                       "--num-requests", "12", "--scheduler", mode, "--seed", "1")
            points.append({"load": rate, "summary": json.loads((run / "summary.json").read_text())})
        (tmp_path / label / "sweep.json").write_text(json.dumps({"kind": "rate", "points": points}))
    table = fig.fmt_knobs_static(tmp_path)
    assert _head(table) == _head(_block("knobs-static"))
    assert _first_column(table) == ["0.5", "2"]


def test_fidelity_tables(tmp_path: Path) -> None:
    """sim_fidelity.py's --out: saturation/, then real_RATE/ and sim_RATE/ per load (both made here
    by the simulator: the formatter reads summaries, whoever wrote them)."""
    for seed in ("0", "1"):
        group = tmp_path / f"chat_seed{seed}"
        common = ["--workload", "chat", "--num-requests", "20", "--seed", seed]
        _sim(group / "saturation", *common, "--rate", "1000")
        for rate in ("0.500", "1.000"):
            _sim(group / f"real_{rate}", *common, "--rate", rate)
            _sim(group / f"sim_{rate}", *common, "--rate", rate, "--max-num-seqs", "16")
    long, short = fig.fmt_sim_fidelity(tmp_path), fig.fmt_sim_fidelity_ratios(tmp_path)
    assert _head(long) == _head(_block("sim-fidelity")) and len(long.splitlines()) == 2 + 2 * 6
    assert _head(short) == _head(_block("sim-fidelity-ratios")) and len(short.splitlines()) == 2 + 2
    total = fig.fmt_sim_fidelity_summary(tmp_path)
    # 2 groups x 2 loads x 6 gated cells; a row per percentile of TTFT, ITL and E2E (p99 not gated).
    assert total.splitlines()[0].split(" p50/p90")[0].endswith(" of 24")
    assert len(total.splitlines()) == 3 + 9 and "| ttft p99 (not gated) |" in total


def test_served_table_from_bench_serve_results(tmp_path: Path) -> None:
    """bench_serve.py's results.json holds each server's summary "overall" per concurrency."""
    runs = {name: json.loads((_sim(tmp_path / name, "--workload", "chat", "--concurrency", "4", "--num-requests",
                                   "12", *flags) / "summary.json").read_text())["overall"]
            for name, flags in (("cadence", []), ("llama.cpp", ["--max-num-seqs", "2"]))}
    (tmp_path / "results.json").write_text(json.dumps({"8": runs, "1": runs}))
    table = fig.fmt_serve(tmp_path)
    assert _head(table) == _head(_block("serve-llamacpp")) == _head(_block("serve-llamacpp-top-p"))
    assert _first_column(table) == ["1", "8"]


def test_predicted_ttft_table_from_the_scripts_own_summary(tmp_path: Path) -> None:
    """bench_predicted_ttft.py's summarize() over rows as its run makes them, one rate per entry."""
    bench = load_benchmark("bench_predicted_ttft")
    rows = [{"predicted": 0.2, "real": 0.1, "state_at_admission": "waiting"},
            {"predicted": 0.3, "real": 0.3, "state_at_admission": "decoding"},
            {"predicted": None, "real": 0.5}]
    s = bench.summarize(rows)
    assert (s["requests"], s["predicted"], s["no_prediction"], s["queued_at_admission"]) == (3, 2, 1, 1)
    assert s["ratio_median"] in (1.0, 2.0) and s["abs_error_p90_s"] == pytest.approx(0.1)
    (tmp_path / "summary.json").write_text(json.dumps({"rates": {"2": s, "8": s}}))
    table = fig.fmt_predicted_ttft(tmp_path)
    assert _head(table) == _head(_block("predicted-ttft"))
    assert _first_column(table) == ["2", "8"]
    assert "2/3" in table.splitlines()[2]


# -- formatters of the timed model benchmarks: each script's own JSON helpers ---------------------


def _write(out: Path, *docs: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (out / f"cmd{i}.json").write_text(json.dumps(doc))
    return out


def test_model_benchmark_tables(tmp_path: Path) -> None:
    q4 = load_benchmark("bench_q4").result_json({"1": {"bf16": 100.0, "q4_1": 176.0}, "8": {"bf16": 500.0, "q4_1": 540.0},
                                         "32": {"bf16": 900.0, "q4_1": 900.0}}, {"bf16": 1000.0, "q4_1": 880.0})
    table = fig.fmt_q4(_write(tmp_path / "q4", q4))
    assert _head(table) == _head(_block("q4-vs-bf16")) and _first_column(table) == _first_column(_block("q4-vs-bf16"))
    assert "| decode, 1 stream | 1.76x |" in table and "| prefill, 4 x 128 tokens | 0.88x |" in table

    runner = load_benchmark("bench_runner")
    rows = [runner.row_json(d, w, 2.0 * k, 1.0 * k, 400.0) for d in ("bfloat16", "float32")
            for k, w in enumerate(("decode x1", "decode x32", "prefill 512"), 1)]
    table = fig.fmt_runner(_write(tmp_path / "runner", {"load_average": 0.1, "rows": rows}))
    doc = _block("runner-vs-transformers")
    assert _head(table) == _head(doc) and _first_column(table) == _first_column(doc)

    kernels = load_benchmark("bench_kernels")
    runs = [kernels.result_json("6e4b3e4", "q4_1", {"prefill 1 x 512": {"this tree": [2.0, 3.0], "6e4b3e4": [2.0, 2.0]},
                                                    f"decode x1 (context {c})": {"this tree": [1.0], "6e4b3e4": [1.1]}})
            for c in (256, 1024)]
    table = fig.fmt_kernels(_write(tmp_path / "kernels", *runs))
    assert _head(table) == _head(_block("kernels-exact"))
    assert "| prefill 1 x 512 | 1.250 / 1.250 | 1.000 .. 1.500 | 2 |" in table
    assert "| decode x1, 1,024-token context | 0.909 |" in table

    step = load_benchmark("profile_step")
    runs = []
    for c in (64, 512, 1024):
        r = step.result_json(c, "q4_1", "bfloat16", 2)
        r["streams"] = {str(b): {"tok_s": b * 100.0, "step_ms": 10.0 + c / 100, "breakdown_ms": {}} for b in (8, 32)}
        runs.append(r)
    table = fig.fmt_decode_context(_write(tmp_path / "step", *runs))
    doc = _block("decode-step-context")
    assert _head(table) == _head(doc) and _first_column(table) == _first_column(doc)

    sched = load_benchmark("bench_scheduling")
    b = sched.batching_json(16, 384, {"continuous": 451.5, "static": 286.9}, {"continuous": 1.0, "static": 2.0},
                            {"continuous": 46.4, "static": 76.6}, [1.48, 1.69])
    table = fig.fmt_batching(_write(tmp_path / "batching", {"omp_env": {"GOMP_SPINCOUNT": "1000"}, "batching": b},
                                    {"omp_env": {"OMP_WAIT_POLICY": "PASSIVE"}, "batching": b}))
    doc = _block("batching-offline")
    assert _head(table) == _head(doc) and _first_column(table) == _first_column(doc)
    assert table.splitlines()[2] == doc.splitlines()[2]  # the doc's first row, from the same figures


# -- --update-docs ----------------------------------------------------------------------------------


def test_quality_table(tmp_path: Path) -> None:
    figures = {"f32": (11.18805, 1.0), "bf16": (11.18564, 0.984514), "kv8": (11.19426, 0.978456),
               "act8": (11.20111, 0.975965), "act8+kv8": (11.21058, 0.972008), "act8-1": (11.20674, 0.963605)}
    results = {k: {"perplexity": p, "agreement": a, "positions": 20470, "seconds": 1.0} for k, (p, a) in figures.items()}
    table = fig.fmt_quality(_write(tmp_path / "quality", {"meta": {}, "results": results}))
    assert table == _block("quality")


def test_int8_tables(tmp_path: Path) -> None:
    bench = load_benchmark("bench_int8")
    times = {name: {str(m): {"bfloat16": [2.0, 3.0, 2.0], "int8": [1.0, 1.0, 1.0]} for m in (1, 8, 32, 512)}
             for name in bench.SHAPES}
    table = fig.fmt_int8_kernels(_write(tmp_path / "kernels", {"threads": 2, "labels": bench.LABELS, "times_s": times}))
    doc = _block("int8-kernels")
    assert _head(table) == _head(doc) and _first_column(table) == _first_column(doc)
    assert table.splitlines()[2] == "| qkv 960 x 576, Q4_1 | 2.00x | 2.00x | 2.00x | 2.00x |"


def test_update_docs_replaces_only_between_the_markers(tmp_path: Path) -> None:
    f = fig.BY_NAME["q4-vs-bf16"]
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / f.doc, tmp_path / f.doc)
    before = (tmp_path / f.doc).read_text()
    new = "| workload | Q4_1 blocks / bfloat16 weights |\n| --- | ---: |\n| decode, 1 stream | 9.99x |"
    fig.update_doc(f, new, root=tmp_path)
    after = (tmp_path / f.doc).read_text()
    open_, close = fig.MARK_OPEN.format(f.name), fig.MARK_CLOSE
    i, j = before.index(open_), before.index(close, before.index(open_))
    assert after == before[:i + len(open_)] + "\n" + new + "\n" + before[j:]
    assert after != before and before[:i] == after[:i]
    fig.update_doc(f, new + "\n", root=tmp_path)  # idempotent: a trailing newline makes no blank line
    assert (tmp_path / f.doc).read_text() == after
    for other in fig.marked_names(before):  # every other table is as it was
        if other != f.name:
            k = before.index(fig.MARK_OPEN.format(other))
            assert before[k:before.index(close, k)] in after


def test_replace_table_refuses_broken_markers() -> None:
    with pytest.raises(ValueError, match="no <!-- figure: a -->"):
        fig.replace_table("text", "a", "| x |")
    with pytest.raises(ValueError, match="has no <!-- /figure -->"):
        fig.replace_table("<!-- figure: a -->\n| x |\n<!-- figure: b -->\n| y |\n<!-- /figure -->\n", "a", "| z |")


def test_shell_command_runs_this_checkout() -> None:
    cmd = fig.shell_command("OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_q4.py --streams '1,8'",
                            python="/py")
    assert shlex.split(cmd) == ["OMP_WAIT_POLICY=PASSIVE", "/py", "benchmarks/bench_q4.py", "--streams", "1,8"]
    assert shlex.split(fig.shell_command("cadence sim plan --slo ttft_p95=1", python="/py")) == [
        "/py", "-m", "cadence.cli", "sim", "plan", "--slo", "ttft_p95=1"]


def test_result_file_marks_timed_figures_from_a_busy_machine() -> None:
    busy, quiet = ("999.00 1.00 1.00", "0.00 0.00 0.00"), ("0.00 0.00 0.00", "0.00 0.00 0.00")
    warning = "- warning: timed on a busy machine"
    assert warning in fig.result_text(fig.BY_NAME["sim-scale"], "| x |", busy, "today")
    assert warning not in fig.result_text(fig.BY_NAME["sim-scale"], "| x |", quiet, "today")
    assert warning not in fig.result_text(fig.BY_NAME["sim-mooncake"], "| x |", busy, "today")  # not timed
    assert warning not in fig.result_text(fig.BY_NAME["sim-scale"], "| x |", ("unknown", "unknown"), "today")


def test_format_without_a_recorded_run_says_so(tmp_path: Path) -> None:
    when, loads = fig.run_record(tmp_path / "nothing-here")
    assert "not recorded" in when and loads == ("unknown", "unknown")


def test_run_keeps_what_a_script_writes_beside_its_own_records(tmp_path: Path) -> None:
    """An entry's `extra` names cmdI.json for the script's JSON; run's own records must not take its place."""
    writer = f"{fig.PY} -c \"import json, sys; json.dump(dict(tok_s=42), open(sys.argv[2], 'w'))\""
    f = dataclasses.replace(fig.BY_NAME["q4-vs-bf16"], name="writes-json", commands=(writer, writer),
                            format=lambda out: " ".join(str(json.loads(p.read_text())["tok_s"])
                                                        for p in fig._outputs(out, ".json")))
    assert fig.figure(f, rerun=True, update=False, results=tmp_path)
    assert "\n42 42\n" in (tmp_path / "writes-json.md").read_text()
    assert [json.loads(p.read_text())["status"] for p in fig._outputs(tmp_path / "raw" / "writes-json", ".json",
                                                                       prefix="run")] == [0, 0]
