"""`cadence serve | generate | bench | sim | calibrate`.

Engine flags are derived from the config dataclasses (vLLM's spelling where vLLM has the knob),
so a new config field is a new flag with no other wiring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from cadence import chat_client
from cadence.config import (
    METRICS_COMPAT,
    OPTION_CHOICES,
    OPTION_HELP,
    EngineConfig,
    ServerConfig,
    engine_option_fields,
    parse_human_int,
)
from cadence.config import parse_size as config_parse_size
from cadence.request import SamplingParams
from cadence.wording import counted


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    try:
        return config_parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_count(text: str) -> int:
    """'32k' -> 32000, '32K' -> 32768, '4096' -> 4096 (vLLM's human-readable integers)."""
    try:
        return parse_human_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# vLLM's names of engine options, accepted beside cadence's (OPTION_HELP says what each means here).
FLAG_ALIASES = {"kv_cache_memory_fraction": ("--gpu-memory-utilization",)}


def parse_pairs(text: str) -> tuple[tuple[str, float], ...]:
    """'alice=2,bob=1' -> (('alice', 2.0), ('bob', 1.0))."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out.append((name, float(value)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT[,NAME=WEIGHT...], got {part!r}") from None
    return tuple(out)


def parse_list(text: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c'] (empty items dropped)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, shown_defaults: dict[str, Any] | None = None) -> None:
    """One flag per engine option; defaults stay None so only what the user typed overrides the config.
    `shown_defaults`: what the help should say where the command's default is not the config's."""
    group = parser.add_argument_group("engine options")
    shown = shown_defaults or {}
    for _section, f in engine_option_fields():
        kind = str(f.type)
        default = readable_default(f.name, shown.get(f.name, f.default))
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": f"{OPTION_HELP[f.name]} (default: {default})"}
        if f.name in OPTION_CHOICES:
            kw["choices"] = OPTION_CHOICES[f.name]
        if f.name == "served_model_name":  # vLLM's NAME [NAME ...]: the first answers, all are accepted
            kw["nargs"] = "+"
        if f.name == "kv_cache_memory":
            kw["type"] = parse_size
        elif f.name == "max_model_len":
            kw["type"] = parse_count
        elif f.name == "tenant_weights":
            kw["type"] = parse_pairs
        elif kind.startswith("bool"):
            kw["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("int"):
            kw["type"] = int
        elif kind.startswith("float"):
            kw["type"] = float
        group.add_argument(_flag(f.name), *FLAG_ALIASES.get(f.name, ()), **kw)


def readable_default(name: str, value: Any) -> str:
    """A default as a person reads it: sizes in units, booleans on/off, empty and None as none."""
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if name == "kv_cache_memory" and isinstance(value, int):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value // size}{unit}"
    return str(value)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    options = {f.name: getattr(args, f.name) for _, f in engine_option_fields() if getattr(args, f.name, None) is not None}
    if isinstance(options.get("served_model_name"), list):  # --served-model-name A B: A answers; B in model_aliases
        options["served_model_name"] = options["served_model_name"][0]
    return EngineConfig.from_options(**options)


def model_aliases(args: argparse.Namespace) -> tuple[str, ...]:
    """--served-model-name's names after the first: the API accepts them too."""
    names = getattr(args, "served_model_name", None)
    return tuple(names[1:]) if isinstance(names, list) else ()


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="GGUF file or Hugging Face directory")
    add_engine_args(p)
    s = p.add_argument_group("server options")
    s.add_argument("--host", default=ServerConfig.host, help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=ServerConfig.port, help="port to listen on (default %(default)s)")
    s.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    s.add_argument("--api-key-tenant", action="append", default=[], metavar="KEY=TENANT",
                   help="requests with KEY belong to TENANT; turns on prefix-cache isolation between tenants")
    s.add_argument("--max-body-bytes", type=parse_size, default=ServerConfig.max_body_bytes,
                   help="largest request body; larger ones get 413 (default 1MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout,
                   help="seconds requests in flight get to finish after SIGTERM (default %(default)s)")
    s.add_argument("--allow-request-chat-template", action="store_true",
                   help="accept a chat_template field in requests (rendered under the chat template limits)")
    s.add_argument("--slo-ttft", type=float, default=None, help="seconds; counted in the goodput metric")
    s.add_argument("--slo-itl", type=float, default=None, help="seconds; counted in the goodput metric")
    s.add_argument("--tenant-max-requests", type=int, default=None,
                   help="in-flight requests per tenant; beyond it that tenant gets 429 while others are served")
    s.add_argument("--max-tenant-labels", type=int, default=ServerConfig.max_tenant_labels,
                   help="tenants with a metrics label of their own; the rest count as 'other' (default %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log verbosity (default %(default)s)")
    s.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log lines (default: as --log-level)")
    s.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                   help="log one line per request admitted: id, tenant, prompt sizes, sampling parameters")
    s.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="do not log each request (the default; vLLM's older spelling)")
    s.add_argument("--tiny", action="store_true", help="a tiny random-weight model with the real tokenizer (testing)")
    _add_http_limits(p)
    _add_cors(p)
    _add_observability(p)
    _add_fleet_args(p)
    p.set_defaults(func=_serve)


