"""Where a served run's time goes, at several loads: what the simulator sees and what it does not.

    .venv/bin/python benchmarks/serving_breakdown.py [--workload chat] [--num-requests 100] [--seeds 0]
        [--fractions 0.3,0.6,0.85] [--profile src/cadence/sim/profiles/default.json] [--out results/breakdown]

For each load (a fraction of the workload's simulated saturation, as in sim_fidelity.py) a fresh
`cadence serve` (one torch thread) is driven by `cadence bench` at that Poisson rate, and the run
is timed from the inside:
- the engine thread's wall time by phase (`cadence:engine_thread_seconds_total`): execute (the
  forward pass the cost model prices), schedule/update, detokenize, publish, inbox, idle;
- its CPU time beside its busy wall time: the difference is time it was ready but did not run
  (no free core, or the GIL held by the HTTP thread);
- the delay of each step's output to the HTTP side's event loop;
- the CPU time of every thread of the server (the HTTP thread is the main one) and of the client,
  read from /proc, as a share of the run's wall time on this machine's cores;
- every step the engine ran (`--record-steps`) against the profile's cost model, by kind of step
  (decodes only, a prompt chunk beside decodes, prompt chunks only): what the simulator would
  have charged for the very steps the server made;
- the request path: before the traffic, one request at a time at idle, the client's time to its
  first token less the profile's price of the prefill step (sim/serving.py, `probe_request_path`);
- the same workload simulated: busy time, steps, and TTFT/ITL percentiles beside the client's
  and the engine's own (from /metrics).

It prints one table per seed and load, and keeps each run's figures in --out/breakdown.json.
The server, the client and this script share the machine; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cadence.bench.launch import served
from cadence.executor.cost_model import StepCostModel
from cadence.sim.served_fit import scheduled_rows
from cadence.sim.serving import fit_request_path, probe_request_path

ROOT = Path(__file__).resolve().parent.parent
CADENCE = [sys.executable, "-m", "cadence.cli"]
PHASES = ("execute", "schedule_update", "detokenize", "publish", "inbox", "idle")
TICK = os.sysconf("SC_CLK_TCK")


HISTOGRAMS = ("cadence:time_to_first_token_seconds_bucket", "cadence:inter_token_latency_seconds_bucket")


def scrape(url: str) -> dict[str, float]:
    """The engine-thread counters of one /metrics scrape, by sample name and phase, and the
    engine-side TTFT and ITL histograms' buckets (summed over tenants) by name and bound."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("cadence:engine_") or s.name in ("cadence:generation_tokens_total",
                                                                  "cadence:prompt_tokens_total"):
                out[s.name + (":" + s.labels["phase"] if "phase" in s.labels else "")] = s.value
            elif s.name in HISTOGRAMS:
                key = f"{s.name}:{s.labels['le']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def histogram_quantile(d: dict[str, float], name: str, q: float) -> float | None:
    """Prometheus's histogram_quantile over the scrape difference `d`: linear within the bucket."""
    buckets = sorted((float(k.rpartition(":")[2]), v) for k, v in d.items() if k.startswith(name + ":"))
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_bound, prev_count = q * buckets[-1][1], 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_bound, prev_count = bound, count
    return None


