"""The docs' figure tables: what produces each one, and a way to regenerate them.

    .venv/bin/python benchmarks/figures.py list
    .venv/bin/python benchmarks/figures.py run NAME [NAME ...] [--update-docs]
    .venv/bin/python benchmarks/figures.py run --quick | --all [--update-docs]
    .venv/bin/python benchmarks/figures.py format NAME [NAME ...] [--update-docs]   # from the last run's outputs

Each figure table in the docs sits between `<!-- figure: NAME -->` and `<!-- /figure -->`. `run`
runs the entry's commands (the ones the doc shows; the few options that make a script write what
the table is read from are added: `--json FILE` or `--out DIR`), turns their outputs into the
doc's table and writes results/figures/NAME.md: the table, the commands, the date, `uname -m`, the
CPU model and the load average before and after. `--update-docs` then replaces the table between
the entry's markers. Entries that need something the repository does not hold (llama.cpp's
server) are skipped with the reason. Timed entries want a quiet machine: each one says so, and a
run on a busy machine is marked in its result file. A few entries are figures the docs state in
prose; `run` writes their outputs to results/figures and `--update-docs` leaves their docs alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cadence.host_load import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "figures"
MARK_OPEN = "<!-- figure: {} -->"
MARK_CLOSE = "<!-- /figure -->"
MARK_RE = re.compile(r"^<!-- figure: ([A-Za-z0-9_.-]+) -->$", re.M)  # a marker is a line of its own


def doc_files() -> list[str]:
    """The documents markers may sit in: README.md and docs/*.md, from the repository root."""
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


# -- the registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    name: str
    doc: str  # path from the repository root
    section: str  # the heading the table sits under
    commands: tuple[str, ...]  # as the doc shows them, run from the repository root
    minutes: float  # roughly, on the 2-core machine of the docs
    quiet: bool  # timed: the figures mean something only on a quiet machine
    format: Callable[[Path], str]  # the outputs' directory -> the table between the markers
    # What each command gets added so that it writes what `format` reads, with {out} the outputs'
    # directory and {i} the command's index.
    extra: str = ""
    needs: str = ""  # something outside the repository; without it the entry is skipped
    available: Callable[[], str | None] = lambda: None  # None, or why the entry cannot run here
    ok_status: tuple[int, ...] = (0,)
    labels: tuple[str, ...] = ()  # a row label per command, for tables with a row per command
    reads: str = ""  # where the commands write what `format` reads (from the root); default: `run`'s own folder
    outputs_of: str = ""  # another entry whose run this table is read from (its commands are that run's)
    # False for figures the doc states in prose: the result file has them, --update-docs leaves the doc be.
    marked: bool = True


LLAMA_PLACEHOLDER = "/path/to/llama-server"


def llama_server_binary() -> str | None:
    """llama.cpp's server: $LLAMA_SERVER, else a llama-server on PATH."""
    return os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")


def _llama_server() -> str | None:
    return None if llama_server_binary() else "no llama-server on PATH and no $LLAMA_SERVER"


def _git_rev(rev: str) -> Callable[[], str | None]:
    def check() -> str | None:
        found = subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True)
        return None if found.returncode == 0 else f"git revision {rev} is not in this clone"
    return check


# -- reading the outputs ----------------------------------------------------------------------------


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _outputs(out: Path, suffix: str, prefix: str = "cmd") -> list[Path]:
    """Per-command files in command order: the scripts' (cmd0.json, ...: the `extra` options name
    them so), the commands' stdout (cmd0.out, ...) and `run`'s records of them (run0.json, ...)."""
    found = [p for p in out.glob(f"{prefix}*{suffix}") if re.fullmatch(rf"{prefix}\d+", p.name[:-len(suffix)])]
    return sorted(found, key=lambda p: int(p.name[len(prefix):-len(suffix)]))


def _table(head: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[str]], compact: bool = False) -> str:
    """A Markdown table; `compact` writes the delimiter row as |---|---| (as some of the docs' tables do)."""
    rule = "|" + "|".join(align) + "|" if compact else "| " + " | ".join(align) + " |"
    lines = ["| " + " | ".join(head) + " |", rule]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _secs(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2f} s" if v < 2 else f"{v:.1f} s" if v < 100 else f"{v:,.0f} s"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f} ms"


def _auto(v: float | None) -> str:
    """Latencies that span milliseconds to seconds (ITL with stalls)."""
    return "n/a" if v is None else _ms(v) if v < 1 else _secs(v)


def _ratio(b: float | None, a: float | None) -> str:
    if not a or b is None:
        return "n/a"
    r = b / a
    return f"{r:.2g}" if r < 0.1 else f"{r:.2f}"


# -- formatters: performance.md ---------------------------------------------------------------------


def _serve_cell(s: dict) -> str:
    return f"{s['output_token_throughput']:.1f}, {_secs(s['ttft']['p95'])}, {s['itl']['p50'] * 1e3:.1f} ms"


def fmt_serve(out: Path) -> str:
    """bench_serve.py's results.json ({concurrency: {server: bench summary's overall}}): cadence
    against the other server, a row per concurrency."""
    runs: dict[int, dict[str, dict]] = {}
    for p in sorted(out.rglob("results.json")):
        for conc, by_server in _json(p).items():
            runs.setdefault(int(conc), {}).update(by_server)
    other = next(n for by in runs.values() for n in by if n != "cadence")
    rows = [(str(c), _serve_cell(by["cadence"]), _serve_cell(by[other]),
             f"{by['cadence']['output_token_throughput'] / by[other]['output_token_throughput']:.2f}x")
            for c, by in sorted(runs.items())]
    head = ("streams", "cadence: output tok/s, p95 TTFT, p50 ITL", f"{other}: output tok/s, p95 TTFT, p50 ITL",
            f"cadence / {other}")
    return _table(head, ("---:", "---", "---", "---:"), rows)


def fmt_decode_context(out: Path) -> str:
    """profile_step.py --json, one run per context: the step time by rows and context."""
    runs = [_json(p) for p in _outputs(out, ".json")]
    sizes = sorted({int(b) for r in runs for b in r["streams"]})
    head = ["decode rows"] + [f"{r['context']:,}-token contexts" if i == 0 else f"{r['context']:,}"
                              for i, r in enumerate(runs)]
    rows = [[str(b)] + [f"{r['streams'][str(b)]['step_ms']:.3g} ms" if str(b) in r["streams"] else "n/a"
                        for r in runs] for b in sizes]
    return _table(head, ["---:"] * len(head), rows)


def fmt_q4(out: Path) -> str:
    """bench_q4.py --json: Q4_1 against bfloat16 layers, decode by streams and a prefill."""
    r = _json(_outputs(out, ".json")[0])
    rows = [(f"decode, {b} stream{'s' if int(b) > 1 else ''}", f"{v['q4_1'] / v['bf16']:.2f}x")
            for b, v in sorted(r["decode"].items(), key=lambda kv: int(kv[0]))]
    p = r["prefill"]
    rows.append((f"prefill, {p['prompts']} x {p['tokens']} tokens", f"{p['q4_1'] / p['bf16']:.2f}x"))
    return _table(("workload", "Q4_1 blocks / bfloat16 weights"), ("---", "---:"), rows)


QUALITY_LABELS = {"f32": "float32 (reference)", "bf16": "bfloat16 (default)", "kv8": "8-bit KV cache",
                  "act8": "int8 activations (gate-up and output in two terms)",
                  "act8+kv8": "int8 activations and 8-bit KV cache",
                  "act8-1": "int8 activations, every layer in one term"}


def fmt_quality(out: Path) -> str:
    """quality.py --json: per configuration, perplexity and top-1 agreement with float32, each against bfloat16's."""
    results = _json(_outputs(out, ".json")[0])["results"]
    base = results["bf16"]
    rows = []
    for name, r in results.items():
        label = f"`{name}`: {QUALITY_LABELS.get(name, name)}"
        if name == "bf16":
            vs, points = "0", "0"
        else:
            vs = f"{r['perplexity'] / base['perplexity'] - 1:+.2%}"
            points = f"{100 * (r['agreement'] - base['agreement']):+.2f}"
        agree = "100%" if r["agreement"] == 1 else f"{r['agreement']:.2%}"
        rows.append((label, f"{r['perplexity']:.4f}", vs, agree, points))
    return _table(("configuration", "perplexity", "vs bfloat16", "top-1 agreement with float32", "vs bfloat16 (points)"),
                  ("---", "---:", "---:", "---:", "---:"), rows)


def fmt_int8_kernels(out: Path) -> str:
    """bench_int8.py --json: per layer and row count, the median of the rounds' bfloat16 / int8 time ratios."""
    r = _json(_outputs(out, ".json")[0])
    counts = sorted({int(m) for by_rows in r["times_s"].values() for m in by_rows})
    rows = []
    for name, by_rows in r["times_s"].items():
        cells = []
        for m in counts:
            t = by_rows.get(str(m))
            ratios = [] if t is None else [a / b for a, b in zip(t["bfloat16"], t["int8"], strict=True)]
            cells.append(f"{statistics.median(ratios):.2f}x" if ratios else "n/a")
        rows.append((r["labels"][name], *cells))
    head = ("layer", *(f"{m} row{'s' if m > 1 else ''}" for m in counts))
    return _table(head, ("---", *("---:",) * len(counts)), rows)


def _kernel_workload(name: str) -> str:
    m = re.fullmatch(r"decode x(\d+) \(context (\d+)\)", name)
    return f"decode x{m[1]}, {int(m[2]):,}-token context" if m else name


def fmt_kernels(out: Path) -> str:
    """bench_kernels.py --json, one or more runs: per workload the ratio of medians in each run that
    measured it, the spread of the per-round ratios over all of them, and this tree's tokens/s."""
    merged: dict[str, list[tuple[list[float], list[float]]]] = {}
    for p in _outputs(out, ".json"):
        for name, sides in _json(p)["workloads"].items():
            merged.setdefault(_kernel_workload(name), []).append((sides["this tree"], sides["baseline"]))
    rows = []
    for name, runs in merged.items():
        ratios = " / ".join(f"{statistics.median(a) / statistics.median(b):.3f}" for a, b in runs)
        each = [x / y for a, b in runs for x, y in zip(a, b, strict=True)]
        rows.append((name, ratios, f"{min(each):.3f} .. {max(each):.3f}", f"{statistics.median(runs[0][0]):,.0f}"))
    return _table(("workload", "ratio (exact / before)", "per-round spread", "tokens/s, exact"),
                  ("---",) * 4, rows)


def fmt_runner(out: Path) -> str:
    """bench_runner.py --json: cadence's ModelRunner against transformers, a row per dtype and workload."""
    rows = [(r["dtype"], r["workload"], f"{r['cadence']:.1f}", f"{r['transformers']:.1f}",
             f"{r['cadence'] / r['transformers']:.2f}x") for r in _json(_outputs(out, ".json")[0])["rows"]]
    return _table(("dtype", "workload", "cadence tok/s", "transformers tok/s", "ratio"),
                  ("---", "---", "---:", "---:", "---:"), rows)


# -- formatters: benchmarking.md --------------------------------------------------------------------


def fmt_batching(out: Path) -> str:
    """bench_scheduling.py --only batching --json, once per OpenMP wait setting."""
    rows = []
    for i, p in enumerate(_outputs(out, ".json")):
        r = _json(p)
        env, b = r["omp_env"], r["batching"]
        wait = (f"`OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}`" if "OMP_WAIT_POLICY" in env
                else f"cadence's default (`GOMP_SPINCOUNT={env.get('GOMP_SPINCOUNT', '-')}`)")
        ratio = f"{b['tok_s']['continuous'] / b['tok_s']['static']:.2f}x"
        rows.append((wait, f"{b['tok_s']['continuous']:.1f} / {b['tok_s']['static']:.1f}: "
                           + (f"**{ratio}**" if i == 0 else ratio),
                     ", ".join(f"{x:.2f}" for x in b["round_ratios"]),
                     f"{b['e2e_p95_s']['continuous']:.1f} / {b['e2e_p95_s']['static']:.1f} s"))
    return _table(("OpenMP wait", "continuous / static tok/s", "rounds", "e2e p95 cont / static"), ("---",) * 4, rows)


def _summaries(out: Path) -> list[tuple[str, dict, Path]]:
    """The two runs of a knobs.py experiment, in the order it ran them: (label, summary.json, folder);
    the doc spells a label's dashes as spaces ("no-cache": "no cache")."""
    found = [(_json(p), p.parent) for p in out.glob("*/summary.json")]
    if len(found) != 2:
        raise ValueError(f"{out}: expected the two runs' */summary.json, found {len(found)}")
    found.sort(key=lambda sd: sd[0].get("started_at") or 0.0)
    return [((s["meta"].get("label") or d.name).replace("-", " "), s, d) for s, d in found]


