"""A real fleet on this machine: the three routers side by side, the simulator beside each, and
the cost of the Ray ingress.

    .venv/bin/python benchmarks/bench_fleet.py routers [--calibrate] [--fleet-overhead] [--seeds 0,1,2] [--rate 1.5] [--out results/fleet_routers]
    .venv/bin/python benchmarks/bench_fleet.py overhead [--rounds 3] [--fleet-only] [--out results/fleet_overhead]
    .venv/bin/python benchmarks/bench_fleet.py idle [--rounds 2] [--idle-seconds 60] [--out results/fleet_idle]
    .venv/bin/python benchmarks/bench_fleet.py ceiling [--fleet-sizes 2,3,4] [--families-list 8,12,16,24,32] [--seeds 0,1,2]

`routers`: a workload of prompt families (each family's requests open with the same long prefix,
then a text of their own; families in random order, Poisson arrivals) is sent by `cadence bench`
to four servers in turn, each started fresh for each seed, in an order that rotates every seed:
  prefix-affinity, least-loaded, round-robin  `cadence serve --replicas 2 --replica-threads 1`
  single                                     `cadence serve --num-threads 1`, the fleet's total KV
(`--fleet-size N`: fleets of N replicas, one thread each, and the single server with N times the KV.)
For each run: the prefix-cache hit rate (prompt tokens found in the cache over those looked up,
from the server's /metrics before and after), TTFT p50/p95, ITL p50/p90, goodput under the SLOs.
Before the traffic, each server's request path is probed at idle (sim/serving.py,
`probe_request_path`: a fleet's crosses the ingress and a Ray call). `cadence sim`
runs the same workload (same seed: same sizes and arrival times) with the same router code and
engine options and that request path, and the table gives sim/real for TTFT and ITL p50/p90.

`--fleet-overhead`: before the runs, what a fleet's replica pays per step and per running
request beyond the engine's steps is measured the way calibration measures a plain server's
(sim/serving.py, `decode_overhead`: closed-loop streamed decode traffic, the median ITL less the
modelled step, fitted as per step + per running request), through a fleet of two (least-loaded,
twice the clients, both replicas under load), started as the runs' fleets are (one thread a
replica); saved as fleet_overhead.json under --out (`--sim-only` reuses it). The simulated fleets
then run with that overhead; `single` keeps the profile's own (a plain `cadence serve`'s). With
`--contended` the fleets pay it only while both replicas compute (`cadence sim
--contended-overhead`: it was measured with both busy), and the profile's while one computes alone.

`--sim-only` simulates again against the real runs already under --out (with another --profile;
`--no-step-scatter` prices every step at its mean).

`--at-run-speed`: each real run records its steps (`--record-steps`, steps.jsonl beside its
records), and each server is simulated a second time with its step costs scaled to how fast that
run's steps ran against the profile's prediction (`cadence.sim.served_fit.run_speed`, `cadence sim
--step-cost-scale`): a shared machine's speed drifts by 10-20% over minutes, and near overload
that moves the latencies by far more; the second simulation separates the machine's speed at the
time from the simulator's model. A fleet's factor pools both replicas' steps, and so includes how
much they slowed each other's steps. A run without its steps (recorded without the flag, then
`--sim-only --at-run-speed`) or with a factor outside 0.1-10 (a profile of another machine or
model) is not simulated again; the table and rows.json say why.

`--repeat N`: each server runs N times on each seed (the repeats in their own order after the
first round), and the table adds each repeat against the first run, and how many TTFT/ITL cells
the real runs agree on within 15% beside how many the simulator does: on a shared machine the
real runs' own spread is the floor under any sim/real figure.

`overhead`: one replica behind the fleet's ingress (`--replicas 1 --replica-threads 2`) against
plain `cadence serve` (2 threads), the built-in chat workload at 8 concurrent streams, alternating,
each round on fresh servers; output tokens/s of each and their ratio per round, and the CPU
seconds each process of the server (by role: `cadence serve`, which hosts the fleet's ingress;
replica; Ray's own; and Serve's HTTP proxy and ingress deployment where a fleet runs them) and
the client spent per 1,000 output tokens.

`--fleet-only`: the fleet of one alone (its CPU split, without plain serve beside it).

`idle`: a fleet of one without traffic: the CPU seconds a minute of each of its processes (Ray's
and Serve's, the replica, `cadence serve`) over `--rounds` windows of `--idle-seconds`.

`ceiling` (simulated only, no server; a few minutes): what prefix affinity can find in the cache
against round-robin, by fleet size. For each fleet size N and family count F, the `routers`
workload of F families on each seed through `cadence sim`: prefix-affinity and round-robin over N
replicas of --kv-blocks each, and one server with N times the blocks (the fleet's cache in one
place, computing each family's prefix once: the reference a router of N replicas aims at; its
seats stay --max-num-seqs, so it queues where the fleet would not, and a fleet can land a point or
two either side of it). Prints each one's hit rate and the ratios affinity / round-robin and single /
round-robin, median and range over the seeds; rows.json under --out.

Servers, client and this script share the machine's cores: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cadence.bench.launch import served
from cadence.executor.cost_model import StepCostModel
from cadence.sim.cli import MAX_STEP_SCALE, MIN_STEP_SCALE
from cadence.sim.served_fit import run_speed
from cadence.sim.serving import decode_overhead, fit_request_path, probe_request_path, warm_up
from cadence.workload import Workload, WorkloadRequest, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]
ROUTERS = ("prefix-affinity", "least-loaded", "round-robin")
BLOCK = 16
FLEET_REPLICAS = 2  # the routers' fleets
# The overhead probe's prompts are random token ids below this: any of the served models' ids.
PROBE_VOCAB = 8000


def families_workload(families: int, per_family: int, prefix_tokens: int, suffix_tokens: int,
                      output_tokens: int, seed: int) -> Workload:
    """`families` groups of `per_family` requests; a family's requests share `prefix_tokens` of prompt
    (block ids unique to the family and the seed, so no run finds another's text), in random order."""
    rng = random.Random(seed)
    blocks = prefix_tokens // BLOCK
    reqs = [WorkloadRequest(prompt_tokens=prefix_tokens + suffix_tokens, output_tokens=output_tokens,
                            prefix_group=tuple(range((seed * 1000 + f) * blocks, (seed * 1000 + f + 1) * blocks)))
            for f in range(families) for _ in range(per_family)]
    rng.shuffle(reqs)
    notes = (f"{families} families x {per_family} requests, {prefix_tokens}-token shared prefix + "
             f"{suffix_tokens} own tokens, {output_tokens} output tokens, seed {seed}",)
    return Workload("families", tuple(reqs), prefix_block_tokens=BLOCK, notes=notes)


def int_list(text: str, least: int) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; each an integer >= `least`, at least one."""
    items = [x.strip() for x in text.split(",")]
    if not all(x.isdigit() and int(x) >= least for x in items):
        raise ValueError(f"expected comma-separated integers >= {least}, got {text!r}")
    return [int(x) for x in items]


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd[2:] if cmd[:2] == CADENCE[:2] else cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def _cache_counters(port: int) -> tuple[float, float]:
    """(looked-up, found) prompt tokens of the server's prefix cache, summed over the fleet."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    got = {"cadence:prefix_cache_query_tokens_total": 0.0, "cadence:prefix_cache_hit_tokens_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # (a fleet's also come per replica: the summed ones only)
            if sample.name in got and "replica" not in sample.labels:
                got[sample.name] += sample.value
    return got["cadence:prefix_cache_query_tokens_total"], got["cadence:prefix_cache_hit_tokens_total"]


