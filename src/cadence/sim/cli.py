"""`cadence sim`, `cadence sim plan` and `cadence calibrate`.

    cadence calibrate [--quick] [--out profile.json] [engine options]
    cadence sim --workload chat --rate 2 --num-requests 500 [--replicas 2 --router prefix-affinity] [--out DIR]
    cadence sim --trace traces/azure_llm_2023_conv.csv --rate-scale 5 --repeat 5
    cadence sim plan --trace traces/azure_llm_2023_code.csv --rate-scale 10 --slo ttft_p95=1.0

`sim` takes the workload and load options of `cadence bench` and the engine options of
`cadence serve`, and prints the same report.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cadence.cli import add_engine_args, engine_config_from_args
from cadence.config import EngineConfig
from cadence.routing import ROUTERS
from cadence.sim.fidelity import Validation, band
from cadence.sim.pd import DEFAULT_KV_TRANSFER_BANDWIDTH, DEFAULT_KV_TRANSFER_LATENCY_MS, PDOptions
from cadence.sim.profile import shipped_profile, shipped_profiles

_TARGET_DEFAULTS = dict(base_url="(simulated)", endpoint="completions", api_key=None, tokenizer="none",
                        request_timeout=600.0, no_exact_output=False, temperature=None, top_p=None, no_progress=True,
                        drain_timeout=60.0, rates=None, concurrencies=None)


def _add_sim_args(p: argparse.ArgumentParser) -> None:
    from cadence.bench.cli import add_load_args, add_workload_args

    add_engine_args(p, {"prefix_caching_hash_algo": "builtin"})  # (see sim_engine_config)
    add_workload_args(p)  # after the engine options: the workload's --seed wins (the sim has no weights to seed)
    add_load_args(p, sweep=False)
    g = p.add_argument_group("simulation")
    g.add_argument("--profile", default=None,
                   help="cost profile from `cadence calibrate`, or a shipped one by name: "
                        f"{', '.join(shipped_profiles())} (default: default)")
    g.add_argument("--rate-scale", type=float, default=1.0, help="replay trace timestamps this many times faster")
    g.add_argument("--repeat", type=int, default=1, help="replay the workload N times back to back (more requests)")
    g.add_argument("--replicas", type=int, default=None,
                   help="engines behind the router (default 1; `sim plan` searches the count itself)")
    g.add_argument("--spec-acceptance-rate", default=None, metavar="RATE[,RATE...]",
                   help="with --speculative-config: the rate drafts are accepted at, each given the ones before "
                        "it were; or per-position rates recorded from a run (accepted tokens per position over "
                        "verification rows, from /metrics); draws seeded by --seed")
    g.add_argument("--no-step-scatter", action="store_true",
                   help="price every step at its shape's mean, even with a profile that measured how served steps "
                        "scatter around it (`calibrate --from-served`; by default each step's time is drawn from "
                        "that scatter, seeded by --seed)")
    g.add_argument("--step-cost-scale", default=None, metavar="X",
                   help="each step's computing time X times the profile's, 0.1 to 10 (1.2: a machine 20%% slower "
                        "than when the profile was calibrated; the serving overhead and request path as they are): what-if "
                        "planning, or a recorded run simulated at the speed its steps ran (benchmarks/bench_fleet.py "
                        "--at-run-speed) (default 1)")
    g.add_argument("--spec-draft-ratio", type=_ratio, default=None, metavar="RATIO",
                   help="with a draft model (\"method\": \"draft_model\"): what its decode pass costs beside a served "
                        "decode step, as a number or a fraction (`cadence serve` takes their weight bytes: 0.69 for "
                        "make_draft's default draft of the default model); each step is charged the draft model's k decode passes "
                        "at that share of a served decode step, as `cadence serve` prices them")
    g.add_argument("--contended-overhead", default=None, metavar="MS[,MS]",
                   help="replicas sharing one machine's cores (--replicas 2 or more; not P/D, not `sim plan`): the "
                        "serving overhead a replica's step pays while the other replicas are busy, ms a step[,ms a "
                        "running request], in place of the profile's (MS alone keeps the profile's per running "
                        "request; a share of the difference while some are busy; benchmarks/bench_fleet.py measures "
                        "it through a fleet)")
    g.add_argument("--router", choices=ROUTERS, default="prefix-affinity",
                   help="how requests are spread (default %(default)s, as `cadence serve --replicas`); "
                        "with P/D, over the prefill replicas")
    d = p.add_argument_group("disaggregated prefill and decode")
    d.add_argument("--prefill-replicas", type=int, default=None,
                   help="a P/D fleet: replicas that compute prompts and first tokens (with --decode-replicas)")
    d.add_argument("--decode-replicas", type=int, default=None,
                   help="a P/D fleet: replicas that take the KV and decode (with --prefill-replicas)")
    d.add_argument("--kv-transfer-bandwidth", type=float, default=DEFAULT_KV_TRANSFER_BANDWIDTH, metavar="GB/S",
                   help="link from a prefill to a decode replica, GB/s (default %(default)g: 200 Gb/s)")
    d.add_argument("--kv-transfer-latency", type=float, default=DEFAULT_KV_TRANSFER_LATENCY_MS, metavar="MS",
                   help="fixed time per KV transfer, ms (default %(default)g)")
    p.set_defaults(**_TARGET_DEFAULTS)


def add_parser(subparsers: Any) -> None:
    """Register `sim` (with the `plan` action) and `calibrate` on the top-level CLI."""
    p = subparsers.add_parser("sim", help="simulate the engine on a workload (virtual time, no model)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              conflict_handler="resolve")
    _add_sim_args(p)
    r = p.add_argument_group("report")
    r.add_argument("--slo", action="append", default=[], metavar="KEY=SECONDS", help="goodput objective, as in bench")
    r.add_argument("--out", default=None, help="directory for summary.json, requests.jsonl and latency_cdf.png")
    r.add_argument("--label", default=None, help="name of this run in reports and comparisons")
    p.set_defaults(func=run_sim)
    sub = p.add_subparsers(dest="sim_action", metavar="{plan}")
    q = sub.add_parser("plan", help="fewest replicas (and engine options) meeting latency SLOs",
                       conflict_handler="resolve")
    _add_sim_args(q)
    q.add_argument("--slo", dest="objectives", action="append", default=[], metavar="METRIC_pQ=SECONDS",
                   help="objective, repeatable: e.g. ttft_p95=1.0, itl_p95=0.2")
    q.add_argument("--grid", action="append", default=[], metavar="OPTION=V1,V2",
                   help="engine option values to try, repeatable: max_num_seqs=32,64,128")
    q.add_argument("--max-replicas", type=int, default=64,
                   help="largest fleet to try before calling the objectives infeasible (default %(default)s)")
    q.add_argument("--max-error-rate", type=float, default=0.0, help="fraction of servable requests allowed to fail")
    q.add_argument("--label", default=None, help="name of this plan in its report")
    q.add_argument("--disaggregate", action="store_true",
                   help="also search P/D splits (prefill + decode replicas, over --kv-transfer-bandwidth and "
                        "--kv-transfer-latency) and say whether to disaggregate")
    q.set_defaults(func=run_plan, slo=[])

    c = subparsers.add_parser("calibrate", help="time real steps of the model and fit the simulator's cost profile")
    c.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="GGUF file or Hugging Face directory")
    add_engine_args(c)
    c.add_argument("--quick", action="store_true", help="a smaller sweep (about 30 s)")
    c.add_argument("--repeats", type=int, default=None, help="timed runs per shape (median; default 5, quick 2)")
    c.add_argument("--out", default="cadence_profile.json", help="profile to write (default %(default)s)")
    c.add_argument("--tiny", action="store_true", help="the tiny random-weight model (testing)")
    c.add_argument("--no-serve", action="store_true",
                   help="measure the engine's overhead in process instead of through `cadence serve` and a client")
    c.add_argument("--from-served", default=None, metavar="DIR[,DIR...]",
                   help="instead of timing anything, refit --profile on the served steps that "
                        "benchmarks/serving_breakdown.py kept in DIR (several: comma-separated, e.g. one "
                        "per workload; cadence.sim.served_fit)")
    c.add_argument("--profile", default=None, help="the profile --from-served refits (default: the shipped one)")
    c.set_defaults(func=run_calibrate)


# -- shared ---------------------------------------------------------------------------------------


def load_profile(path: str | None, args: argparse.Namespace):
    from cadence.executor.cost_model import StepCostModel

    # Every simulated replica would log its KV cache size; the report says what matters.
    logging.getLogger("cadence.engine.core").setLevel(logging.WARNING)
    from cadence.sim.profile import default_profile_path  # (not calibrate: that imports torch)

    shipped = shipped_profile(path) if path is not None and not Path(path).is_file() else None
    if path is not None and shipped is None and not Path(path).is_file():
        raise ValueError(f"--profile {path}: no such file or shipped profile (shipped: {', '.join(shipped_profiles())}; "
                         f"write one with `cadence calibrate --out {path}`)")
    try:
        model = StepCostModel.load(shipped or path or default_profile_path())
    except (ValueError, TypeError, AttributeError) as e:  # the loader's own messages name the file, mostly
        message = str(e) if isinstance(e, ValueError) else f"malformed profile ({e})"
        raise ValueError(message if path is None or message.startswith(str(path)) else f"{path}: {message}") from None
    try:  # the validation block is read after the run: a damaged one must fail before it
        Validation.from_profile(model.metadata)
    except ValueError as e:
        raise ValueError(f"{path or default_profile_path()}: {e}") from None
    if path is None and getattr(args, "model", None):
        raise ValueError("--model: the shipped profile is for the default model; run `cadence calibrate "
                         f"{args.model} --out p.json` and pass --profile p.json")
    return model


def check_sim_args(args: argparse.Namespace) -> None:
    """The simulation's own flags; a value out of range is an error, never quietly the default."""
    from cadence.bench.cli import refuse_sweep_options

    refuse_sweep_options(args, "`cadence sim plan`" if args.func is run_plan else "`cadence sim`")
    args.replicas_given = args.replicas is not None
    if args.replicas is None:
        args.replicas = 1
    if not (math.isfinite(args.rate_scale) and args.rate_scale > 0):
        raise ValueError(f"--rate-scale: must be > 0, got {args.rate_scale:g}")
    if args.repeat < 1:
        raise ValueError(f"--repeat: must be >= 1 (1 plays the workload once), got {args.repeat}")
    if args.replicas < 1:
        raise ValueError(f"--replicas: must be >= 1, got {args.replicas}")
    pd_options(args)  # (refuses a half-given or out-of-range P/D fleet)
    if not getattr(args, "trace", None):  # (a trace's length is known once it is read)
        _warn_long_run((getattr(args, "num_requests", None) or 0) * args.repeat)