def fmt_knobs_static(out: Path) -> str:
    """knobs.py --only static: two sweeps (static, then continuous), a row per offered rate."""
    sweeps = {d.name: _json(d / "sweep.json")["points"] for d in out.iterdir() if (d / "sweep.json").is_file()}
    a = {p["load"]: p["summary"]["overall"] for p in sweeps["static"]}
    b = {p["load"]: p["summary"]["overall"] for p in sweeps["continuous"]}
    rows = []
    for load in sorted(set(a) & set(b)):
        x, y = a[load], b[load]
        rows.append((f"{load:g}", f"{x['request_throughput']:.2f} / {y['request_throughput']:.2f}",
                     f"{_secs(x['ttft']['p50'])} / {_secs(y['ttft']['p50'])}",
                     f"{_secs(x['e2e']['p50'])} / {_secs(y['e2e']['p50'])}",
                     f"{_secs(x['e2e']['p95'])} / {_secs(y['e2e']['p95'])}",
                     f"{x['itl']['p95'] * 1e3:.0f} / {y['itl']['p95'] * 1e3:.0f} ms"))
    return _table(("offered req/s", "completed req/s static / continuous", "TTFT p50", "E2E p50", "E2E p95", "ITL p95"),
                  ("---:", "---", "---", "---", "---", "---"), rows)