def fleet_size(args: argparse.Namespace) -> int:
    return getattr(args, "fleet_size", FLEET_REPLICAS)


def engine_flags(args: argparse.Namespace, single: bool) -> list[str]:
    blocks = args.kv_blocks * (fleet_size(args) if single else 1)
    return ["--num-kv-blocks", str(blocks), "--max-num-seqs", str(args.max_num_seqs)]


def _model_flags(args: argparse.Namespace) -> list[str]:
    return ["--tiny"] if args.tiny else []


def serve_cmd(name: str, args: argparse.Namespace) -> list[str]:
    if name == "single":
        return [*CADENCE, "serve", "--num-threads", "1", *engine_flags(args, True), *_model_flags(args)]
    return [*CADENCE, "serve", "--replicas", str(fleet_size(args)), "--replica-threads", "1", "--router", name,
            *engine_flags(args, False), *_model_flags(args)]


def fleet_overheads(args: argparse.Namespace, out: Path) -> dict[str, dict]:
    """The serving overhead of a fleet of --fleet-size replicas (the fleets the routers run), keyed by
    the number of replicas: the fleet started as the runs' are (least-loaded, so the closed-loop
    clients spread evenly) and measured with `decode_overhead` against --profile's step prices."""
    path = out / "fleet_overhead.json"
    if args.sim_only and path.exists():
        return json.loads(path.read_text())
    model = StepCostModel.load(args.profile).steps_only()
    batches = tuple(int(b) for b in args.overhead_batches.split(","))
    if not all(1 <= b <= args.max_num_seqs for b in batches):
        # A batch beyond --max-num-seqs would queue: its gaps would not be steps of that batch.
        raise ValueError(f"--overhead-batches: each must be 1 to --max-num-seqs ({args.max_num_seqs}), "
                         f"got {args.overhead_batches}")
    fits: dict[str, dict] = {}
    url = f"http://127.0.0.1:{args.port}"
    for replicas in (fleet_size(args),):
        cmd = [*CADENCE, "serve", "--replicas", str(replicas), "--replica-threads", "1", "--router", "least-loaded",
               *engine_flags(args, False), *_model_flags(args), "--port", str(args.port)]
        print(f"$ {' '.join(cmd[2:])}  (serving overhead, batches {args.overhead_batches})", flush=True)
        with served(cmd, url + "/health", out / f"fleet_overhead_{replicas}.log", cwd=ROOT, timeout=300):
            warm_up(url, replicas, PROBE_VOCAB)
            fits[str(replicas)] = decode_overhead(url, model, PROBE_VOCAB, replicas=replicas, batches=batches,
                                                  rounds=args.overhead_rounds)
        print(f"fleet of {replicas}: {_overhead_text(fits[str(replicas)])}", flush=True)
    path.write_text(json.dumps(fits, indent=1))
    return fits


def _overhead_text(terms: dict) -> str:
    return f"{terms['per_step'] * 1e3:.2f} ms a step + {terms['per_seq'] * 1e3:.2f} ms a running request"