def _add_observability(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability (see docs/observability.md)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send one OpenTelemetry span per request to this OTLP collector, e.g. "
                        "http://localhost:4318 (protocol: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, http/protobuf "
                        "or grpc; default: tracing off)")
    g.add_argument("--otlp-traces-sample-ratio", type=float, default=None, metavar="RATIO",
                   help="fraction of new traces kept, in [0, 1]; a caller's sampled traceparent is followed "
                        "(default: OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, else every trace)")
    g.add_argument("--cost-profile", default=None, metavar="PATH",
                   help="calibrated step-cost profile (cadence calibrate) that predicts a waiting request's time "
                        "to first token in GET /v1/requests/{id} and prices adaptive speculative drafts; 'none': "
                        "no prediction (default: the shipped profile of the server's thread count)")
    g.add_argument("--metrics-compat", action="append", default=[], choices=METRICS_COMPAT,
                   help="also export vLLM's metric names (vllm:num_requests_running, ...) on /metrics, for "
                        "vLLM's dashboards and alerts (default: cadence's names only)")


def _add_http_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP limits (see docs/server.md)")
    g.add_argument("--max-header-count", type=int, default=ServerConfig.max_header_count,
                   help="header fields a request may have; beyond it 431 (default %(default)s)")
    g.add_argument("--max-header-bytes", type=parse_size, default=ServerConfig.max_header_bytes,
                   help="bytes of the request line and header fields together; beyond it 431 (default 64KiB)")
    g.add_argument("--max-request-line-bytes", type=parse_size, default=ServerConfig.max_request_line_bytes,
                   help="bytes of the request line (method, URL, version); beyond it 414 (default 8KiB)")
    g.add_argument("--header-timeout", type=float, default=ServerConfig.header_timeout,
                   help="seconds a request's head may take to arrive, from its first byte or the connection's "
                        "opening; then 408 and the connection closes (default %(default)s)")
    g.add_argument("--keep-alive-timeout", type=float, default=ServerConfig.keep_alive_timeout,
                   help="seconds an idle connection stays open between requests (default %(default)s)")
    g.add_argument("--body-timeout", type=float, default=ServerConfig.body_timeout,
                   help="seconds a request's body may take to arrive after its head; then the connection "
                        "closes (default %(default)s)")


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields of the HTTP-limit and CORS flags."""
    return {
        "max_header_count": args.max_header_count,
        "max_header_bytes": args.max_header_bytes,
        "max_request_line_bytes": args.max_request_line_bytes,
        "header_timeout": args.header_timeout,
        "keep_alive_timeout": args.keep_alive_timeout,
        "body_timeout": args.body_timeout,
        "allowed_origins": tuple(args.allowed_origins),
        "allowed_methods": tuple(m.upper() for m in args.allowed_methods),
        "allowed_headers": tuple(args.allowed_headers),
        "allow_credentials": args.allow_credentials,
    }


def _add_cors(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CORS (off unless --allowed-origins is given)")
    g.add_argument("--allowed-origins", type=parse_list, action="extend", default=[], metavar="ORIGIN[,ORIGIN...]",
                   help="origins whose web pages may call the API, such as https://app.example.com; '*' for any "
                        "(repeatable; default: none, CORS off)")
    g.add_argument("--allowed-methods", type=parse_list, default=list(ServerConfig.allowed_methods),
                   metavar="METHOD[,METHOD...]", help="methods allowed cross-origin (default GET,POST)")
    g.add_argument("--allowed-headers", type=parse_list, default=list(ServerConfig.allowed_headers),
                   metavar="HEADER[,HEADER...]", help="request headers allowed cross-origin (default '*': any)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="let cross-origin requests carry cookies and HTTP authentication (not with '*' origins)")


# -- the fleet (cadence serve --replicas N) --------------------------------------------------------


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    from cadence.routing import ROUTERS

    f = p.add_argument_group("fleet options (Ray Serve; see docs/fleet.md)")
    f.add_argument("--replicas", type=int, default=None,
                   help="serve N engines behind one endpoint on Ray Serve (default: one engine, no Ray)")
    f.add_argument("--router", choices=ROUTERS, default=None, help="how requests are placed (default prefix-affinity)")
    f.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. HEAD:6379 after `ray start --head`) instead of starting one")
    f.add_argument("--replica-threads", type=int, default=None,
                   help="torch threads (and CPUs reserved) per replica (default: the cores divided among the replicas)")
    f.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests the ingress holds for busy replicas; beyond it, 429 (default %(default)s)")
    f.add_argument("--prefill-replicas", type=int, default=None,
                   help="disaggregated prefill and decode: engines that prefill prompts (with --decode-replicas)")
    f.add_argument("--decode-replicas", type=int, default=None,
                   help="disaggregated prefill and decode: engines that decode, importing the prompts' KV blocks")
    f.add_argument("--kv-transfer-timeout", type=float, default=None,
                   help="seconds a request may wait for decode room and for its KV blocks (default 30)")


PD_OBJECT_STORE_BYTES = 1024 * 1024 * 1024  # KV blocks travel through Ray's object store


def _serve_fleet(args: argparse.Namespace, engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    import math

    from cadence.fleet.launch import RayOptions, run_fleet

    engine_cfg, fleet = fleet_options(args, engine_cfg)
    # A local Ray gets the replicas' CPUs and the ingress's, whatever this machine counts.
    ray_opts = RayOptions(address=args.ray_address, num_cpus=None if args.ray_address else
                          math.ceil(fleet.num_replicas * fleet.replica_cpus + fleet.ingress_cpus),
                          object_store_bytes=PD_OBJECT_STORE_BYTES if fleet.disaggregated else None)
    return run_fleet(engine_cfg, server_cfg, fleet, ray_opts)


def fleet_options(args: argparse.Namespace, engine_cfg: EngineConfig) -> tuple[EngineConfig, Any]:
    """The fleet's options of parsed `cadence serve` flags, and the engine configuration with each
    replica's threads."""
    from cadence.fleet.deploy import FleetOptions

    prefill, decode = args.prefill_replicas, args.decode_replicas
    if (prefill is None) != (decode is None):
        raise ValueError("--prefill-replicas and --decode-replicas: give both (or neither)")
    if prefill is not None and args.replicas is not None:
        raise ValueError("--replicas: not with --prefill-replicas/--decode-replicas (the pools are the replicas)")
    if prefill is None and args.kv_transfer_timeout is not None:
        raise ValueError("--kv-transfer-timeout: an option of disaggregated prefill and decode; "
                         "give --prefill-replicas and --decode-replicas too")
    for flag, n in (("--prefill-replicas", prefill), ("--decode-replicas", decode)):
        if n is not None and n < 1:
            raise ValueError(f"{flag}: must be >= 1, got {n}")
    pd = {} if prefill is None else {"prefill_replicas": prefill, "decode_replicas": decode}
    if args.kv_transfer_timeout is not None:
        if not args.kv_transfer_timeout > 0:
            raise ValueError(f"--kv-transfer-timeout: must be > 0, got {args.kv_transfer_timeout}")
        pd["kv_transfer_timeout_s"] = args.kv_transfer_timeout
    replicas = (1 if args.replicas is None else args.replicas) if prefill is None else prefill + decode
    if replicas < 1:
        raise ValueError(f"--replicas: must be >= 1, got {replicas}")
    if args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests: must be >= 1, got {args.max_queued_requests}")
    if args.replica_threads is not None and args.replica_threads < 1:
        raise ValueError(f"--replica-threads: must be >= 1, got {args.replica_threads}")
    threads = args.replica_threads or engine_cfg.model.num_threads or max(1, (os.cpu_count() or 1) // replicas)
    fleet = FleetOptions(replicas=replicas, router=args.router or "prefix-affinity", replica_cpus=float(threads),
                         max_queued_requests=args.max_queued_requests, tiny=args.tiny, **pd).validate()
    return engine_cfg.replace(num_threads=threads), fleet


def serve_parser() -> argparse.ArgumentParser:
    """The parser of `cadence serve`'s flags alone (for `cadence.fleet:app`'s arguments)."""
    sub = argparse.ArgumentParser(prog="cadence").add_subparsers()
    _add_serve(sub)
    return sub.choices["serve"]


def _serve(args: argparse.Namespace) -> int:
    from cadence.server.app import run_server

    engine_cfg, server_cfg = serve_configs(args)
    if args.replicas is not None or args.ray_address is not None or args.prefill_replicas is not None \
            or args.decode_replicas is not None:
        return _serve_fleet(args, engine_cfg, server_cfg)
    for flag in ("router", "replica_threads", "kv_transfer_timeout"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')}: a fleet option; give --replicas N (or --ray-address) too")
    return run_server(engine_cfg, server_cfg, tiny=args.tiny)


def serve_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configurations of parsed `cadence serve` flags."""
    if args.model_path and args.model is None:
        args.model = args.model_path
    elif args.model_path and not _same_model(args.model_path, args.model):
        raise ValueError(f"the model is given twice and differently: {args.model_path} (MODEL) and --model "
                         f"{args.model}; give one")
    pairs = []
    for item in args.api_key_tenant:
        key, sep, tenant = item.partition("=")
        if not sep or not key or not tenant:
            raise ValueError(f"--api-key-tenant: expected KEY=TENANT, got {item!r}")
        pairs.append((key, tenant))
    keys = tuple(dict.fromkeys([*args.api_key, *(k for k, _ in pairs)]))
    engine_cfg = engine_config_from_args(args)
    if pairs and not engine_cfg.cache.tenant_isolation:
        engine_cfg = engine_cfg.replace(tenant_isolation=True)
    server_cfg = ServerConfig(
        host=args.host, port=args.port, api_keys=keys, api_key_tenants=tuple(pairs),
        max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
        allow_request_chat_template=args.allow_request_chat_template, slo_ttft=args.slo_ttft,
        slo_itl=args.slo_itl, tenant_max_requests=args.tenant_max_requests, max_tenant_labels=args.max_tenant_labels, log_level=args.log_level,
        uvicorn_log_level=args.uvicorn_log_level, log_requests=args.log_requests, model_aliases=model_aliases(args),
        otlp_traces_endpoint=args.otlp_traces_endpoint, otlp_traces_sample_ratio=args.otlp_traces_sample_ratio,
        metrics_compat=tuple(dict.fromkeys(args.metrics_compat)), cost_profile=args.cost_profile,
        **http_options(args),
    ).validate()
    if server_cfg.otlp_traces_endpoint is not None:  # a bad OTLP protocol is refused before the model loads
        from cadence.server.tracing import traces_protocol

        traces_protocol(server_cfg.otlp_traces_endpoint)
    from cadence.engine.ttft import load_cost_profile

    load_cost_profile(server_cfg.cost_profile)  # a bad profile is refused before the model loads too
    return engine_cfg, server_cfg


def _same_model(a: str, b: str) -> bool:
    """The same model whichever way its path is spelled (./m.gguf, m.gguf, a symlink to it)."""
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation: a prompt, or a JSONL file of requests")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--input", help="JSONL: one request a line, {'prompt': ...} or {'messages': [...]}, plus sampling "
                                     "fields; every line gets a result or an {'id', 'error'} row, and the exit status "
                                     "is 2 if any line was refused")
    p.add_argument("--output", default="-", help="JSONL results (default: stdout)")
    p.add_argument("--chat", action="store_true", help="treat --prompt as a user message and apply the chat template")
    p.add_argument("--split-special-tokens", action="store_true",
                   help="read special-token text in a prompt (e.g. <|im_start|>) as ordinary characters; by default "
                        "it is the token it names, as in vLLM (chat messages are always read as characters)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's top_p; 1: off (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: off (default %(default)s)")
    p.add_argument("--sampling-seed", dest="sample_seed", metavar="SEED", type=int, default=None,
                   help="seed of each request's sampling (default: none: drawn from the engine's --seed)")
    p.add_argument("--tiny", action="store_true", help="a tiny random-weight model with the real tokenizer (testing)")
    add_engine_args(p)
    p.set_defaults(func=_generate)


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_ROW_FIELDS = _SAMPLING_FIELDS | {"prompt", "messages", "id"}


@dataclasses.dataclass
class _Row:
    """One request of `cadence generate`: where it came from, its id, and what to run (or why not)."""

    where: str  # "FILE:LINE", or "--prompt"
    id: Any
    params: SamplingParams | None = None
    prompt: str | list[int] | None = None
    messages: list[Any] | None = None
    error: str | None = None


def _generate(args: argparse.Namespace) -> int:
    """Every line is answered: a result row, or {"id", "error"} for a line that was refused (also
    on stderr, as FILE:LINE: why). The other lines are generated all the same; the exit status is 2
    when any line was refused. Everything that needs no model is checked before it loads."""
    from cadence.llm import LLM

    base = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.sample_seed}
    SamplingParams(**base)  # the flags themselves: a clear error before the model loads
    options = engine_config_from_args(args).as_options()
    if args.prompt is not None:
        rows = [_make_row("--prompt", 0, {"prompt": args.prompt}, base, args.chat)]
        if rows[0].error:
            raise ValueError(rows[0].error)
    elif not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input}: no such file")
    else:
        rows = _read_rows(args.input, base, args.chat)
    if args.output != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ValueError(f"--output {args.output}: its directory does not exist")
    llm = LLM(tiny=args.tiny, **options)
    if args.prompt is not None:
        results = [_result_row(rows[0].id, _run_one(llm, rows[0], args.split_special_tokens))]
    else:
        results = _run_rows(llm, rows, args.split_special_tokens)
    sink = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        for result in results:
            sink.write(json.dumps(result) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    refused = sum(1 for row in rows if row.error)
    if refused:
        rest = "none generated" if refused == len(rows) else "the others were generated"
        print(f"cadence: error: {refused} of {counted(len(rows), 'request')} refused ({rest})", file=sys.stderr)
        return 2
    return 0


def _run_one(llm: Any, row: _Row, split_special_tokens: bool) -> Any:
    assert row.params is not None
    if row.messages is not None:
        return llm.chat(row.messages, row.params, use_tqdm=False)[0]
    return llm.generate([row.prompt], row.params, use_tqdm=False, split_special_tokens=split_special_tokens)[0]


def _run_rows(llm: Any, rows: list[_Row], split_special_tokens: bool) -> list[dict[str, Any]]:
    """A file's rows: each checked on its own (a refused one gets its error row), then all the
    others generated together, as one batch that the engine schedules continuously."""
    ready: dict[int, list[int]] = {}
    for k, row in enumerate(rows):
        if row.error:
            continue
        assert row.params is not None
        try:
            if row.messages is not None:
                toks = llm.encode_chat(row.messages)
            else:
                toks = (llm.tokenizer.encode(row.prompt, True, split_special_tokens=split_special_tokens)
                        if isinstance(row.prompt, str) else row.prompt)
            ready[k] = llm.check_prompt(toks, row.params)
        except (ValueError, TypeError) as e:
            row.error = f"{row.where}: {e}"
    for row in rows:
        if row.error:
            print(f"cadence: error: {row.error}", file=sys.stderr, flush=True)
    order = list(ready)
    outs = llm.generate([ready[k] for k in order], [rows[k].params for k in order]) if order else []
    done = {k: _result_row(rows[k].id, out) for k, out in zip(order, outs, strict=True)}
    return [done.get(k, {"id": row.id, "error": row.error}) for k, row in enumerate(rows)]


def _result_row(rid: Any, out: Any) -> dict[str, Any]:
    m = out.metrics
    c = out.outputs[0]
    row = {
        "id": rid,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": m.ttft if m else None,
        "e2e_s": m.e2e_latency if m else None,
    }
    if c.logprobs is not None:
        row["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                           for lp in c.logprobs]
    return row


def _read_rows(path: str, base: dict[str, Any], chat: bool) -> list[_Row]:
    """Every non-blank line of a JSONL file as a `_Row`; a line that cannot be run carries its error."""
    rows: list[_Row] = []
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            where, index = f"{path}:{n}", len(rows)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                rows.append(_Row(where, index, error=f"{where}: not UTF-8 ({e.reason} at byte {e.start})"))
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                rows.append(_Row(where, index, error=f"{where}: not JSON ({e.msg}, column {e.colno})"))
                continue
            rows.append(_make_row(where, index, obj, base, chat))
    if not rows:
        raise ValueError(f"{path}: no requests (expected one JSON object a line)")
    return rows


def _make_row(where: str, index: int, obj: Any, base: dict[str, Any], chat: bool) -> _Row:
    """Check one request without the model: its shape, its fields and its sampling values."""
    if not isinstance(obj, dict):
        return _Row(where, index, error=f"{where}: expected an object with 'prompt' or 'messages', "
                                        f"got {type(obj).__name__}")
    row = _Row(where, obj.get("id", index))

    def refuse(why: str) -> _Row:
        row.error = f"{where}: {why}"
        return row

    unknown = set(obj) - _ROW_FIELDS
    if unknown:
        return refuse(f"unknown fields {sorted(unknown)} (expected prompt or messages, id, and sampling "
                      "fields such as max_tokens)")
    if ("prompt" in obj) == ("messages" in obj):
        return refuse("give exactly one of 'prompt' or 'messages'")
    if obj.get("n", 1) != 1:
        return refuse(f"n: cadence generate writes one completion a line, so n must be 1 (got {obj['n']!r}); "
                      "repeat the line with different seeds instead")
    try:
        row.params = SamplingParams(**{**base, **{k: v for k, v in obj.items() if k in _SAMPLING_FIELDS}})
    except (ValueError, TypeError) as e:
        return refuse(str(e))
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            return refuse("messages: must be a non-empty list of {'role', 'content'} objects")
        row.messages = msgs
        return row
    prompt = obj["prompt"]
    if chat:
        if not isinstance(prompt, str):
            return refuse("prompt: with --chat, must be a string (the user message)")
        row.messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                     and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        row.prompt = prompt
    else:
        return refuse(f"prompt: must be a string or a non-empty list of token ids, got {prompt!r:.60}")
    return row


def _add_optional(sub: argparse._SubParsersAction, module: str) -> None:
    """Subcommands that live in their own package register themselves when present."""
    try:
        mod = __import__(module, fromlist=["add_parser"])
    except ImportError:
        return
    mod.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description="cadence: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_optional(sub, "cadence.bench.cli")
    _add_optional(sub, "cadence.sim.cli")
    chat_client.add_parser(sub)  # chat, complete
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: thousands of lines per benchmark run, none of them news.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # matplotlib (bench's plots) logs its font cache's creation at INFO on first use: not news either.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    if getattr(args, "log_level", None):  # (serve's --log-level: cadence's own lines too, not only uvicorn's)
        logging.getLogger("cadence").setLevel(args.log_level.upper())
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError) as e:
        # Bad input or a bad file: one clear line, no traceback.
        print(f"cadence: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