def _knob_rows(a: dict, b: dict, metrics: Sequence[tuple[str, str, Callable, str]]) -> list[tuple[str, ...]]:
    """metrics: (row label, metric, value formatter, "p50" | "p95" | "p50/p95" | "p99/max" | a scalar key)."""
    rows = []
    for label, metric, fmt, which in metrics:
        if metric is None:  # a scalar of `overall`
            rows.append((label, fmt(a[which]), fmt(b[which]), _ratio(b[which], a[which])))
            continue
        qs = which.split("/")
        cells = [" / ".join(fmt(s[metric][q]) for q in qs) for s in (a, b)]
        rows.append((label, *cells, " / ".join(_ratio(b[metric][q], a[metric][q]) for q in qs)))
    return rows


def _knob_table(out: Path, metrics: Sequence[tuple[str, str | None, Callable, str]], goodput: bool = False) -> str:
    (la, a, _), (lb, b, _) = _summaries(out)
    rows = _knob_rows(a["overall"], b["overall"], metrics)
    if goodput:
        slo = ", ".join(f"{k.upper()} <= {v:g} s" for k, v in a["slos"].items())
        cell = lambda o: f"{o['goodput']:.2f} req/s ({o['goodput_fraction']:.1%})"  # noqa: E731
        rows.append((f"goodput ({slo})", cell(a["overall"]), cell(b["overall"]), ""))
    return _table(("metric", la, lb, "B/A"), ("---", "---:", "---:", "---:"), rows)