def simulate(args: argparse.Namespace, seed: int, rate: float, out: Path) -> dict:
    """The same workload, seed and rate through `cadence sim`: its busy time, steps and percentiles."""
    d = out / f"sim_{seed}_{rate:.3f}"
    subprocess.run([*CADENCE, "sim", "--workload", args.workload, "--num-requests", str(args.num_requests),
                    "--rate", f"{rate:.4f}", "--seed", str(seed), "--profile", args.profile, "--num-threads", "1",
                    "--out", str(d)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s = json.loads((d / "summary.json").read_text())
    rep = s["meta"]["replica_stats"][0]
    return {"busy_s": rep["busy_s"], "steps": rep["steps"], **{m: s["overall"][m] for m in ("ttft", "itl", "e2e")}}


def thread_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of every process in the server's session, by
    thread name (`python` is a process's main thread: the HTTP event loop in the server)."""
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, ValueError):
            continue  # a thread or process that ended meanwhile
    return out


def saturation(args: argparse.Namespace, seed: int, out: Path) -> float:
    d = out / f"saturation_{seed}"
    subprocess.run([*CADENCE, "sim", "--workload", args.workload, "--num-requests", "400", "--rate", "1000",
                    "--seed", str(seed), "--profile", args.profile, "--out", str(d), "--num-threads", "1"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((d / "summary.json").read_text())["overall"]["request_throughput"]


def one_run(args: argparse.Namespace, seed: int, rate: float, out: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    steps_file = out / f"steps_{seed}_{rate:.3f}.jsonl"
    steps_file.unlink(missing_ok=True)
    cmd = [*CADENCE, "serve", "--num-threads", "1", "--port", str(args.port), "--record-steps", str(steps_file)]
    with served(cmd, url + "/ready", out / f"serve_{seed}_{rate:.3f}.log", cwd=ROOT, timeout=120) as proc:
        probe = probe_request_path(url, seed=seed)  # at idle, before the traffic (and its counters)
        m0, c0 = scrape(url), thread_cpu(proc.pid)
        r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        real = out / f"real_{seed}_{rate:.3f}"
        subprocess.run([*CADENCE, "bench", "--workload", args.workload, "--num-requests", str(args.num_requests),
                        "--rate", f"{rate:.4f}", "--seed", str(seed), "--base-url", url, "--no-progress",
                        "--out", str(real)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        m1, c1 = scrape(url), thread_cpu(proc.pid)
    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    summary = json.loads((real / "summary.json").read_text())["overall"]
    return {
        "seed": seed, "rate": rate, "wall_s": wall,
        "phases_s": {p: d[f"cadence:engine_thread_seconds_total:{p}"] for p in PHASES},
        "engine_busy_cpu_s": d["cadence:engine_thread_busy_cpu_seconds_total"],
        "steps": d["cadence:engine_steps_total"],
        "handoff_mean_s": d["cadence:engine_handoff_delay_seconds_total"] / max(d["cadence:engine_handoff_steps_total"], 1),
        "tokens_out": d["cadence:generation_tokens_total"], "tokens_in": d["cadence:prompt_tokens_total"],
        "server_thread_cpu_s": {k: c1[k] - c0.get(k, 0.0) for k in c1 if c1[k] - c0.get(k, 0.0) > 0.005},
        "client_cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "real": {m: summary[m] for m in ("ttft", "itl", "e2e")},
        "engine_side": {m: {f"p{q}": histogram_quantile(d, f"cadence:{name}_bucket", q / 100) for q in (50, 90, 99)}
                        for m, name in (("ttft", "time_to_first_token_seconds"),
                                        ("itl", "inter_token_latency_seconds"))},
        "request_path_probe": probe,
        "request_path": fit_request_path(probe, StepCostModel.load(args.profile)),
        "sim": simulate(args, seed, rate, out),
        "steps_vs_model": steps_vs_model(steps_file, args.profile),
    }


def steps_vs_model(path: Path, profile: str) -> dict[str, dict[str, float]]:
    """The recorded steps' measured time (the executor's: forward and sampling) against the cost
    model's prediction without the profile's serving overhead, by kind of step (the warm-up
    request's steps before the benchmark are included; they are few)."""
    from cadence.executor.cost_model import StepCostModel
    from cadence.executor.step_log import read_step_log

    model = StepCostModel.load(profile).steps_only()
    kinds: dict[str, list[tuple[float, float]]] = {}
    for f, actual in read_step_log(path):
        kind = "decodes" if not f.prefill_tokens else ("chunk + decodes" if f.decode_seqs else "chunks")
        kinds.setdefault(kind, []).append((actual, model.predict(f)))
        kinds.setdefault("all", []).append(kinds[kind][-1])
    out = {}
    for k, v in kinds.items():
        ratios = sorted(a / p for a, p in v)
        out[k] = {"steps": len(v), "actual_s": sum(a for a, _ in v), "predicted_s": sum(p for _, p in v),
                  **{f"ratio_p{q}": ratios[min(len(v) - 1, len(v) * q // 100)] for q in (10, 50, 90, 99)}}
    return out


def table(frac: float, r: dict) -> str:
    wall, ph = r["wall_s"], r["phases_s"]
    busy = sum(v for k, v in ph.items() if k != "idle")
    cpu = r["server_thread_cpu_s"]
    engine_cpu = cpu.get("cadence-engine", 0.0)
    http_cpu = cpu.get("python", 0.0)
    other = sum(v for k, v in cpu.items() if k not in ("cadence-engine", "python"))
    cores = os.cpu_count() or 1
    lines = [f"seed {r['seed']}, load {frac:.0%} ({r['rate']:.3f} req/s), {wall:.1f} s, {r['steps']:.0f} steps, "
             f"{r['tokens_out']:.0f} tokens out",
             "| engine thread | s | % of wall | per step (ms) |", "|---|---|---|---|"]
    for p in PHASES:
        lines.append(f"| {p} | {ph[p]:.2f} | {ph[p] / wall:.1%} | {1000 * ph[p] / max(r['steps'], 1):.2f} |")
    lines.append(f"| busy, of it on a core | {r['engine_busy_cpu_s']:.2f} of {busy:.2f} | "
                 f"{r['engine_busy_cpu_s'] / max(busy, 1e-9):.1%} on a core | |")
    lines += ["", "| CPU | s | share of the machine |", "|---|---|---|"]
    for name, v in (("engine thread", engine_cpu), ("HTTP thread", http_cpu), ("other server threads", other),
                    ("client (cadence bench)", r["client_cpu_s"])):
        lines.append(f"| {name} | {v:.2f} | {v / (wall * cores):.1%} |")
    lines.append(f"| all | {engine_cpu + http_cpu + other + r['client_cpu_s']:.2f} | "
                 f"{(engine_cpu + http_cpu + other + r['client_cpu_s']) / (wall * cores):.1%} |")
    sim = r["sim"]
    lines.append(f"\nhand-off to the HTTP thread: {1000 * r['handoff_mean_s']:.2f} ms a step")
    lines.append(f"engine busy {busy:.2f} s in {r['steps']:.0f} steps ({1000 * busy / max(r['steps'], 1):.2f} ms a step); "
                 f"simulated {sim['busy_s']:.2f} s in {sim['steps']} steps ({1000 * sim['busy_s'] / max(sim['steps'], 1):.2f} "
                 f"ms a step): sim/real busy {sim['busy_s'] / max(busy, 1e-9):.2f}")
    overhead = json.loads(Path(r["profile"]).read_text())["cost_model"].get("overhead", {})
    rows_per_step = scheduled_rows(r) / max(r["steps"], 1)
    modelled = overhead.get("per_step", 0.0) + overhead.get("per_seq", 0.0) * rows_per_step
    lines.append(f"engine outside the executor: {1000 * (busy - ph['execute']) / max(r['steps'], 1):.2f} ms a step "
                 f"measured; the profile's serving overhead charges {1000 * modelled:.2f} ms a step "
                 f"(at {rows_per_step:.1f} rows a step)")
    rp = r["request_path"]
    lines.append(f"request path at idle: {1000 * rp['per_request']:.2f} ms a request + "
                 f"{1e6 * rp.get('per_prompt_token', 0.0):.2f} us a prompt token")
    lines += ["", "| steps | count | measured s | modelled s | measured / modelled: sum | a step's p10 / p50 / p90 / p99 |",
              "|---|---|---|---|---|---|"]
    for kind, v in r["steps_vs_model"].items():
        lines.append(f"| {kind} | {v['steps']} | {v['actual_s']:.2f} | {v['predicted_s']:.2f} | "
                     f"{v['actual_s'] / max(v['predicted_s'], 1e-9):.2f} | "
                     + " / ".join(f"{v[f'ratio_p{q}']:.2f}" for q in (10, 50, 90, 99)) + " |")
    lines += ["", "| ms | client | engine side | simulated |", "|---|---|---|---|"]
    for m in ("ttft", "itl"):
        for q in ("p50", "p90", "p99"):
            eng = r["engine_side"][m][q]
            lines.append(f"| {m} {q} | {1000 * r['real'][m][q]:.1f} | {'n/a' if eng is None else f'{1000 * eng:.1f}'} "
                         f"| {1000 * sim[m][q]:.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="chat")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--fractions", default="0.3,0.6,0.85")
    p.add_argument("--seeds", default="0")
    p.add_argument("--port", type=int, default=8019)
    p.add_argument("--profile", default=str(ROOT / "src/cadence/sim/profiles/default.json"))
    p.add_argument("--out", default=str(ROOT / "results/breakdown"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        sat = saturation(args, seed, out)
        print(f"seed {seed}: simulated saturation {sat:.3f} req/s", flush=True)
        for frac in (float(f) for f in args.fractions.split(",")):
            r = one_run(args, seed, frac * sat, out)
            r["fraction"], r["profile"] = frac, args.profile
            runs.append(r)
            print(table(frac, r) + "\n", flush=True)
    (out / "breakdown.json").write_text(json.dumps({"workload": args.workload, "cpus": os.cpu_count(),
                                                    "load_average_end": os.getloadavg()[0], "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