def server_overhead(name: str, fits: dict[str, dict] | None, contended: bool = False,
                    replicas: int = FLEET_REPLICAS) -> dict[str, float] | None:
    """The serving overhead a simulation of server `name` is given in place of the profile's:
    the fleet's measured one for a fleet, None (the profile's, a plain server's) for `single`, and
    with `contended` for every server (a fleet pays the measured one only while both replicas are
    busy: `contended_flags`)."""
    if name == "single" or not fits or contended:
        return None
    if str(replicas) not in fits:
        raise SystemExit(f"fleet_overhead.json has the overhead of fleets of {', '.join(fits)}, not {replicas}: "
                         "measure it again (without --sim-only)")
    fit = fits[str(replicas)]
    return {"per_step": fit["per_step"], "per_seq": fit["per_seq"]}


def contended_flags(name: str, fits: dict[str, dict] | None, contended: bool,
                    replicas: int = FLEET_REPLICAS) -> list[str]:
    """With `contended`, a fleet's simulation pays the overhead measured through the fleet (both
    replicas busy) only while the other replica is busy (`cadence sim --contended-overhead`)."""
    fit = server_overhead(name, fits, replicas=replicas) if contended else None
    if fit is None:
        return []
    return ["--contended-overhead", f"{fit['per_step'] * 1e3:.4f},{fit['per_seq'] * 1e3:.4f}"]


def sim_cmd(name: str, args: argparse.Namespace, load: list[str], out: Path, profile: str,
            extra: list[str] | None = None) -> list[str]:
    fleet = (["--replicas", "1"] if name == "single" else ["--replicas", str(fleet_size(args)), "--router", name])
    scatter = ["--no-step-scatter"] if getattr(args, "no_step_scatter", False) else []
    return [*CADENCE, "sim", *load, *fleet, *engine_flags(args, name == "single"), "--num-threads", "1",
            "--profile", profile, "--out", str(out), *scatter, *(extra or [])]


def with_request_path(args: argparse.Namespace, real: Path, out: Path,
                      overhead: dict[str, float] | None = None) -> StepCostModel:
    """--profile with the request path this server was probed at (a fleet's crosses the ingress
    and a Ray call), so the simulation pays what this server's requests paid; saved
    as `out`/profile.json. With `overhead`, that serving overhead replaces the profile's first
    (a fleet's replicas pay their own), and the probe's steps are priced with it."""
    model = StepCostModel.load(args.profile)
    if overhead is not None:
        model = dataclasses.replace(model, overhead=dict(overhead),
                                    metadata={**model.metadata, "overhead_source": "measured through the fleet"})
    probe = json.loads((real / "request_path_probe.json").read_text())
    probed = dataclasses.replace(model, request_path=fit_request_path(probe, model))
    probed.save(out / "profile.json")
    return probed


def real_dir(out: Path, name: str, seed: int, rep: int = 0) -> Path:
    """Where run `rep` of server `name` on `seed` keeps its client records (the first: no suffix)."""
    return out / (f"{name}_s{seed}" if rep == 0 else f"{name}_s{seed}_r{rep}")


def repeat_run(name: str, seed: int, rep: int, args: argparse.Namespace, out: Path) -> dict:
    """Run `rep` (1, 2, ...) of the same server, workload and seed, against the first: the real runs'
    own spread, the floor under any sim/real comparison on this machine."""
    wl = out / f"workload_s{seed}.jsonl"
    load = ["--requests-file", str(wl), "--arrival", "poisson", "--rate", str(args.rate), "--seed", str(seed),
            *(x for s in args.slo for x in ("--slo", s))]
    real = real_dir(out, name, seed, rep)
    if not args.sim_only:
        serve_and_bench(name, seed, args, load, real, out, log_suffix=f"_r{rep}")
    return {"router": name, "seed": seed, "rep": rep, "real": _summary(real)["overall"],
            "first": _summary(real_dir(out, name, seed))["overall"]}


def one_run(name: str, seed: int, args: argparse.Namespace, out: Path, fits: dict[str, dict] | None = None) -> dict:
    wl = out / f"workload_s{seed}.jsonl"
    write_jsonl(families_workload(args.families, args.per_family, args.prefix_tokens, args.suffix_tokens,
                                  args.output_tokens, seed), wl)
    load = ["--requests-file", str(wl), "--arrival", "poisson", "--rate", str(args.rate), "--seed", str(seed),
            *(x for s in args.slo for x in ("--slo", s))]
    real, sim = out / f"{name}_s{seed}", out / f"{name}_s{seed}_sim"
    if not args.sim_only:
        serve_and_bench(name, seed, args, load, real, out)
    sim.mkdir(parents=True, exist_ok=True)
    contended = getattr(args, "contended", False)
    probed = with_request_path(args, real, sim, server_overhead(name, fits, contended, fleet_size(args)))
    flags = contended_flags(name, fits, contended, fleet_size(args))
    _run(sim_cmd(name, args, load, sim, str(sim / "profile.json"), flags))
    row = {"router": name, "seed": seed, "hit_rate": json.loads((real / "hit.json").read_text())["hit_rate"],
           "real": _summary(real)["overall"], "sim": _summary(sim)["overall"], "sim_hit_rate": _sim_hit_rate(sim),
           "request_path_ms": 1000 * probed.request_delay,
           "request_path_us_per_token": 1e6 * probed.request_delay_per_token,
           "overhead_ms": {k: 1000 * v for k, v in probed.overhead.items()}}
    if getattr(args, "at_run_speed", False):
        speed, skipped = speed_of_run(probed, real / "steps.jsonl")
        if skipped:
            print(f"{name} seed {seed}: no simulation at the run's speed: {skipped}", flush=True)
            row["at_run_speed_skipped"] = skipped
        else:
            at_speed = out / f"{name}_s{seed}_sim_speed"
            _run(sim_cmd(name, args, load, at_speed, str(sim / "profile.json"),
                         [*flags, "--step-cost-scale", f"{speed:.4f}"]))
            row.update(run_speed=speed, sim_speed=_summary(at_speed)["overall"])
    return row


