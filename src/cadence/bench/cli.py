"""`cadence bench`: run one benchmark, sweep a load axis, or compare two reports.

    cadence bench [run] --rate 4 --num-requests 200 --slo ttft=0.5 --out results/a
    cadence bench sweep --rates 1,2,4,8 --out results/sweep
    cadence bench compare results/a/summary.json results/b/summary.json
    cadence bench compare results/sweep-a results/sweep-b --out results/ab   # two sweeps, one plot

`python -m cadence.bench.cli ...` does the same as `cadence bench ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from cadence.bench import report
from cadence.bench.client import (
    BenchConfig,
    BenchResult,
    auth_headers,
    first_model_id,
    listed_model_ids,
    request_count,
    run_benchmark,
)
from cadence.host_load import busy_warning
from cadence.workload import (
    ARRIVALS,
    BUILTIN_WORKLOADS,
    Scaling,
    Workload,
    WorkloadRequest,
    builtin_workload,
    load_trace,
    read_jsonl,
    scale_workload,
    write_jsonl,
)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _rate(text: str) -> float:
    """A rate in requests/s; `inf` (vLLM's default) sends every request at once."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests/s (or inf), got {text!r}") from None


ENDPOINT_ALIASES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # vLLM's --endpoint


def _endpoint(text: str) -> str:
    return ENDPOINT_ALIASES.get(text.rstrip("/"), text)


def server_root(url: str) -> str:
    """The server's root URL: a trailing /v1 (the OpenAI client's base_url habit) is dropped, since
    the benchmark adds /v1/... (and /tokenize) itself."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help=f"OpenAI-compatible server (default {DEFAULT_BASE_URL}; or vLLM's --host/--port); "
                        "a URL ending in /v1 is taken as the server's root")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--endpoint", type=_endpoint, choices=("completions", "chat"), default="completions",
                   help="completions (or /v1/completions) or chat (or /v1/chat/completions) (default %(default)s)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--tokenizer", default="auto",
                   help="auto: the server's /tokenize, else estimate; none: estimate 4 chars/token; "
                        "or a tokenizer.json (or a directory holding one) (default %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default %(default)s)")
    g.add_argument("--no-exact-output", action="store_true",
                   help="do not send ignore_eos/min_tokens: let the model stop where it likes")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling's top_p (default: the server's)")
    g.add_argument("--structured-fraction", type=float, default=None,
                   help="send this fraction of the requests (chosen by --seed) with a response_format: the "
                        "built-in extraction JSON schema, or --response-format's (default 0, or 1 with "
                        "--response-format)")
    g.add_argument("--response-format", default=None, metavar="FILE",
                   help="a JSON file holding the response_format object the structured requests send "
                        '(e.g. {"type": "json_schema", "json_schema": {"name": ..., "schema": ...}})')


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=BUILTIN_WORKLOADS, default=None, help="built-in mix (default chat)")
    src.add_argument("--trace", default=None, help="Azure LLM CSV or Mooncake JSONL trace")
    src.add_argument("--requests-file", default=None, help="workload JSONL: one request per line")
    g.add_argument("--num-requests", "--num-prompts", type=int, default=None, help="send at most this many requests")
    g.add_argument("--duration", type=float, default=None, help="stop sending new requests after SECONDS")
    g.add_argument("--seed", type=int, default=0, help="seeds workloads, arrivals and prompt text (default 0)")
    g.add_argument("--scale-lengths", type=float, default=1.0, help="multiply prompt lengths (and prefix blocks)")
    g.add_argument("--scale-output", type=float, default=1.0, help="multiply output lengths")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="clamp prompt lengths after scaling")
    g.add_argument("--max-output-tokens", type=int, default=None, help="clamp output lengths after scaling")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace timestamps: 0.1 replays ten times faster (default 1)")
    g.add_argument("--save-workload", default=None, help="also write the prepared workload as JSONL")


def add_load_args(p: argparse.ArgumentParser, sweep: bool = True) -> None:
    """The load options; `sweep` False (cadence sim) hides --rates/--concurrencies, which are then
    refused by name (see `refuse_sweep_options`)."""
    g = p.add_argument_group("load")
    g.add_argument("--arrival", choices=ARRIVALS, default=None,
                   help="default: gamma with --burstiness, poisson with --rate, none (closed loop) with only "
                        "--concurrency, trace with --trace; with none of them every request at once (rate inf)")
    g.add_argument("--rate", "--request-rate", type=_rate, default=None,
                   help="offered load, requests/s (open loop); inf (the default without --concurrency or "
                        "--trace): every request at time 0")
    g.add_argument("--burstiness", type=float, default=None,
                   help="gamma arrivals of this shape, as vLLM's: 1 = Poisson, < 1 burstier, > 1 smoother "
                        "(needs --rate; selects --arrival gamma)")
    g.add_argument("--concurrency", "--max-concurrency", type=int, default=None,
                   help="closed loop: N users; open loop: at most N requests in flight")
    hidden = None if sweep else argparse.SUPPRESS
    g.add_argument("--rates", type=_floats, default=None, help=hidden or "`sweep` only: comma-separated rates")
    g.add_argument("--concurrencies", type=_floats, default=None,
                   help=hidden or "`sweep` only: comma-separated user counts")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="after the last send, seconds to wait for requests in flight (default %(default)s)")


def add_parser(subparsers) -> None:
    """Register `bench` on an argparse subparsers object (the top-level CLI calls this)."""
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # No `choices` here: a stray value (after an unknown option) would be reported as an invalid
    # action; `run` names it instead, after argparse has reported any unknown option.
    p.add_argument("action", nargs="?", default="run", help="run (default), sweep or compare")
    p.add_argument("files", nargs="*", help="compare: two summary.json files (or run directories)")
    _add_target_args(p)
    add_workload_args(p)
    add_load_args(p)
    g = p.add_argument_group("report")
    g.add_argument("--slo", action="append", default=[], metavar="KEY=SECONDS",
                   help=f"goodput objective, repeatable; KEY in {', '.join(report.SLO_KEYS)}")
    g.add_argument("--out", default=None, help="directory for summary.json, requests.jsonl and PNG plots")
    g.add_argument("--label", default=None, help="name of this run in reports and comparisons")
    g.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bar")
    _add_vllm_args(p)
    p.set_defaults(func=run)


def _add_vllm_args(p: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s spellings, where they mean the same (docs/benchmarking.md lists them).
    --request-rate, --num-prompts and --max-concurrency are aliases of --rate, --num-requests and
    --concurrency above."""
    g = p.add_argument_group("vLLM's `vllm bench serve` spellings")
    g.add_argument("--host", default=None, help="with --port: the server at http://HOST:PORT")
    g.add_argument("--port", type=int, default=None, help="with --host: the server at http://HOST:PORT")
    g.add_argument("--dataset-name", choices=("random",), default=None,
                   help="random: prompts of --random-input-len tokens asking for --random-output-len")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="random dataset: prompt tokens (default %(default)s)")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="random dataset: output tokens (default %(default)s)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L (1 - r), L (1 + r)] (default %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (cadence bench does by default; refused with --no-exact-output)")
    g.add_argument("--percentile-metrics", default=None,
                   help=f"also print percentiles of these, comma-separated: {','.join(report.VLLM_METRICS)}")
    g.add_argument("--metric-percentiles", default=None, help="the percentiles to print, e.g. 25,50,99")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in milliseconds, e.g. ttft:500 tpot:50 (e2el = e2e); as --slo")
    g.add_argument("--save-result", action="store_true",
                   help="write the report (as --out; to --result-dir, default results/bench-<time>)")
    g.add_argument("--result-dir", default=None, help="with --save-result: the directory")
    g.add_argument("--result-filename", default=None, help="with --save-result: also the summary under this name")