def _tok(v: float) -> str:
    return f"{v:.1f}"


def _rps(v: float) -> str:
    return f"{v:.2f}"


def fmt_knobs_seqs(out: Path) -> str:
    return _knob_table(out, [
        ("output tok/s", None, _tok, "output_token_throughput"),
        ("TTFT p50 / p95", "ttft", _secs, "p50/p95"),
        ("queue time p95", "queue", _secs, "p95"),
        ("ITL p50 / p95", "itl", _ms, "p50/p95"),
        ("time per output token p50", "tpot", _ms, "p50"),
        ("E2E p50 / p95", "e2e", _secs, "p50/p95"),
    ])


def fmt_knobs_prefix(out: Path) -> str:
    return _knob_table(out, [
        ("completed req/s", None, _rps, "request_throughput"),
        ("TTFT p50 / p95", "ttft", _secs, "p50/p95"),
        ("ITL p50", "itl", _ms, "p50"),
        ("E2E p50", "e2e", _secs, "p50"),
    ], goodput=True)


def fmt_knobs_chunked(out: Path) -> str:
    return _knob_table(out, [
        ("ITL p50 / p95", "itl", _auto, "p50/p95"),
        ("ITL p99 / max", "itl", _auto, "p99/max"),
        ("TTFT p50 / p95", "ttft", _secs, "p50/p95"),
        ("E2E p50 / p95", "e2e", _secs, "p50/p95"),
        ("completed req/s", None, _rps, "request_throughput"),
    ])


def _deadline_ended(run_dir: Path) -> int:
    """Requests the server ended for their deadline: a 408 before the first token, or finish_reason
    "deadline" after it."""
    n = 0
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        n += r.get("status") == 408 or r.get("finish_reason") == "deadline"
    return n


def fmt_knobs_policy(out: Path) -> str:
    """knobs.py --only policy: per tenant p95 TTFT and E2E under each policy, deadlines and Jain's index."""
    (la, a, da), (lb, b, db) = _summaries(out)
    tenants = sorted(a["per_tenant"], key=lambda t: (t != "batch", t))  # the flooding tenant first
    rows = []
    for t in tenants:
        x, y = a["per_tenant"][t], b["per_tenant"].get(t)
        name = f"`{t}` ({x['requests']}{', the flood' if t == 'batch' else ''})"
        rows.append((name, _secs(x["ttft"]["p95"]), _secs(y and y["ttft"]["p95"]),
                     _secs(x["e2e"]["p95"]), _secs(y and y["e2e"]["p95"])))
    rows.append(("requests ended by their deadline", str(_deadline_ended(da)), str(_deadline_ended(db)), "", ""))
    rows.append(("Jain's index of output tok/s over tenants",
                 *(f"{s['fairness']['tenants']['jain_output_throughput']:.2f}" for s in (a, b)), "", ""))
    return _table(("tenant (requests)", f"TTFT p95 {la}", f"TTFT p95 {lb}", f"E2E p95 {la}", f"E2E p95 {lb}"),
                  ("---", "---:", "---:", "---:", "---:"), rows)


# -- formatters: simulator.md -----------------------------------------------------------------------


def fmt_stdout_block(out: Path, with_command: bool = False) -> str:
    """A command's output as the doc quotes it: a code block (with the command on a `$` line)."""
    parts = []
    for i, p in enumerate(_outputs(out, ".out")):
        text = p.read_text().rstrip("\n")
        if with_command:
            text = "$ " + _json(out / f"run{i}.json")["command"] + "\n" + text
        parts.append(text)
    return "```\n" + "\n".join(parts) + "\n```"


def _fidelity_groups(out: Path) -> dict[str, list[tuple[float, float, dict, dict]]]:
    """sim_fidelity.py's --out: a folder per workload and seed (WORKLOAD_seedSEED), each with the
    saturation run and a real_RATE / sim_RATE pair per load (repeats, real_RATE_rN, are left out:
    the figures compare the simulator with the first real run)."""
    dirs = sorted(d for d in out.iterdir() if (d / "saturation").is_dir())
    return {d.name: _fidelity_runs(d) for d in dirs}


def _fidelity_runs(out: Path) -> list[tuple[float, float, dict, dict]]:
    """One group of sim_fidelity.py's --out (the first, given the whole --out)."""
    if not (out / "saturation").is_dir():
        out = next(d for d in sorted(out.iterdir()) if (d / "saturation").is_dir())
    sat = _json(out / "saturation" / "summary.json")["overall"]["request_throughput"]
    rows = []
    firsts = [d for d in out.glob("real_*") if "_r" not in d.name[5:]]
    for real in sorted(firsts, key=lambda d: float(d.name[5:])):
        rate = float(real.name[5:])
        sim = out / f"sim_{real.name[5:]}"
        rows.append((rate / sat, rate, _json(real / "summary.json"), _json(sim / "summary.json")))
    return rows