# --step-cost-scale's range: a machine ten times slower or faster is another machine (calibrate it).
MIN_STEP_SCALE, MAX_STEP_SCALE = 0.1, 10.0

# Above this many requests a run takes minutes: say so before the first of them is built.
LONG_RUN_REQUESTS = 1_000_000
REQUESTS_PER_MINUTE = 100_000  # one core, docs/simulator.md's Scale


def _warn_long_run(n: int) -> None:
    if n > LONG_RUN_REQUESTS:
        print(f"note: {n:,} requests (the workload x --repeat): the simulator runs about "
              f"{REQUESTS_PER_MINUTE:,} a minute on one core, so expect {n / REQUESTS_PER_MINUTE:,.0f} minutes "
              "or more, and memory for every request", file=sys.stderr, flush=True)


def pd_options(args: argparse.Namespace) -> PDOptions | None:
    """The P/D fleet the flags ask for; None for a colocated one."""
    p, d = args.prefill_replicas, args.decode_replicas
    if p is None and d is None:
        return None
    if p is None or d is None:
        given, missing = ("--prefill-replicas", "--decode-replicas") if d is None else ("--decode-replicas", "--prefill-replicas")
        raise ValueError(f"{given}: a P/D fleet needs {missing} too")
    if getattr(args, "replicas_given", False):
        raise ValueError("--replicas: give either --replicas (colocated) or --prefill-replicas and --decode-replicas")
    try:
        return PDOptions(p, d, args.kv_transfer_bandwidth, args.kv_transfer_latency).validate()
    except ValueError as e:
        name, _, msg = str(e).partition(": ")
        raise ValueError(f"--{name.replace('_', '-')}: {msg}") from None