def _resolve_vllm_args(args: argparse.Namespace) -> None:
    """Fold vLLM's spellings into cadence's options, refusing combinations that contradict."""
    host, port = getattr(args, "host", None), getattr(args, "port", None)
    if host is not None or port is not None:
        if args.base_url is not None:
            raise ValueError("--host/--port: give either them or --base-url, not both")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"--port: must be in 1..65535, got {port}")
        args.base_url = f"http://{host or '127.0.0.1'}:{port or 8000}"
    args.base_url = server_root(args.base_url or DEFAULT_BASE_URL)
    if getattr(args, "ignore_eos", False) and args.no_exact_output:
        raise ValueError("--ignore-eos and --no-exact-output contradict each other")
    if getattr(args, "dataset_name", None) and (args.workload or args.trace or args.requests_file):
        raise ValueError("--dataset-name: give it or one of --workload/--trace/--requests-file, not both")
    if getattr(args, "dataset_name", None):
        for flag in ("random_input_len", "random_output_len"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
        if not 0 <= args.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio: must be in [0, 1), got {args.random_range_ratio:g}")
    for spec in getattr(args, "goodput", None) or []:
        key, sep, ms = spec.partition(":")
        key = {"e2el": "e2e"}.get(key.strip().lower(), key.strip().lower())
        try:
            bound = float(ms) / 1000 if sep else math.nan
        except ValueError:
            bound = math.nan
        if key not in ("ttft", "tpot", "itl", "e2e") or not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"--goodput {spec!r}: expected KEY:MILLISECONDS with KEY in ttft, tpot, itl, e2el")
        args.slo.append(f"{key}={bound!r}")
    save = getattr(args, "save_result", False)
    result_dir = getattr(args, "result_dir", None)
    if (result_dir or getattr(args, "result_filename", None)) and not save:
        raise ValueError("--result-dir/--result-filename go with --save-result")
    if result_dir and args.out and Path(result_dir).resolve() != Path(args.out).resolve():
        raise ValueError(f"--result-dir {result_dir} and --out {args.out}: two different directories; give one")
    if save and args.out is None:
        args.out = result_dir or time.strftime("results/bench-%Y%m%d-%H%M%S")