def speed_of_run(model: StepCostModel, steps: Path) -> tuple[float, str | None]:
    """How fast a run's recorded steps ran against `model` (`run_speed`), or why it cannot be used."""
    if not steps.exists():
        return 0.0, f"{steps} is missing (the run was made without --at-run-speed)"
    try:
        speed = run_speed(model, steps)
    except ValueError as e:
        return 0.0, str(e)
    if not MIN_STEP_SCALE <= speed <= MAX_STEP_SCALE:
        return speed, (f"its steps ran {speed:.3g} times the profile's, outside {MIN_STEP_SCALE:g}-{MAX_STEP_SCALE:g}: "
                       "the profile is not this machine's or this model's (calibrate one)")
    return speed, None


def serve_and_bench(name: str, seed: int, args: argparse.Namespace, load: list[str], real: Path, out: Path,
                    log_suffix: str = "") -> None:
    record: list[str] = []
    if getattr(args, "at_run_speed", False):  # (after the probe below: its steps are not the run's)
        real.mkdir(parents=True, exist_ok=True)
        record = ["--record-steps", str((real / "steps.all.jsonl").resolve())]
        (real / "steps.all.jsonl").unlink(missing_ok=True)
    with served([*serve_cmd(name, args), "--port", str(args.port), *record], f"http://127.0.0.1:{args.port}/health",
                out / f"{name}_s{seed}{log_suffix}.log", cwd=ROOT, timeout=300):
        # At idle first: what a request pays outside the engines' steps on this server.
        probe = probe_request_path(f"http://127.0.0.1:{args.port}", seed=seed)
        real.mkdir(parents=True, exist_ok=True)
        (real / "request_path_probe.json").write_text(json.dumps(probe))
        q0, h0 = _cache_counters(args.port)
        probe_steps = _lines(real / "steps.all.jsonl") if record else []
        _run([*CADENCE, "bench", *load, "--base-url", f"http://127.0.0.1:{args.port}", "--no-progress",
              "--label", f"{name} seed {seed}", "--out", str(real)])
        q1, h1 = _cache_counters(args.port)
    (real / "hit.json").write_text(json.dumps({"hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None}))
    if record:  # the run's own steps: those after the probe's (each was logged before its tokens left)
        run_steps = _lines(real / "steps.all.jsonl")[len(probe_steps):]
        (real / "steps.jsonl").write_text("".join(run_steps))


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else []


def _sim_hit_rate(path: Path) -> float | None:
    reps = _summary(path)["meta"]["replica_stats"]
    q = sum(r["prefix_cache_query_tokens"] for r in reps)
    return sum(r["prefix_cache_hit_tokens"] for r in reps) / q if q else None


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def routers_table(rows: list[dict]) -> str:
    lines = ["| server | seed | hit rate (sim) | TTFT p50 / p95 (ms) | ITL p50 / p90 (ms) | goodput | "
             "request path (ms + per prompt token) | sim/real TTFT p50, p90 | sim/real ITL p50, p90 |",
             "|---|---:|---|---|---|---:|---:|---|---|"]
    for r in rows:
        real, sim = r["real"], r["sim"]

        def ratio(m: str, q: str, real: dict = real, sim: dict = sim) -> str:
            a, b = real[m][q], sim[m][q]
            return f"{b / a:.2f}" if a and b is not None else "n/a"

        good = real.get("goodput_fraction")
        lines.append(
            f"| {r['router']} | {r['seed']} | {_pct(r['hit_rate'])} ({_pct(r['sim_hit_rate'])}) | "
            f"{_ms(real['ttft']['p50'])} / {_ms(real['ttft']['p95'])} | {_ms(real['itl']['p50'])} / "
            f"{_ms(real['itl']['p90'])} | {_pct(good)} | {r.get('request_path_ms', 0.0):.1f} + "
            f"{r.get('request_path_us_per_token', 0.0):.0f} us/token | "
            f"{ratio('ttft', 'p50')}, {ratio('ttft', 'p90')} | "
            f"{ratio('itl', 'p50')}, {ratio('itl', 'p90')} |")
    return "\n".join(lines)


def routers_summary(rows: list[dict]) -> str:
    """Per server: medians over seeds, and the spread (min-max) of the hit rate and TTFT p95."""
    lines = ["| server | hit rate, median (min-max) | TTFT p50 (ms) | TTFT p95 (ms), median (min-max) | goodput |",
             "|---|---|---:|---|---:|"]
    for name in [*ROUTERS, "single"]:
        rs = [r for r in rows if r["router"] == name]
        if not rs:
            continue
        hits = [r["hit_rate"] or 0.0 for r in rs]
        p95 = [r["real"]["ttft"]["p95"] for r in rs]
        p50 = [r["real"]["ttft"]["p50"] for r in rs]
        good = [r["real"].get("goodput_fraction") or 0.0 for r in rs]
        lines.append(f"| {name} | {statistics.median(hits):.0%} ({min(hits):.0%}-{max(hits):.0%}) | "
                     f"{_ms(statistics.median(p50))} | {_ms(statistics.median(p95))} ({_ms(min(p95))}-"
                     f"{_ms(max(p95))}) | {statistics.median(good):.0%} |")
    cells = [(r["sim"][m][q] / r["real"][m][q]) for r in rows for m in ("ttft", "itl") for q in ("p50", "p90")
             if r["real"][m][q] and r["sim"][m][q] is not None]
    within = sum(1 for c in cells if abs(c - 1) <= 0.15)
    lines.append("")
    lines.append(f"simulator: {within} of {len(cells)} TTFT/ITL p50/p90 cells within 15% of the real run; "
                 f"sim/real median {statistics.median(cells):.2f}, range {min(cells):.2f}-{max(cells):.2f}"
                 if cells else "simulator: no cells")
    return "\n".join(lines)


LATENCY_CELLS = [(m, q) for m in ("ttft", "itl") for q in ("p50", "p90")]


def _ratios(a: dict, b: dict) -> list[float]:
    """b / a for each TTFT and ITL p50/p90 cell both have."""
    return [b[m][q] / a[m][q] for m, q in LATENCY_CELLS if a[m][q] and b[m][q] is not None]


def _within(cells: list[float], tol: float = 0.15) -> int:
    return sum(1 for c in cells if abs(c - 1) <= tol)


def _at_speed(row: dict) -> bool:
    """Whether `--at-run-speed` said something of this row: its simulation at the run's speed, or why not."""
    return "sim_speed" in row or "at_run_speed_skipped" in row


def speed_table(rows: list[dict]) -> str:
    """Each server simulated at the speed its run's steps ran (`--at-run-speed`) against the real run."""
    rows = [r for r in rows if _at_speed(r)]
    lines = ["| server | seed | run's steps / profile | sim/real TTFT p50, p90 | sim/real ITL p50, p90 |",
             "|---|---:|---:|---|---|"]
    for r in rows:
        if "sim_speed" not in r:
            lines.append(f"| {r['router']} | {r['seed']} | n/a | not simulated: {r['at_run_speed_skipped']} | |")
            continue
        c = [f"{x:.2f}" for x in _ratios(r["real"], r["sim_speed"])]
        lines.append(f"| {r['router']} | {r['seed']} | {r['run_speed']:.2f} | {', '.join(c[:2])} | {', '.join(c[2:])} |")
    cells = [c for r in rows if "sim_speed" in r for c in _ratios(r["real"], r["sim_speed"])]
    lines += ["", f"simulator at each run's speed: {_within(cells)} of {len(cells)} cells within 15% of the real run; "
                  f"sim/real median {statistics.median(cells):.2f}, range {min(cells):.2f}-{max(cells):.2f}"
              if cells else "simulator at each run's speed: no run could be simulated at its speed"]
    return "\n".join(lines)


def repeats_table(repeats: list[dict]) -> str:
    lines = ["| server | seed | run | TTFT p50 / p95 (ms) | ITL p50 / p90 (ms) | this run / first, TTFT p50, p90 | "
             "ITL p50, p90 |", "|---|---:|---:|---|---|---|---|"]
    for r in repeats:
        real, first = r["real"], r["first"]

        def ratio(m: str, q: str, real: dict = real, first: dict = first) -> str:
            a, b = first[m][q], real[m][q]
            return f"{b / a:.2f}" if a and b is not None else "n/a"

        lines.append(f"| {r['router']} | {r['seed']} | {r['rep'] + 1} | {_ms(real['ttft']['p50'])} / "
                     f"{_ms(real['ttft']['p95'])} | {_ms(real['itl']['p50'])} / {_ms(real['itl']['p90'])} | "
                     f"{ratio('ttft', 'p50')}, {ratio('ttft', 'p90')} | {ratio('itl', 'p50')}, {ratio('itl', 'p90')} |")
    return "\n".join(lines)


def repeats_summary(rows: list[dict], repeats: list[dict]) -> str:
    """The real runs against themselves beside the simulator against them, over the same servers and
    seeds: a simulator can be judged only as closely as the machine repeats itself."""
    real_cells = [c for r in repeats for c in _ratios(r["first"], r["real"])]
    keys = {(r["router"], r["seed"]) for r in repeats}
    sim_first = [c for r in rows if (r["router"], r["seed"]) in keys for c in _ratios(r["real"], r["sim"])]
    sim_repeat = [c for r in rows for x in repeats if (x["router"], x["seed"]) == (r["router"], r["seed"])
                  for c in _ratios(x["real"], r["sim"])]
    return "\n".join([
        f"real against itself: {_within(real_cells)} of {len(real_cells)} cells within 15% "
        f"(repeat / first median {statistics.median(real_cells):.2f}, range {min(real_cells):.2f}-"
        f"{max(real_cells):.2f})",
        f"simulator against the first runs of the same servers: {_within(sim_first)} of {len(sim_first)}; "
        f"against the repeats: {_within(sim_repeat)} of {len(sim_repeat)}"]) if real_cells else "no repeats"


def routers(args: argparse.Namespace, out: Path) -> None:
    names = args.servers.split(",")
    fits = fleet_overheads(args, out) if args.fleet_overhead else None
    rows: list[dict] = []
    repeats: list[dict] = []
    for k, seed in enumerate(args.seeds):
        order = names[k % len(names):] + names[: k % len(names)]  # each server takes each turn in time
        for name in order:
            rows.append(one_run(name, seed, args, out, fits))
            print(routers_table(rows[-1:]), flush=True)
            if _at_speed(rows[-1]):
                print(speed_table(rows[-1:]), flush=True)
        for rep in range(1, args.repeat):
            for name in order[rep % len(order):] + order[: rep % len(order)]:
                repeats.append(repeat_run(name, seed, rep, args, out))
                print(repeats_table(repeats[-1:]), flush=True)
    text = (f"{args.families} families x {args.per_family} requests ({args.prefix_tokens} shared + "
            f"{args.suffix_tokens} own prompt tokens, {args.output_tokens} output), Poisson {args.rate} req/s, "
            f"{fleet_size(args)} replicas of {args.kv_blocks} KV blocks, profile {args.profile}, load average "
            f"{os.getloadavg()[0]:.2f} at the end{_fits_text(fits, fleet_size(args))}\n\n{routers_table(rows)}\n\n"
            f"{routers_summary(rows)}")
    if any(_at_speed(r) for r in rows):
        text += f"\n\n{speed_table(rows)}"
    if repeats:
        text += f"\n\n{repeats_table(repeats)}\n\n{repeats_summary(rows, repeats)}"
        (out / "repeats.json").write_text(json.dumps(repeats, indent=1))
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(text + "\n")
    print(text)


def ceiling(args: argparse.Namespace, out: Path) -> None:
    seeds = args.seeds
    rows = []
    for n in args.fleet_sizes:
        sized = argparse.Namespace(**{**vars(args), "fleet_size": n})  # (sim_cmd's fleets: n replicas)
        for fam in args.families_list:
            row: dict = {"replicas": n, "families": fam, "hit": {"prefix-affinity": [], "round-robin": [], "single": []}}
            for seed in seeds:
                wl = out / f"workload_f{fam}_s{seed}.jsonl"
                write_jsonl(families_workload(fam, args.per_family, args.prefix_tokens, args.suffix_tokens,
                                              args.output_tokens, seed), wl)
                load = ["--requests-file", str(wl), "--arrival", "poisson", "--rate", str(args.rate), "--seed", str(seed)]
                for name in row["hit"]:
                    sim = out / f"{name}_n{n}_f{fam}_s{seed}"
                    done = subprocess.run(sim_cmd(name, sized, load, sim, args.profile), cwd=ROOT, capture_output=True,
                                          text=True)
                    hit = _sim_hit_rate(sim) if done.returncode == 0 else None
                    if hit is None:  # (every request refused, or a bad flag: the simulator says which)
                        raise SystemExit(f"ceiling: `cadence sim` of {name}, {n} replicas, {fam} families, seed {seed} "
                                         f"served nothing: {_sim_failure(done)}")
                    row["hit"][name].append(hit)
            rows.append(row)
            print(ceiling_line(row), flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n" + ceiling_table(rows))


def _sim_failure(done: subprocess.CompletedProcess) -> str:
    """Why a `cadence sim` run served nothing: its first reason for refusing, else its last error line."""
    lines = done.stdout.splitlines()
    if "errors by reason:" in lines[:-1]:
        return lines[lines.index("errors by reason:") + 1].strip()
    tail = done.stderr.strip().splitlines()
    return tail[-1] if tail else f"exit status {done.returncode}"


def _ratio_text(num: list[float], den: list[float]) -> str:
    r = [a / b if b else float("inf") for a, b in zip(num, den, strict=True)]
    return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"


def ceiling_line(row: dict) -> str:
    h = row["hit"]
    return (f"{row['replicas']} replicas, {row['families']} families: " + ", ".join(
        f"{k} {statistics.median(v):.0%}" for k, v in h.items())
        + f"; affinity/round-robin {_ratio_text(h['prefix-affinity'], h['round-robin'])}, "
          f"single/round-robin {_ratio_text(h['single'], h['round-robin'])}")


def ceiling_table(rows: list[dict]) -> str:
    lines = ["| replicas | families | prefix-affinity | round-robin | single (N x KV) | affinity / round-robin "
             "| single / round-robin |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        h = r["hit"]
        lines.append(f"| {r['replicas']} | {r['families']} | " + " | ".join(
            f"{statistics.median(h[k]):.0%}" for k in ("prefix-affinity", "round-robin", "single"))
            + f" | {_ratio_text(h['prefix-affinity'], h['round-robin'])} | {_ratio_text(h['single'], h['round-robin'])} |")
    return "\n".join(lines)


def _fits_text(fits: dict[str, dict] | None, replicas: int = FLEET_REPLICAS) -> str:
    if not fits:
        return ""
    each = "; ".join(f"{n} replica{'s' if n != '1' else ''}: {_overhead_text(f)}" for n, f in sorted(fits.items()))
    return f"\nserving overhead measured through the fleet (the simulated fleets use {replicas} replicas'): {each}"


TICK = os.sysconf("SC_CLK_TCK")


def _role(cmdline: list[str]) -> str:
    """A process of the server's tree, by what it does: Ray names its workers `ray::Class...`."""
    first = cmdline[0] if cmdline else "?"
    if first.startswith("ray::"):
        title = first.removeprefix("ray::")
        for key, role in (("Ingress", "ingress"), ("Replica", "replica"), ("Proxy", "HTTP proxy"),
                          ("Controller", "Serve controller")):
            if key in title:
                return role
        return "other Ray workers"
    name = Path(first).name
    if "cadence.cli" in cmdline:
        return "cadence serve"
    if name in ("raylet", "gcs_server"):
        return "Ray system (raylet, GCS)"
    return "other Ray system"


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of `root` and every process descended from it, by pid."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone, or not ours to read
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    out = {}
    for pid in tree:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        out[pid] = (_role(cmd), (int(f[11]) + int(f[12])) / TICK)
    return out


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    roles: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        roles[role] = roles.get(role, 0.0) + cpu - before.get(pid, (role, 0.0))[1]
    return roles


def overhead(args: argparse.Namespace, out: Path) -> None:
    servers = {"plain": [*CADENCE, "serve", "--num-threads", "2"],
               "fleet-1": [*CADENCE, "serve", "--replicas", "1", "--replica-threads", "2"]}
    if args.fleet_only:  # (the fleet's CPU split alone: no ratio)
        del servers["plain"]
    tps: dict[str, list[float]] = {k: [] for k in servers}
    cpu: dict[str, list[dict[str, float]]] = {k: [] for k in servers}  # CPU seconds per 1,000 output tokens
    for rnd in range(args.rounds):
        order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
        for name in order:
            d = out / f"{name}_r{rnd}"
            with served([*servers[name], "--port", str(args.port)], f"http://127.0.0.1:{args.port}/health",
                        out / f"{name}_r{rnd}.log", cwd=ROOT, timeout=300) as proc:
                c0, r0 = tree_cpu(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
                _run([*CADENCE, "bench", "--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", "chat",
                      "--workload", "chat", "--concurrency", "8", "--num-requests", str(args.num_requests),
                      "--seed", str(rnd), "--no-progress", "--out", str(d)])
                roles = cpu_by_role(c0, tree_cpu(proc.pid))
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            roles["client (cadence bench)"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
            summary = _summary(d)["overall"]
            tokens = summary["output_tokens"]
            cpu[name].append({k: 1000 * v / tokens for k, v in roles.items() if v > 0.005})
            tps[name].append(summary["output_token_throughput"])
        if args.fleet_only:
            print(f"round {rnd}: fleet of 1 {tps['fleet-1'][-1]:.1f} tok/s", flush=True)
            continue
        print(f"round {rnd}: plain {tps['plain'][-1]:.1f} tok/s, fleet of 1 {tps['fleet-1'][-1]:.1f} tok/s, "
              f"ratio {tps['fleet-1'][-1] / tps['plain'][-1]:.2f}", flush=True)
    if args.fleet_only:
        text = f"fleet of one, 8 streams, {args.num_requests} requests a run\n\n" + cpu_table(cpu)
        (out / "table.md").write_text(text + "\n")
        (out / "cpu.json").write_text(json.dumps(cpu, indent=1))
        print(text)
        return
    ratios = [f / p for f, p in zip(tps["fleet-1"], tps["plain"], strict=True)]
    text = (f"8 streams, chat workload, {args.num_requests} requests a run, {args.rounds} alternating rounds\n"
            f"plain cadence serve: {statistics.median(tps['plain']):.1f} tok/s (median), fleet of one replica: "
            f"{statistics.median(tps['fleet-1']):.1f} tok/s; ratio per round "
            f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})\n\n"
            + cpu_table(cpu))
    (out / "table.md").write_text(text + "\n")
    (out / "cpu.json").write_text(json.dumps(cpu, indent=1))
    print(text)


def _proc_name(cmdline: list[str]) -> str:
    """A short name for one process of the server's tree (Ray's workers carry their actor's class)."""
    first = cmdline[0] if cmdline else "?"
    if first.startswith("ray::"):
        return first.split()[0]
    if "cadence.cli" in cmdline:
        return "cadence serve"
    names = [Path(a).name for a in cmdline[:3] if a]
    return next((n for n in names if n.endswith(".py")), Path(first).name)


def idle(args: argparse.Namespace, out: Path) -> None:
    """CPU seconds a minute of every process of an idle fleet of one (after `--settle` seconds),
    `--rounds` windows of `--idle-seconds` each."""
    cmd = [*CADENCE, "serve", "--replicas", "1", "--replica-threads", "2", "--port", str(args.port)]
    with served(cmd, f"http://127.0.0.1:{args.port}/health", out / "idle.log", cwd=ROOT, timeout=300) as proc:
        time.sleep(args.settle)
        rows: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            before = _named_cpu(proc.pid)
            time.sleep(args.idle_seconds)
            after = _named_cpu(proc.pid)
            per: dict[str, float] = {}
            for pid, (name, c) in after.items():
                per[name] = per.get(name, 0.0) + c - before.get(pid, (name, 0.0))[1]
            for name, c in per.items():
                rows.setdefault(name, []).append(60 * c / args.idle_seconds)
    lines = ["| process (idle fleet of one) | CPU s a minute (median) |", "|---|---:|"]
    for name, vals in sorted(rows.items(), key=lambda kv: -statistics.median(kv[1])):
        lines.append(f"| {name} | {statistics.median(vals):.2f} |")
    total = statistics.median(sum(v[i] for v in rows.values() if i < len(v)) for i in range(args.rounds))
    lines.append(f"| all | {total:.2f} |")
    text = "\n".join(lines)
    (out / "idle.md").write_text(text + "\n")
    print(text)


def _named_cpu(root: int) -> dict[int, tuple[str, float]]:
    cpu = tree_cpu(root)
    out = {}
    for pid, (_, c) in cpu.items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        out[pid] = (_proc_name(cmd), c)
    return out


def cpu_table(cpu: dict[str, list[dict[str, float]]]) -> str:
    """CPU seconds per 1,000 output tokens by process, median over rounds, for each server."""
    roles = sorted({r for runs in cpu.values() for run in runs for r in run})
    lines = ["| CPU s per 1,000 output tokens (median of rounds) | " + " | ".join(cpu) + " |",
             "|---|" + "---:|" * len(cpu)]
    for role in roles:
        lines.append(f"| {role} | " + " | ".join(
            f"{statistics.median(run.get(role, 0.0) for run in runs):.2f}" for runs in cpu.values()) + " |")
    lines.append("| all | " + " | ".join(
        f"{statistics.median(sum(run.values()) for run in runs):.2f}" for runs in cpu.values()) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["routers", "overhead", "idle", "ceiling"])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--servers", default=",".join([*ROUTERS, "single"]), help="routers: which servers, in turn")
    p.add_argument("--families", type=int, default=12)
    p.add_argument("--fleet-sizes", default="2,3,4", help="ceiling: replicas in each simulated fleet")
    p.add_argument("--fleet-size", type=int, default=FLEET_REPLICAS,
                   help="routers: replicas in each fleet (one thread each; the single server: that many times the KV)")
    p.add_argument("--families-list", default="8,12,16,24,32", help="ceiling: family counts")
    p.add_argument("--per-family", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals, requests/s")
    p.add_argument("--kv-blocks", type=int, default=200, help="KV blocks a replica (the single server: the fleet's, --fleet-size times as many)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--slo", action="append", default=None, help="KEY=SECONDS for goodput (default ttft=2, itl=0.2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--port", type=int, default=8019)
    p.add_argument("--fleet-only", action="store_true", help="overhead: run the fleet of one alone")
    p.add_argument("--idle-seconds", type=float, default=60.0, help="idle: each measured window")
    p.add_argument("--settle", type=float, default=15.0, help="idle: seconds after start before measuring")
    p.add_argument("--sim-only", action="store_true",
                   help="routers: keep the real runs already under --out, simulate again (another --profile)")
    p.add_argument("--calibrate", action="store_true",
                   help="routers: calibrate a one-thread profile first (a few minutes) and simulate with it")
    p.add_argument("--fleet-overhead", action="store_true",
                   help="routers: measure the serving overhead through a fleet of 1 and of 2 replicas first "
                        "and simulate the fleets with it (single keeps the profile's)")
    p.add_argument("--contended", action="store_true",
                   help="routers, with --fleet-overhead: the simulated fleets pay the overhead measured through the "
                        "fleet only while both replicas are busy (`cadence sim --contended-overhead`), the profile's "
                        "while a replica computes alone")
    p.add_argument("--overhead-batches", default="1,4,16",
                   help="--fleet-overhead: running requests a replica, comma-separated")
    p.add_argument("--overhead-rounds", type=int, default=2,
                   help="--fleet-overhead: requests each closed-loop client streams at each batch size")
    p.add_argument("--repeat", type=int, default=1,
                   help="routers: run each real server this many times on each seed (the repeats are judged "
                        "against the first run, the simulator against both: the machine's own spread)")
    p.add_argument("--no-step-scatter", action="store_true",
                   help="routers: simulate every step at its mean time, without the profile's step-time scatter")
    p.add_argument("--at-run-speed", action="store_true",
                   help="routers: record each real run's steps and simulate each server again at the speed they "
                        "ran (`cadence sim --step-cost-scale`)")
    p.add_argument("--tiny", action="store_true",
                   help="serve the tiny random-weight model (a check that the script runs, not a measurement)")
    p.add_argument("--profile", default=str(ROOT / "src/cadence/sim/profiles/default.json"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for flag, least in (("seeds", 0), ("fleet_sizes", 1), ("families_list", 1)):
        try:
            setattr(args, flag, int_list(getattr(args, flag), least))
        except ValueError as e:
            p.error(f"--{flag.replace('_', '-')}: {e}")
    if args.fleet_size < 1:
        p.error(f"--fleet-size: expected an integer >= 1, got {args.fleet_size}")
    args.slo = args.slo or ["ttft=2", "itl=0.2"]
    out = Path(args.out or ROOT / f"results/fleet_{args.mode}")
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate and args.mode == "routers":
        # Step times on a shared machine depend on what else runs: calibrate under today's conditions.
        args.profile = str(out / "profile.json")
        _run([*CADENCE, "calibrate", "--num-threads", "1", "--out", args.profile])
    {"routers": routers, "overhead": overhead, "idle": idle, "ceiling": ceiling}[args.mode](args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