def prepare_workload(args: argparse.Namespace):
    """The workload exactly as `cadence bench` would send it, then --rate-scale and --repeat."""
    from cadence.bench.cli import config_from_args
    from cadence.sim.workloads import repeat_workload
    from cadence.workload import assign_arrivals

    check_sim_args(args)
    args.time_scale = args.time_scale / args.rate_scale
    cfg = config_from_args(args)  # bench's own parsing: same workloads, scaling and arrivals
    # Unlike bench (first 200 unless --num-requests), a trace is replayed whole: capacity questions
    # are about the whole forecast. Built-in workloads already hold bench's request count.
    assert cfg.workload is not None
    w = assign_arrivals(cfg.workload, cfg.arrival, cfg.rate, cfg.seed, cfg.burstiness)
    if args.rate_scale != 1.0:
        w = w.with_note(f"trace timestamps x{1 / args.rate_scale:g} (--rate-scale {args.rate_scale:g})")
    if cfg.duration is not None:
        w = replace(w, requests=tuple(r for r in w.requests if (r.arrival_time or 0.0) <= cfg.duration))
    if args.repeat > 1:
        if getattr(args, "trace", None):
            _warn_long_run(len(w.requests) * args.repeat)
        w = repeat_workload(w, args.repeat)
    return w, cfg