def _percentile_request(args: argparse.Namespace) -> tuple[list[str], list[float]] | None:
    """--percentile-metrics / --metric-percentiles as (metric names as given, percentiles); None if
    neither."""
    metrics_text, pct_text = getattr(args, "percentile_metrics", None), getattr(args, "metric_percentiles", None)
    if metrics_text is None and pct_text is None:
        return None
    names = [m.strip() for m in (metrics_text or "ttft,tpot,itl").split(",") if m.strip()]
    unknown = [m for m in names if m not in report.VLLM_METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics: expected some of {','.join(report.VLLM_METRICS)}, got {metrics_text!r}")
    try:
        pcts = [float(q) for q in (pct_text or "99").split(",") if q.strip()]
    except ValueError:
        pcts = []
    if not pcts or not all(0 <= q <= 100 for q in pcts):
        raise ValueError(f"--metric-percentiles: expected numbers in [0, 100], got {pct_text!r}")
    return names, pcts


def _scaling(args: argparse.Namespace) -> Scaling:
    return Scaling(length_scale=args.scale_lengths, output_scale=args.scale_output,
                   max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                   time_scale=args.time_scale, limit=args.num_requests)


def _workload(args: argparse.Namespace, cfg: BenchConfig) -> Workload:
    if args.trace:
        return load_trace(args.trace, _scaling(args))
    if getattr(args, "dataset_name", None) == "random":
        return random_workload(args.num_requests or 1000, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
    if args.requests_file:
        return scale_workload(read_jsonl(args.requests_file), _scaling(args))
    w = builtin_workload(args.workload or "chat", request_count(cfg) or 200, args.seed)
    return scale_workload(w, replace(_scaling(args), limit=None))


def random_workload(n: int, input_len: int, output_len: int, ratio: float, seed: int) -> Workload:
    """vLLM's random dataset: lengths uniform in [L (1 - ratio), L (1 + ratio)], seeded."""
    rng = random.Random(f"random:{seed}")

    def length(base: int) -> int:
        return max(1, rng.randint(int(base * (1 - ratio)), int(base * (1 + ratio))))

    reqs = tuple(WorkloadRequest(prompt_tokens=length(input_len), output_tokens=length(output_len)) for _ in range(n))
    note = f"random: input {input_len}, output {output_len}, range ratio {ratio:g}, seed {seed}"
    return Workload("random", reqs, notes=(note,))


def _arrival(args: argparse.Namespace) -> str:
    """The arrival process the flags ask for. With no load at all, vLLM's default: request rate inf,
    every request at time 0 (at most --concurrency in flight, when a sweep's concurrencies are not given)."""
    burstiness = args.burstiness
    if args.arrival:
        if burstiness is not None and args.arrival in ("none", "trace"):
            raise ValueError(f"--burstiness: shapes the gaps of generated arrivals (--rate); not with --arrival {args.arrival}")
        if burstiness is not None and burstiness != 1 and args.arrival == "poisson":
            raise ValueError(f"--burstiness {burstiness:g} with --arrival poisson: Poisson arrivals are burstiness 1; "
                             "leave --arrival out (or give --arrival gamma)")
        return args.arrival
    if burstiness is not None:
        if args.rate is None and not args.rates:
            raise ValueError("--burstiness: shapes the gaps between arrivals at a rate: give --rate R")
        if args.rate == math.inf:
            raise ValueError("--burstiness: with --request-rate inf every request arrives at time 0; give a finite --rate")
        return "gamma"
    if args.rate is not None or args.rates:
        return "poisson"
    if args.concurrency is not None or args.concurrencies:
        return "none"
    if args.trace:
        return "trace"
    args.rate = math.inf  # vLLM's default: every request at once
    return "poisson"


def refuse_sweep_options(args: argparse.Namespace, command: str) -> None:
    """--rates/--concurrencies belong to `cadence bench sweep`; elsewhere they would run one point."""
    for flag, given in (("--rates", args.rates), ("--concurrencies", args.concurrencies)):
        if given:
            single = "--rate" if flag == "--rates" else "--concurrency"
            raise ValueError(f"{flag}: only with `cadence bench sweep`; {command} runs one load point: give {single}")


def _check_args(args: argparse.Namespace) -> None:
    """The numeric flags, named as typed, before anything connects or reads a file: a value that is
    out of range must not be taken for an absent one (--rate 0) or fail only once the load starts."""
    def bad(flag: str, why: str) -> ValueError:
        return ValueError(f"{flag}: {why}")

    def positive(flag: str, v: float | None) -> None:
        if v is not None and not (math.isfinite(v) and v > 0):
            raise bad(flag, f"must be > 0, got {v:g}")

    if args.rate != math.inf:  # inf: every request at once
        positive("--rate", args.rate)
    positive("--duration", args.duration)
    positive("--burstiness", args.burstiness)
    positive("--request-timeout", getattr(args, "request_timeout", None))
    positive("--scale-lengths", args.scale_lengths)
    positive("--scale-output", args.scale_output)
    positive("--time-scale", args.time_scale)
    for flag, v in (("--concurrency", args.concurrency), ("--num-requests", args.num_requests),
                    ("--max-prompt-tokens", args.max_prompt_tokens), ("--max-output-tokens", args.max_output_tokens)):
        if v is not None and v < 1:
            raise bad(flag, f"must be >= 1, got {v}")
    drain = getattr(args, "drain_timeout", None)
    if drain is not None and not (math.isfinite(drain) and drain >= 0):
        raise bad("--drain-timeout", f"must be >= 0 seconds, got {drain:g}")
    fraction = getattr(args, "structured_fraction", None)
    if fraction is not None and not (math.isfinite(fraction) and 0 <= fraction <= 1):
        raise bad("--structured-fraction", f"must be in [0, 1], got {fraction:g}")
    temperature = getattr(args, "temperature", None)
    if temperature is not None and not (math.isfinite(temperature) and 0 <= temperature <= 2):
        raise bad("--temperature", f"must be in [0, 2], got {temperature:g}")
    tokenizer = getattr(args, "tokenizer", "auto")
    if tokenizer not in ("auto", "none") and not Path(tokenizer).exists():
        raise bad("--tokenizer", f"{tokenizer}: no such file or directory (or give auto or none)")
    for flag in ("trace", "requests_file", "response_format"):
        path = getattr(args, flag, None)
        if path and not Path(path).is_file():
            raise bad("--" + flag.replace("_", "-"), f"{path}: no such file")


def workload_settings(args: argparse.Namespace) -> dict:
    """The options that change which requests are made, for the report's meta (and so for
    `compare`): the source file and every scaling, or the random dataset's lengths."""
    out: dict = {"workload_source": args.trace or args.requests_file, "scale_lengths": args.scale_lengths,
                 "scale_output": args.scale_output, "max_prompt_tokens": args.max_prompt_tokens,
                 "max_output_tokens": args.max_output_tokens, "time_scale": args.time_scale}
    if getattr(args, "dataset_name", None) == "random":
        out.update(random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                   random_range_ratio=args.random_range_ratio)
    return out


def read_response_format(path: str | None) -> dict | None:
    """--response-format's file: a response_format object of type json_object or json_schema."""
    if path is None:
        return None
    try:
        fmt = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--response-format: cannot read {path}: {e}") from None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    schema = fmt.get("json_schema") if isinstance(fmt, dict) else None
    # A json_schema beside json_object is refused by the server: every structured request would fail.
    if kind not in ("json_object", "json_schema") or isinstance(schema, dict) != (kind == "json_schema"):
        raise ValueError(f'--response-format: {path} must hold {{"type": "json_object"}} or {{"type": "json_schema", '
                         '"json_schema": {"name": ..., "schema": ...}}')
    return fmt


def _structured(args: argparse.Namespace) -> tuple[float, dict | None]:
    fmt = read_response_format(getattr(args, "response_format", None))
    fraction = getattr(args, "structured_fraction", None)
    if fraction is None:
        fraction = 1.0 if fmt is not None else 0.0
    return fraction, fmt


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    _resolve_vllm_args(args)
    _check_args(args)
    arrival = _arrival(args)
    structured_fraction, response_format = _structured(args)
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        arrival=arrival, rate=args.rate, burstiness=args.burstiness or 1.0, concurrency=args.concurrency,
        num_requests=args.num_requests, duration=args.duration, seed=args.seed, slos=report.parse_slos(args.slo),
        out_dir=args.out, tokenizer=args.tokenizer, request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout, force_output_lengths=not args.no_exact_output,
        temperature=args.temperature, top_p=args.top_p, progress=not args.no_progress, label=args.label,
        workload_settings=workload_settings(args), structured_fraction=structured_fraction,
        response_format=response_format,
    )
    if cfg.arrival in ("poisson", "gamma") and cfg.rate is None and args.rates:
        cfg.rate = max(args.rates)  # sizes the workload for the busiest point; each point sets its own
    # Before the workload is read or anything connects (a sweep's points each set their concurrency).
    placeholder = args.concurrencies and cfg.concurrency is None
    (replace(cfg, concurrency=1) if placeholder else cfg).validate()
    cfg.workload = _workload(args, cfg)
    if args.save_workload:
        write_jsonl(cfg.workload, args.save_workload)
    return cfg


PREFLIGHT_TIMEOUT_S = 30.0


def resolve_model(cfg: BenchConfig) -> None:
    """Ask the server for its model (unless --model names it) before any load, with a short
    timeout: a server that accepts connections but never answers, or a URL that is not an
    OpenAI-compatible server, is a clear error at once rather than a wait of --request-timeout
    or a KeyError."""
    url = cfg.base_url.rstrip("/") + "/v1/models"
    wait = min(cfg.request_timeout, PREFLIGHT_TIMEOUT_S)
    try:
        r = httpx.get(url, headers=auth_headers(cfg.api_key), timeout=httpx.Timeout(wait, connect=min(wait, 10.0)))
    except httpx.TimeoutException:
        raise ValueError(f"{url}: no answer within {wait:g} s (is the server up and serving HTTP?)") from None
    if not cfg.model:
        cfg.model = first_model_id(url, r)
        return
    # A name the server does not serve fails every request (and its /tokenize): say so before the load.
    names = listed_model_ids(r)
    if names is not None and cfg.model not in names:
        raise ValueError(f"--model {cfg.model!r}: {url} lists {', '.join(map(repr, names))}; give one of them "
                         "(or leave --model out to use the first)")


def _run_one(cfg: BenchConfig, args: argparse.Namespace, wanted: tuple[list[str], list[float]] | None) -> int:
    result = run_benchmark(cfg)
    print(report.format_table(result.summary))
    if wanted:
        names, pcts = wanted
        print(report.format_percentiles(result.records, [report.VLLM_METRICS[m] for m in names], pcts, names))
    name = getattr(args, "result_filename", None)
    if name and cfg.out_dir:  # vLLM's one result file: the summary, under the name asked for
        path = Path(cfg.out_dir) / name
        shutil.copyfile(Path(cfg.out_dir) / "summary.json", path)
        result.files.append(str(path))
    for f in result.files:
        print(f"wrote {f}")
    return 0 if result.summary["overall"]["completed"] else 1


def run_sweep(cfg: BenchConfig, loads: list[float], kind: str) -> list[tuple[float, BenchResult]]:
    """One run per load point: kind 'rate' (open loop, req/s) or 'concurrency' (closed loop users)."""
    points = []
    for x in loads:
        label = f"{kind}={x:g}"
        out = str(Path(cfg.out_dir) / label.replace("=", "_")) if cfg.out_dir else None
        if kind == "rate":
            point = replace(cfg, rate=x, label=label, out_dir=out)
        else:
            point = replace(cfg, arrival="none", concurrency=int(x), rate=None, label=label, out_dir=out)
        points.append((x, run_benchmark(point)))
    return points


def _sweep(args: argparse.Namespace, cfg: BenchConfig) -> int:
    if bool(args.rates) == bool(args.concurrencies):
        raise ValueError("sweep: give exactly one of --rates or --concurrencies")
    kind, loads = ("rate", args.rates) if args.rates else ("concurrency", args.concurrencies)
    if kind == "concurrency" and any(x != int(x) for x in loads):
        raise ValueError(f"--concurrencies: expected whole numbers of users, got {loads}")
    points = run_sweep(cfg, loads, kind)
    print(f"{kind:>12}{'req/s':>9}{'goodput':>9}{'tok/s':>9}{'p95 ttft ms':>13}{'p95 itl ms':>12}{'errors':>8}")
    for x, res in points:
        o = res.summary["overall"]
        row = [o["request_throughput"], o["goodput"], o["output_token_throughput"]]
        lat = [o["ttft"]["p95"], o["itl"]["p95"]]
        print(f"{x:>12g}" + "".join(f"{v:>9.2f}" if v is not None else f"{'n/a':>9}" for v in row)
              + "".join(f"{v * 1000:>13.1f}" if v is not None else f"{'n/a':>13}" for v in lat) + f"{o['errors']:>8}")
    if cfg.out_dir:
        from cadence.bench.plots import plot_sweep

        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"kind": kind, "points": [{"load": x, "summary": r.summary} for x, r in points]}
        (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
        label = "offered load (req/s)" if kind == "rate" else "concurrent users"
        plot_sweep([(x, r.summary) for x, r in points], out / "sweep.png", label, offered_diagonal=kind == "rate")
        print(f"wrote {out / 'sweep.json'}\nwrote {out / 'sweep.png'}")
    return 0


def _read_report(p: Path, key: str, what: str) -> dict:
    """A JSON report that must hold `key`; a clear one-line error otherwise."""
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"compare: cannot read {p}: {e}") from e
    if key not in doc:
        raise ValueError(f"compare: {p} is not {what}")
    return doc