def fmt_sim_fidelity(out: Path) -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sim_fidelity import table

    return table(_fidelity_runs(out))


def fmt_sim_fidelity_summary(out: Path) -> str:
    """Every group's cells counted: within 15% at p50/p90, and sim/real's median and spread."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sim_fidelity import summary

    return summary(_fidelity_groups(out))


def fmt_sim_fidelity_ratios(out: Path) -> str:
    rows = []
    for frac, _, real, sim in _fidelity_runs(out):
        cells = []
        for m in ("ttft", "itl", "e2e"):
            cells.append(" / ".join(f"{sim['overall'][m][q] / real['overall'][m][q]:.2f}" for q in ("p50", "p90")))
        rows.append((f"{frac:.0%}", *cells))
    return _table(("load", "TTFT p50 / p90", "ITL p50 / p90", "E2E p50 / p90"), ("---",) * 4, rows, compact=True)


def fmt_fleet_routers(out: Path) -> str:
    """bench_fleet.py routers: every run's row, then each server's medians over the seeds."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fleet import routers_summary, routers_table

    rows = _json(out / "rows.json")
    return routers_table(rows) + "\n\n" + routers_summary(rows)


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def fmt_predicted_ttft(out: Path) -> str:
    """bench_predicted_ttft.py: per rate, predicted against real time to first token."""
    rates = _json(out / "summary.json")["rates"]
    rows = []
    for rate, r in rates.items():
        rows.append((rate, f"{r['predicted']}/{r['requests']}", _ms(r["real_ttft_median_s"]),
                     _ms(r["abs_error_median_s"]), _ms(r["abs_error_p90_s"]),
                     _num(r["ratio_median"]), _num(r["ratio_p90"])))
    return _table(("requests/s", "predicted", "real TTFT p50", "abs. error p50", "abs. error p90",
                   "predicted/real p50", "predicted/real p90"),
                  ("---:", "---:", "---:", "---:", "---:", "---:", "---:"), rows)