def _sim_options(args: argparse.Namespace, cfg: Any):
    from cadence.executor.cost_model import SpecAcceptance
    from cadence.sim.simulator import SimOptions

    closed = cfg.arrival == "none"
    rate = getattr(args, "spec_acceptance_rate", None)
    return SimOptions(replicas=args.replicas, router=args.router, max_model_len=args.max_model_len,
                      seed=args.seed, concurrency=cfg.concurrency, closed_loop=closed,
                      spec_acceptance=None if rate is None else SpecAcceptance.parse(rate),
                      spec_draft_ratio=getattr(args, "spec_draft_ratio", None),
                      contended_overhead=parse_contended(getattr(args, "contended_overhead", None)))


MAX_CONTENDED_MS = 10_000.0  # a step's serving overhead beyond 10 s is no overhead but a typo


def parse_contended(text: str | None) -> tuple[float, float | None] | None:
    """--contended-overhead: "6.0" (ms a step; the profile's per running request) or "6.0,0.2"
    (and ms a running request), in seconds; None for None."""
    if text is None:
        return None
    try:
        values = [float(x) / 1000 for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(math.isfinite(v) and 0 <= v <= MAX_CONTENDED_MS / 1000 for v in values):
        raise ValueError(f"--contended-overhead: expected MS or MS,MS, each 0 to {MAX_CONTENDED_MS:g} ms, got {text!r}")
    return values[0], values[1] if len(values) == 2 else None


def _contended_line(opts: Any, model: Any) -> str | None:
    """What `--contended-overhead` priced, for the printed notes and summary.json."""
    co = opts.contended_overhead
    if co is None:
        return None
    per_seq = co[1] if co[1] is not None else model.overhead.get("per_seq", 0.0)
    return (f"replicas contend for cores: {co[0] * 1e3:.3g} ms a step + {per_seq * 1e3:.3g} ms a running request "
            "while the others compute, the profile's overhead alone (--contended-overhead)")


def _ratio(text: str) -> float:
    """--spec-draft-ratio: "0.133" or "4/30"."""
    num, sep, den = text.partition("/")
    try:
        value = float(num) / float(den) if sep else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a number or a fraction such as 4/30, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


# -- sim ------------------------------------------------------------------------------------------


def sim_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options as `cadence serve` reads them, but for one default: prefix-cache blocks
    are keyed by Python's `hash()` unless `--prefix-caching-hash-algo` says otherwise. The
    simulated prompts are synthetic and no client can aim at a collision, and the scheduler's
    decisions depend only on which blocks are equal, so SHA-256 would buy nothing but its cost
    (about 6% of a 100,000-request run)."""
    engine_cfg = engine_config_from_args(args)
    if engine_cfg.cache.kv_cache_memory_fraction is not None:
        raise ValueError("--kv-cache-memory-fraction: a share of this machine's memory says nothing of the "
                         "simulated one; give --kv-cache-memory or --num-kv-blocks")
    if getattr(args, "prefix_caching_hash_algo", None) is None:
        engine_cfg = engine_cfg.replace(prefix_caching_hash_algo="builtin")
    return engine_cfg


def run_sim(args: argparse.Namespace) -> int:
    from cadence.bench import report
    from cadence.bench.client import BenchResult, write_outputs
    from cadence.sim.simulator import Simulator

    model, scatter_line = sim_profile(args)
    engine_cfg = sim_engine_config(args)
    workload, cfg = prepare_workload(args)
    opts = _sim_options(args, cfg)
    pd = pd_options(args)
    if opts.contended_overhead is not None and (pd is not None or opts.replicas < 2):
        raise ValueError("--contended-overhead: prices replicas contending for one machine's cores: it needs "
                         "--replicas 2 or more (not a P/D fleet)")
    contended = _contended_line(opts, model)
    if contended:
        print(contended, flush=True)
    if pd is None:
        res = Simulator(engine_cfg, model, opts).run(workload)
    else:
        from cadence.sim.disagg import PDSimulator

        res = PDSimulator(engine_cfg, model, opts, pd).run(workload)
    meta = {"label": args.label, "simulated": True, "model": model.metadata.get("model"),
            "workload": workload.name, "arrival": cfg.arrival, "rate": report.json_rate(cfg.rate),
            "burstiness": cfg.burstiness, "concurrency": cfg.concurrency, "num_requests": cfg.num_requests,
            "duration": cfg.duration, "seed": args.seed, **cfg.workload_settings,
            "replicas": opts.replicas, "router": opts.router, "profile": _profile_line(model),
            "step_cost_scale": model.metadata.get("step_cost_scale", 1.0),
            "notes": [*workload.notes, _sim_note(res, model), *res.notes, *([scatter_line] if scatter_line else []),
                      *([contended] if contended else [])],
            "replica_stats": [{"index": r.index, "requests": r.requests, "steps": r.steps, "busy_s": r.busy_s,
                               "preemptions": r.preemptions, "prefix_cache_query_tokens": r.prefix_cache_queries,
                               "prefix_cache_hit_tokens": r.prefix_cache_hits} for r in res.replicas]}
    if res.routing:
        meta["routing_decisions"] = res.routing
    if pd is not None:  # (a colocated report stays as it was)
        meta["replicas"] = pd.prefill_replicas + pd.decode_replicas
        for row, pool in zip(meta["replica_stats"], res.pools, strict=True):
            row["pool"] = pool
        meta["disaggregated"] = res.transfers
    validation = Validation.from_profile(model.metadata)
    if validation is not None:
        meta["fidelity"] = validation.describe()
    summary = report.summarize(res.records, cfg.slos, meta)
    print(report.format_table(summary))
    print(_replica_table(res))
    if any(res.routing.values()):
        print(_routing_line(opts.router, res.routing))
    if pd is not None:
        print(_transfer_line(res.transfers))
    print(_band_lines(summary, validation))
    if model.request_path:
        print(_request_path_line(model))
    if args.out:
        for f in write_outputs(BenchResult(res.records, summary, time.time()), args.out):
            print(f"wrote {f}")
    return 0 if summary["overall"]["completed"] else 1


def sim_profile(args: argparse.Namespace) -> tuple[Any, str | None]:
    """--profile as the simulation prices steps: at --step-cost-scale, with or without its scatter
    (`with_scatter_choice`); the line that says so (None: nothing to say)."""
    scale = step_cost_scale(getattr(args, "step_cost_scale", None))
    model = load_profile(args.profile, args)
    model, line = with_scatter_choice(model.with_step_scale(scale), args)
    if scale != 1.0:
        scaled = f"step costs: {scale:g} times the profile's (--step-cost-scale)"
        line = scaled if line is None else f"{line}; {scaled}"
    return model, line


def step_cost_scale(text: str | None) -> float:
    """--step-cost-scale: a number from MIN_STEP_SCALE to MAX_STEP_SCALE (None: 1)."""
    if text is None:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and MIN_STEP_SCALE <= value <= MAX_STEP_SCALE):
        raise ValueError(f"--step-cost-scale: expected a number from {MIN_STEP_SCALE:g} to {MAX_STEP_SCALE:g} "
                         f"(times the profile's step times), got {text!r}")
    return value


def with_scatter_choice(model: Any, args: argparse.Namespace) -> tuple[Any, str | None]:
    """The profile as `--no-step-scatter` asks (without its scatter), and the line that says which
    (None for a profile without one)."""
    scatter = model.step_scatter
    if scatter is None:
        return model, None
    if getattr(args, "no_step_scatter", False):
        return replace(model, step_scatter=None), "step scatter: off (--no-step-scatter): every step at its mean"
    return model, _scatter_line(model)


def _scatter_line(model: Any) -> str:
    """The profile's step-time scatter and where it was measured."""
    return f"{model.step_scatter.describe()} ({model.metadata.get('step_scatter_source', 'measured')})"


def _request_path_line(model: Any) -> str:
    """The profile's request path: what each simulated request waits before its engine sees it."""
    return (f"request path ({model.metadata.get('request_path_source', 'measured')}): "
            f"{model.request_delay * 1e3:.2f} ms a request + {model.request_delay_per_token * 1e6:.2f} us "
            "a prompt token")


def _band_lines(summary: dict, validation: Validation | None) -> str:
    """Where the real percentiles likely lie, from the profile's validation (sim/real spread)."""
    if validation is None:
        return ("fidelity: the profile carries no validation, so no error band "
                "(benchmarks/sim_fidelity.py --record-validation measures one)")
    lines = [f"fidelity: {validation.describe()}", "real likely (from the 10th-90th percentile of sim/real):"]
    for metric in ("ttft", "itl", "e2e"):
        cells = []
        for q in (50, 90, 99):
            value = summary["overall"][metric].get(f"p{q}")
            spread = validation.spread_for(metric, q)
            if value is None or spread is None:
                continue
            lo, hi = band(value, spread)
            cells.append(f"p{q} {value * 1e3:.0f} ms -> {lo * 1e3:.0f}-{hi * 1e3:.0f} ms")
        if cells:
            lines.append(f"  {metric:<5}" + "; ".join(cells))
    return "\n".join(lines)


def _profile_line(model: Any) -> str:
    m = model.metadata
    if m.get("synthetic"):
        return f"{m.get('model')} {m.get('dtype')} on {m.get('device')}: synthetic, roofline arithmetic, not measured"
    cpu = (m.get("machine") or {}).get("cpu", "?")
    return f"{m.get('model')} {m.get('dtype')} on {m.get('device')} ({cpu}), held-out error {model.fit_report.get('heldout_mape', float('nan')):.1%}"


def _sim_note(res: Any, model: Any) -> str:
    return (f"simulated in {res.wall_s:.1f}s ({res.steps} steps, {res.virtual_s:.1f} virtual s) with the cost profile "
            f"of {_profile_line(model)}")


def _replica_table(res: Any) -> str:
    """One row per replica; a P/D fleet's rows name their pool."""
    w = 9 if res.pools else 0
    pools = res.pools or [""] * len(res.replicas)
    lines = [f"{'replica':<8}{'pool' if w else '':<{w}}{'requests':>9}{'steps':>9}{'busy':>8}{'preempt':>9}{'prefix hit':>11}"]
    for r, pool in zip(res.replicas, pools, strict=True):
        util = r.busy_s / res.virtual_s if res.virtual_s else 0.0
        hit = r.prefix_cache_hits / r.prefix_cache_queries if r.prefix_cache_queries else 0.0
        lines.append(f"{r.index:<8}{pool:<{w}}{r.requests:>9}{r.steps:>9}{util:>8.0%}{r.preemptions:>9}{hit:>11.0%}")
    return "\n".join(lines)


def _routing_line(router: str, decisions: dict[str, int]) -> str:
    """What decided the router's choices, as the fleet's cadence:fleet_routed_requests_total counts them."""
    if set(decisions) == {"load"}:
        how = "in turn" if router == "round-robin" else "to the least loaded"
        return f"routing ({router}): {decisions['load']} requests {how}"
    words = {"prefix": "to a replica with the longest cached prefix", "diverted": "diverted by load",
             "unbalanced": "to the least loaded (fleet unbalanced)", "no-prefix": "with no cached prefix anywhere"}
    return f"routing ({router}): " + ", ".join(f"{decisions.get(k, 0)} {w}" for k, w in words.items())


def _transfer_line(t: dict[str, Any]) -> str:
    """A P/D fleet's KV transfers in two lines."""
    return (f"KV transfers: {t['transfers']} ({t['bytes_total'] / 1e9:.2f} GB, {t['bytes_mean'] / 1e6:.1f} MB each on "
            f"average) at {t['kv_transfer_bandwidth_gbps']:g} GB/s + {t['kv_transfer_latency_ms']:g} ms; time per request "
            f"p50 {t['seconds_p50'] * 1e3:.1f} ms, p99 {t['seconds_p99'] * 1e3:.1f} ms\n"
            f"decode admission: {t['waited_for_decode_admission']} waited for KV blocks "
            f"(p95 {t['decode_admission_wait_p95_s'] * 1e3:.0f} ms); {t['resident_blocks_skipped']} blocks already "
            f"on the decode replica were not sent")


# -- plan -----------------------------------------------------------------------------------------


def _parse_grid(specs: list[str]) -> dict[str, list[Any]]:
    from cadence.config import engine_option_fields

    kinds = {f.name: str(f.type) for _, f in engine_option_fields()}
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in kinds:
            raise ValueError(f"--grid {spec!r}: expected OPTION=V1,V2 with OPTION an engine option")
        kind = kinds[name]
        cast = _parse_bool if kind.startswith("bool") else int if kind.startswith("int") else \
            float if kind.startswith("float") else str
        try:
            grid[name] = [cast(v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            word = "true or false" if cast is _parse_bool else f"{cast.__name__} values"
            raise ValueError(f"--grid {spec!r}: {name} takes {word}") from None
        if not grid[name]:
            raise ValueError(f"--grid {spec!r}: no values to try (expected OPTION=V1,V2)")
    # Each value must make a valid config on its own: refuse a bad one now, not mid-plan.
    for name, tried in grid.items():
        for v in tried:
            try:
                EngineConfig.from_options(**{name: v})
            except ValueError as e:
                raise ValueError(f"--grid {name}={v}: {e}") from None
    return grid


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


def run_plan(args: argparse.Namespace) -> int:
    from cadence.sim.plan import Objective, format_header, format_plan, format_trial, plan

    if args.replicas is not None:
        raise ValueError("--replicas: `cadence sim plan` searches the number of replicas itself; "
                         "give --max-replicas N to bound it (or use `cadence sim --replicas N`)")
    if args.contended_overhead is not None:
        raise ValueError("--contended-overhead: `cadence sim plan` sizes fleets of replicas on machines of their own; "
                         "give it to `cadence sim --replicas N` to simulate replicas sharing one machine's cores")
    for flag in ("prefill_replicas", "decode_replicas"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')}: `cadence sim plan --disaggregate` searches the split itself "
                             "(or use `cadence sim --prefill-replicas P --decode-replicas D`)")
    link = None
    if args.disaggregate:
        try:
            link = PDOptions(1, 1, args.kv_transfer_bandwidth, args.kv_transfer_latency).validate()
        except ValueError as e:
            name, _, msg = str(e).partition(": ")
            raise ValueError(f"--{name.replace('_', '-')}: {msg}") from None
    objectives = [Objective.parse(s) for s in args.objectives]
    if not objectives:
        raise ValueError("--slo: give at least one objective, e.g. --slo ttft_p95=1.0")
    grid = _parse_grid(args.grid)
    if args.max_replicas < 1:
        raise ValueError(f"--max-replicas: must be >= 1, got {args.max_replicas}")
    if not (0.0 <= args.max_error_rate <= 1.0):
        raise ValueError(f"--max-error-rate: must be a fraction in [0, 1], got {args.max_error_rate:g}")
    model, scatter_line = sim_profile(args)
    engine_cfg = sim_engine_config(args)
    if link is not None and not engine_cfg.cache.enable_prefix_caching:
        raise ValueError("--disaggregate: a decode replica takes the transferred KV as prefix-cache blocks; "
                         "P/D needs prefix caching on")
    workload, cfg = prepare_workload(args)
    print(f"planning for {len(workload)} requests of {workload.name}; " + "; ".join(workload.notes[-2:]), flush=True)
    if scatter_line:
        print(scatter_line, flush=True)
    print(format_header(objectives), flush=True)  # each row is printed once, as it is tried
    result = plan(workload, engine_cfg, model, objectives, grid=grid, router=args.router,
                  max_replicas=args.max_replicas, max_model_len=args.max_model_len, seed=args.seed,
                  max_error_rate=args.max_error_rate, disaggregate=link,
                  spec_acceptance=_sim_options(args, cfg).spec_acceptance,
                  spec_draft_ratio=args.spec_draft_ratio,
                  progress=lambda t: print(format_trial(t, objectives), flush=True))
    print(format_plan(result, with_table=False))
    return 0 if result.best is not None or result.pd_best is not None else 1


# -- calibrate ------------------------------------------------------------------------------------


def run_calibrate(args: argparse.Namespace) -> int:
    if args.from_served is not None:
        return _refit_from_served(args)
    from cadence.host_load import busy_warning
    from cadence.sim.calibrate import calibrate

    if args.model_path and args.model is None:
        args.model = args.model_path
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    out_dir = Path(args.out).parent
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {args.out}: {out_dir} is not a directory")
    busy = busy_warning("calibrate on a quiet machine")
    if busy:
        print(busy, flush=True)
    model = calibrate(engine_config_from_args(args), tiny=args.tiny, quick=args.quick, repeats=args.repeats,
                      served=not args.no_serve, serve_log=str(Path(args.out).with_suffix(".serve.log")))
    return _report_fit(model, model.save(Path(args.out)))


def _refit_from_served(args: argparse.Namespace) -> int:
    from cadence.sim.served_fit import refit

    base = load_profile(args.profile, args)
    model = refit(base, [d for d in args.from_served.split(",") if d])
    r = model.metadata["served_refit"]
    print(f"refitted on {r['sweep_steps']} calibration steps and {r['served_steps']} served steps "
          f"from {args.from_served}")
    return _report_fit(model, model.save(Path(args.out)))


def _report_fit(model: Any, path: Path) -> int:
    fit = model.fit_report
    splits = fit.get("num_splits", 1)
    over = f", mean of {splits} random splits" if splits > 1 else ""
    print(f"feature set {fit['chosen']}: held-out error (MAPE) {fit['heldout_mape']:.1%} on {fit['num_heldout']} "
          f"of {fit['num_samples']} steps{over}; training {fit['train_mape']:.1%}")
    for name, c in fit["candidates"].items():
        print(f"  {name:<16} held-out {c['heldout_mape']:.1%}  training {c['train_mape']:.1%}")
    ov = model.overhead
    print(f"overhead ({model.metadata['overhead_source']}): {ov['per_step'] * 1e3:.2f} ms/step + "
          f"{ov['per_seq'] * 1e3:.3f} ms per running request")
    if model.request_path:
        print(_request_path_line(model))
    if model.step_scatter is not None:
        print(_scatter_line(model))
    print(f"wrote {path}")
    return 0