def _run_dir(path: str) -> Path:
    """The directory of a run or sweep given as the directory itself or a file in it."""
    p = Path(path)
    return p if p.is_dir() else p.parent


def _load_summary(path: str) -> dict:
    p = Path(path)
    return _read_report(p / "summary.json" if p.is_dir() else p, "overall", "a benchmark summary")


def _load_sweep(path: str) -> dict | None:
    """A sweep.json (or a sweep's directory), or None when `path` is a single run."""
    p = Path(path)
    p = p / "sweep.json" if p.is_dir() else p
    if p.name != "sweep.json" or not p.exists():
        return None
    return _read_report(p, "points", "a sweep")


def _compare(files: list[str], out: str | None = None) -> int:
    if len(files) != 2:
        raise ValueError("compare: give two summary.json files (or run directories), or two sweeps")
    sweeps = [_load_sweep(f) for f in files]
    if all(sweeps):
        return _compare_sweeps(files, sweeps, out)  # type: ignore[arg-type]
    if any(sweeps):
        raise ValueError("compare: give two single runs or two sweeps, not one of each")
    a, b = (_load_summary(f) for f in files)
    la = a["meta"].get("label") or Path(files[0]).stem
    lb = b["meta"].get("label") or Path(files[1]).stem
    print(report.compare(a, b, la[:13], lb[:13]))
    for line in report.compare_warnings(a, b):
        print(line)
    runs = [(lbl, _records_beside(f)) for lbl, f in ((la, files[0]), (lb, files[1]))]
    if out and all(recs for _, recs in runs):
        from cadence.bench.plots import plot_latency_cdfs_compared

        Path(out).mkdir(parents=True, exist_ok=True)
        print(f"wrote {plot_latency_cdfs_compared(runs, Path(out) / 'latency_cdf_compare.png', f'{la} vs {lb}')}")
    return 0