def fmt_sim_pd(out: Path) -> str:
    """sim_pd.py: colocated against P/D fleets, a row per run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sim_pd import table

    return table(_json(out / "rows.json"))


def fmt_sim_scale(out: Path) -> str:
    """`cadence sim` commands timed by `run` (CPU seconds of the whole command), a row per command."""
    rows = []
    for i, p in enumerate(_outputs(out, ".out")):
        meta = _json(out / f"run{i}.json")
        m = re.search(r"^requests (\d+)", p.read_text(), re.M)
        replicas = re.search(r"--replicas (\d+)", meta["command"])
        rows.append((meta.get("label") or f"#{i}", f"{int(m[1]):,}" if m else "n/a",
                     replicas[1] if replicas else "1", f"{meta['cpu_s']:.1f} s"))
    return _table(("run", "requests", "replicas", "CPU time, whole command"), ("---", "---:", "---:", "---:"), rows)


def fmt_sim_routers(out: Path) -> str:
    """`cadence sim` runs under different routers (--out added): served, prefix-cache hits, steps."""
    rows = []
    for d in sorted((p.parent for p in out.glob("cmd*/summary.json")), key=lambda d: int(d.name[3:])):
        s = _json(d / "summary.json")
        o, reps = s["overall"], s["meta"]["replica_stats"]
        query = sum(r["prefix_cache_query_tokens"] for r in reps)
        hit = sum(r["prefix_cache_hit_tokens"] for r in reps)
        rows.append((f"`{s['meta']['router']}`", f"{o['completed']:,} / {o['requests']:,}",
                     f"{hit / query:.1%}" if query else "n/a", f"{sum(r['steps'] for r in reps):,}"))
    return _table(("router", "served", "prompt tokens found in the prefix cache", "engine steps"),
                  ("---", "---:", "---:", "---:"), rows)


# -- the entries -------------------------------------------------------------------------------------

PY = ".venv/bin/python"
SERVE_LLAMA = f"{PY} benchmarks/bench_serve.py --llama-server {LLAMA_PLACEHOLDER}"
MOONCAKE = ("cadence sim --trace traces/mooncake_synthetic_trace.jsonl --max-model-len 200000 "
            "--kv-cache-memory 8GiB --max-queue-len 100000 --replicas 16 --router {}")
BATCHING = (f"{PY} benchmarks/bench_scheduling.py --only batching --max-num-seqs 16 --rounds 2 "
            "--batching-requests 384 --output-trace '' --long-outputs 384,512 --long-share 0.1")
KNOBS = f"{PY} benchmarks/knobs.py --only {{}} --out results/knobs"
LLAMA = "llama.cpp's server (a llama-server binary on PATH; see docs/performance.md)"
FIDELITY = f"{PY} benchmarks/sim_fidelity.py --num-requests 120 --out results/sim_fidelity"

FIGURES: tuple[Figure, ...] = (
    Figure("serve-llamacpp", "docs/performance.md", "Served, against llama.cpp",
           (f"{SERVE_LLAMA} --concurrencies 1,8,16,32 --out results/serve_llamacpp",),
           45, True, fmt_serve, needs=LLAMA, available=_llama_server, reads="results/serve_llamacpp"),
    Figure("serve-llamacpp-top-p", "docs/performance.md", "Served, against llama.cpp",
           (f"{SERVE_LLAMA} --concurrencies 8,16 --out results/serve_llamacpp_top_p "
            "--bench-args \"--temperature 1.0 --top-p 0.95\"",),
           25, True, fmt_serve, needs=LLAMA, available=_llama_server, reads="results/serve_llamacpp_top_p"),
    Figure("decode-step-context", "docs/performance.md", "Where a step's time goes",
           tuple(f"{PY} benchmarks/profile_step.py --weights q4_1 --streams 8,32 --context {c}" for c in (64, 512, 1024)),
           3, True, fmt_decode_context, extra="--json {out}/cmd{i}.json"),
    Figure("q4-vs-bf16", "docs/performance.md", "Q4_1 layers on their four-bit values",
           (f"{PY} benchmarks/bench_q4.py",), 2, True, fmt_q4, extra="--json {out}/cmd{i}.json"),
    Figure("quality", "docs/performance.md", "Quality of the reduced-precision paths",
           (f"{PY} benchmarks/quality.py --configs bf16,kv8,act8,act8+kv8,act8-1 --threads 1",), 15, False, fmt_quality,
           extra="--json {out}/cmd{i}.json"),
    Figure("int8-kernels", "docs/performance.md", "int8 activations on AVX512-VNNI",
           (f"{PY} benchmarks/bench_int8.py --rounds 5",), 3, True, fmt_int8_kernels, extra="--json {out}/cmd{i}.json"),
    Figure("kernels-exact", "docs/performance.md", "Exact by construction",
           (f"{PY} benchmarks/bench_kernels.py --baseline 6e4b3e4 --rounds 9",
            f"{PY} benchmarks/bench_kernels.py --baseline 6e4b3e4 --rounds 15 --streams 1,32",
            f"{PY} benchmarks/bench_kernels.py --baseline 6e4b3e4 --rounds 11 --streams 1 --context 1024"),
           12, True, fmt_kernels, extra="--json {out}/cmd{i}.json", available=_git_rev("6e4b3e4")),
    Figure("runner-vs-transformers", "docs/performance.md", "Offline, against transformers",
           (f"{PY} benchmarks/bench_runner.py",), 6, True, fmt_runner, extra="--json {out}/cmd{i}.json"),
    Figure("knobs-static", "docs/benchmarking.md", "Static vs continuous batching",
           (KNOBS.format("static"),), 8, True, fmt_knobs_static, reads="results/knobs/static"),
    Figure("batching-offline", "docs/benchmarking.md", "Static vs continuous batching",
           (BATCHING, f"OMP_WAIT_POLICY=PASSIVE {BATCHING}"), 8, True, fmt_batching,
           extra="--json {out}/cmd{i}.json"),
    Figure("knobs-seqs", "docs/benchmarking.md", "`max_num_seqs` 16 vs 64 at 4 requests/s",
           (KNOBS.format("seqs"),), 3, True, fmt_knobs_seqs, reads="results/knobs/seqs"),
    Figure("knobs-prefix", "docs/benchmarking.md", "Prefix caching off vs on",
           (KNOBS.format("prefix"),), 3, True, fmt_knobs_prefix, reads="results/knobs/prefix"),
    Figure("knobs-chunked", "docs/benchmarking.md", "Chunked prefill off vs on",
           (KNOBS.format("chunked"),), 5, True, fmt_knobs_chunked, reads="results/knobs/chunked"),
    Figure("knobs-policy", "docs/benchmarking.md", "FCFS vs fair share with a flooding tenant",
           (KNOBS.format("policy"),), 4, True, fmt_knobs_policy, reads="results/knobs/policy"),
    Figure("sim-plan-infeasible", "docs/simulator.md", "The capacity question",
           ("cadence sim plan --trace traces/azure_llm_2023_code.csv --rate-scale 10 --slo ttft_p95=1.0",),
           0.2, False, fmt_stdout_block, ok_status=(1,)),
    Figure("sim-plan-azure", "docs/simulator.md", "The capacity question",
           ("cadence sim plan --trace traces/azure_llm_2023_code.csv --rate-scale 10 --slo ttft_p95=60 "
            "--max-replicas 512",), 1.5, False, lambda out: fmt_stdout_block(out, with_command=True)),
    Figure("sim-fidelity", "docs/simulator.md", "Latency against a real benchmark",
           (FIDELITY,), 12, True, fmt_sim_fidelity, reads="results/sim_fidelity"),
    Figure("sim-fidelity-ratios", "docs/simulator.md", "Latency against a real benchmark",
           (FIDELITY,), 12, True, fmt_sim_fidelity_ratios, reads="results/sim_fidelity", outputs_of="sim-fidelity"),
    Figure("sim-scale", "docs/simulator.md", "Scale",
           ("cadence sim --trace traces/azure_llm_2023_conv.csv --rate-scale 5 --replicas 128 --router least-loaded",
            "cadence sim --trace traces/azure_llm_2023_conv.csv --repeat 5 --rate-scale 5 --replicas 128 --router least-loaded"),
           1.2, True, fmt_sim_scale, labels=("x1", "x5")),
    Figure("sim-mooncake", "docs/simulator.md", "The Mooncake trace",
           (MOONCAKE.format("prefix-affinity"), MOONCAKE.format("round-robin")), 0.5, False, fmt_sim_routers,
           extra="--out {out}/cmd{i}"),
    # Figures in prose, not tables: regenerated into results/figures only.
    Figure("readme-plan-chat", "README.md", "A quick tour",
           ("cadence sim plan --workload chat --num-requests 1000 --rate 20 --slo ttft_p95=1",), 0.5, False,
           fmt_stdout_block, marked=False),
    Figure("server-http-limits", "docs/server.md", "HTTP limits", ("bash benchmarks/bench_http_limits.sh 4",),
           12, True, fmt_stdout_block, marked=False),
    Figure("server-overhead", "docs/server.md", "Performance", (f"{PY} benchmarks/bench_server_overhead.py",),
           6, True, fmt_stdout_block, marked=False),
    Figure("fleet-routers", "docs/fleet.md", "Measured on this machine",
           (f"{PY} benchmarks/bench_fleet.py routers --calibrate --out results/fleet_routers",), 30, True,
           fmt_fleet_routers, reads="results/fleet_routers"),
    Figure("sim-pd", "docs/fleet.md", "Planning: when to disaggregate (simulated)",
           (f"{PY} benchmarks/sim_pd.py --out results/sim_pd",), 10, False, fmt_sim_pd, reads="results/sim_pd"),
    Figure("fleet-overhead", "docs/fleet.md", "Measured on this machine",
           (f"{PY} benchmarks/bench_fleet.py overhead --rounds 3 --out results/fleet_overhead",), 8, True,
           fmt_stdout_block, marked=False),
    Figure("predicted-ttft", "docs/observability.md", "Predicted time to first token",
           (f"{PY} benchmarks/bench_predicted_ttft.py --rates 2,4,8 --num-requests 150 --out results/predicted_ttft",),
           10, True, fmt_predicted_ttft, reads="results/predicted_ttft"),
    Figure("tracing-cost", "docs/observability.md", "Traces",
           (f"{PY} benchmarks/bench_tracing.py --concurrencies 8,32 --rounds 2 --out results/tracing",), 10, True,
           fmt_stdout_block, marked=False),
)
BY_NAME = {f.name: f for f in FIGURES}
QUICK_MINUTES = 3  # --quick: the entries that take at most this long


# -- running ----------------------------------------------------------------------------------------


def shell_command(cmd: str, python: str = sys.executable) -> str:
    """The doc's command as this checkout runs it: `.venv/bin/python` and `cadence` become this
    interpreter (`-m cadence.cli`), the doc's /path/to/llama-server the binary found; leading
    VAR=value assignments stay."""
    words = [llama_server_binary() or w if w == LLAMA_PLACEHOLDER else w for w in shlex.split(cmd)]
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[i]):
        i += 1
    if words[i] == PY:
        words[i:i + 1] = [python]
    elif words[i] == "cadence":
        words[i:i + 1] = [python, "-m", "cadence.cli"]
    return shlex.join(words)


def machine() -> dict[str, str]:
    return {"arch": platform.machine(), "cpu": cpu_model() or "unknown", "cores": str(os.cpu_count())}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_commands(fig: Figure, out: Path) -> None:
    """Runs each command, its stdout shown as it comes and kept in cmdI.out; runI.json keeps when it
    ran, its exit status, CPU and wall time and the load average before and after."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for i, cmd in enumerate(fig.commands):
        line = cmd.format(out=out) + (" " + fig.extra.format(out=out, i=i) if fig.extra else "")
        print(f"$ {line}", flush=True)
        meta = {"command": cmd.format(out=out), "label": fig.labels[i] if i < len(fig.labels) else "",
                "date": _now(), "load_before": load_average()}
        before, t0, lines = os.times(), time.perf_counter(), []
        with subprocess.Popen(["bash", "-c", shell_command(line)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              text=True) as proc:
            assert proc.stdout is not None
            for text in proc.stdout:
                sys.stdout.write(text)
                lines.append(text)
        after = os.times()
        meta.update(status=proc.returncode, wall_s=time.perf_counter() - t0, load_after=load_average(),
                    cpu_s=(after.children_user - before.children_user) + (after.children_system - before.children_system))
        (out / f"cmd{i}.out").write_text("".join(lines))
        (out / f"run{i}.json").write_text(json.dumps(meta, indent=1) + "\n")
        if proc.returncode not in fig.ok_status:
            raise RuntimeError(f"{fig.name}: `{line}` exited with {proc.returncode}")


def run_record(out: Path) -> tuple[str, tuple[str, str]]:
    """When the outputs under `out` were made and the load average around them, from `run`'s
    records; for outputs made by hand, only that they were formatted now."""
    metas = [_json(p) for p in _outputs(out, ".json", prefix="run")]
    if not metas:
        return f"{_now()} (formatted; the run's own time and load were not recorded)", ("unknown", "unknown")
    return metas[0]["date"], (metas[0]["load_before"], metas[-1]["load_after"])


def result_text(fig: Figure, table: str, loads: tuple[str, str], when: str) -> str:
    m = machine()
    cmds = "\n".join(fig.commands)
    text = (f"# {fig.name}\n\n{fig.doc}, section \"{fig.section}\"\n\n{table}\n\n```sh\n{cmds}\n```\n\n"
            f"- date: {when}\n- machine: {m['arch']}, {m['cpu']}, {m['cores']} CPUs\n"
            f"- load average (1, 5, 15 min): {loads[0]} before, {loads[1]} after\n")
    busy = [float(x.split()[0]) > 0.5 * int(m["cores"]) for x in loads if x[:1].isdigit()]
    if fig.quiet and any(busy):
        text += "- warning: timed on a busy machine (1-minute load above half the cores): slow and noisy figures\n"
    return text


def replace_table(text: str, name: str, table: str) -> str:
    """`text` with what lies between NAME's markers replaced by `table`; the rest untouched."""
    start, end = MARK_OPEN.format(name), MARK_CLOSE
    opening = re.search(f"^{re.escape(start)}$", text, re.M)
    if opening is None:
        raise ValueError(f"no {start} marker")
    closing = re.compile(f"^{re.escape(end)}$", re.M).search(text, opening.end())
    if closing is None or MARK_RE.search(text, opening.end(), closing.start()):
        raise ValueError(f"{start} has no {end} before the next marker")
    return text[:opening.end()] + "\n" + table.rstrip("\n") + "\n" + text[closing.start():]


def update_doc(fig: Figure, table: str, root: Path = ROOT) -> None:
    path = root / fig.doc
    path.write_text(replace_table(path.read_text(), fig.name, table))
    print(f"updated {fig.doc} ({fig.name})")


def marked_names(text: str) -> list[str]:
    return MARK_RE.findall(text)


def figure(fig: Figure, rerun: bool, update: bool, results: Path = RESULTS, done: set[str] | None = None) -> bool:
    """Runs (or, with rerun False, re-reads) one entry; False when it was skipped. `done`: the runs
    made in this invocation, so that entries read from one run (`outputs_of`) run it once."""
    why = fig.available()
    if why:
        print(f"skip {fig.name}: {why}")
        return False
    run_name = fig.outputs_of or fig.name
    out = results / "raw" / run_name
    done = set() if done is None else done
    rerun = rerun and run_name not in done
    if rerun:
        if fig.quiet and os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
            print(f"warning: {fig.name} is timed and the machine is busy (load average {load_average()}): "
                  "its figures will be slow and noisy")
        # A fresh start: a folder the formatter globs must not hold an earlier run's loads or rates.
        for stale in (out, *([ROOT / fig.reads] if fig.reads else [])):
            shutil.rmtree(stale, ignore_errors=True)
        out.mkdir(parents=True)
        run_commands(fig, out)
        done.add(run_name)
    source = ROOT / fig.reads if fig.reads else out
    if not source.is_dir():
        raise FileNotFoundError(f"{fig.name}: no outputs under {source}; run it first")
    table = fig.format(source)
    when, loads = run_record(out)
    (results / f"{fig.name}.md").write_text(result_text(fig, table, loads, when))
    print(f"\n{table}\n\nwrote {results / (fig.name + '.md')}")
    if update and fig.marked:
        update_doc(fig, table)
    elif update:
        print(f"{fig.doc} states {fig.name} in prose: not changed")
    return True


def list_figures() -> None:
    for f in FIGURES:
        why = f.available()
        flags = ", ".join(filter(None, ["timed: wants a quiet machine" if f.quiet else "",
                                        "" if f.marked else "in prose: --update-docs leaves the doc be",
                                        f"needs {f.needs}" if f.needs else "", f"skipped here: {why}" if why else ""]))
        print(f"{f.name:<24} ~{f.minutes:g} min  {f.doc} \"{f.section}\"" + (f"  ({flags})" if flags else ""))
        for c in f.commands:
            print(f"    {c}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="print the registry")
    for action, helptext in (("run", "run the entries' commands, then write their tables"),
                             ("format", "write the tables again from the last run's outputs")):
        p = sub.add_parser(action, help=helptext)
        p.add_argument("names", nargs="*")
        p.add_argument("--all", action="store_true", help="every entry")
        p.add_argument("--quick", action="store_true", help=f"the entries under {QUICK_MINUTES} minutes")
        p.add_argument("--update-docs", action="store_true", help="replace each table between its markers")
    args = ap.parse_args(argv)
    if args.action == "list":
        list_figures()
        return 0
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown figure(s) {', '.join(unknown)}; `list` names them")
    chosen = [f for f in FIGURES if args.all or f.name in args.names or (args.quick and f.minutes <= QUICK_MINUTES)]
    if not chosen:
        ap.error("name figures, or give --all or --quick")
    RESULTS.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    skipped = [f.name for f in chosen if not figure(f, args.action == "run", args.update_docs, done=done)]
    if skipped:
        print(f"skipped: {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