def _records_beside(path: str) -> list[report.RequestRecord]:
    """The per-request records next to a run's summary.json, or [] when there are none."""
    jsonl = _run_dir(path) / "requests.jsonl"
    if not jsonl.exists():
        return []
    return [report.RequestRecord.from_dict(json.loads(line)) for line in jsonl.read_text().splitlines() if line]


def _compare_sweeps(files: list[str], sweeps: list[dict], out: str | None) -> int:
    """Per load point present in both: throughput and p95 latencies side by side; with --out, one
    plot of both sweeps on the same axes."""
    labels = [_run_dir(f).name for f in files]
    pts = [{p["load"]: p["summary"] for p in s["points"]} for s in sweeps]
    common = sorted(set(pts[0]) & set(pts[1]))
    if not common:
        raise ValueError("compare: the two sweeps share no load point")
    print(f"A = {labels[0]}, B = {labels[1]}; latencies in ms")
    print(f"{'load':>8} {'req/s A':>9} {'req/s B':>9} {'p95 TTFT A':>11} {'p95 TTFT B':>11} {'p95 ITL A':>10} {'p95 ITL B':>10}")
    def ms(o: dict, k: str, w: int) -> str:
        return f"{'n/a':>{w}}" if o[k]["p95"] is None else f"{o[k]['p95'] * 1000:>{w}.1f}"

    for x in common:
        oa, ob = pts[0][x]["overall"], pts[1][x]["overall"]
        print(f"{x:>8g} {oa['request_throughput']:>9.2f} {ob['request_throughput']:>9.2f} {ms(oa, 'ttft', 11)} "
              f"{ms(ob, 'ttft', 11)} {ms(oa, 'itl', 10)} {ms(ob, 'itl', 10)}")
    if out:
        from cadence.bench.plots import plot_sweeps

        Path(out).mkdir(parents=True, exist_ok=True)
        rate = sweeps[0]["kind"] == "rate"
        load_label = "offered load (req/s)" if rate else "concurrent users"
        series = [(lbl, [(p["load"], p["summary"]) for p in s["points"]]) for lbl, s in zip(labels, sweeps, strict=True)]
        path = plot_sweeps(series, Path(out) / "sweep_compare.png", load_label, offered_diagonal=rate)
        print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "compare":
            return _compare(args.files, args.out)
        if args.action not in ("run", "sweep"):
            raise ValueError(f"unknown action {args.action!r}: expected run, sweep or compare "
                             "(a value after an option that takes none?)")
        if args.files:
            raise ValueError(f"unexpected arguments {args.files}")
        if args.action == "run":
            refuse_sweep_options(args, "`cadence bench run`")
        wanted = _percentile_request(args)  # checked before the load, printed after it
        cfg = config_from_args(args)
        resolve_model(cfg)
        # The client's own timestamps suffer first (client_starvation in the report says so after the run).
        busy = busy_warning("run the client on a quiet machine, or on another one than the server")
        if busy:
            print(busy, flush=True)
        return _sweep(args, cfg) if args.action == "sweep" else _run_one(cfg, args, wanted)
    except (ValueError, OSError) as e:
        print(f"cadence bench: error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:  # before the load starts: no server, wrong URL, bad API key
        print(f"cadence bench: error: {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
