"""`cadence serve | generate | bench | sim | calibrate`.

Engine flags are derived from the config dataclasses (vLLM's spelling where vLLM has the knob),
so a new config field is a new flag with no other wiring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

from cadence.config import EngineConfig, ServerConfig, engine_option_fields
from cadence.request import SamplingParams

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1073741824, 512MiB, 2GiB)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_pairs(text: str) -> tuple[tuple[str, float], ...]:
    """'alice=2,bob=1' -> (('alice', 2.0), ('bob', 1.0))."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT, got {part!r}")
        out.append((name, float(value)))
    return tuple(out)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine option; defaults stay None so only what the user typed overrides the config."""
    group = parser.add_argument_group("engine options")
    for _section, f in engine_option_fields():
        kind = str(f.type)
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": f"(default: {f.default!r})"}
        if f.name == "kv_cache_memory":
            kw["type"] = parse_size
        elif f.name == "tenant_weights":
            kw["type"] = parse_pairs
        elif kind.startswith("bool"):
            kw["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("int"):
            kw["type"] = int
        elif kind.startswith("float"):
            kw["type"] = float
        group.add_argument(_flag(f.name), **kw)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    options = {f.name: getattr(args, f.name) for _, f in engine_option_fields() if getattr(args, f.name, None) is not None}
    return EngineConfig.from_options(**options)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="GGUF file or Hugging Face directory")
    add_engine_args(p)
    s = p.add_argument_group("server options")
    s.add_argument("--host", default=ServerConfig.host)
    s.add_argument("--port", type=int, default=ServerConfig.port)
    s.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    s.add_argument("--api-key-tenant", action="append", default=[], metavar="KEY=TENANT",
                   help="requests with KEY belong to TENANT; turns on prefix-cache isolation between tenants")
    s.add_argument("--max-body-bytes", type=parse_size, default=ServerConfig.max_body_bytes)
    s.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout)
    s.add_argument("--allow-request-chat-template", action="store_true")
    s.add_argument("--slo-ttft", type=float, default=None, help="seconds; counted in the goodput metric")
    s.add_argument("--slo-itl", type=float, default=None, help="seconds; counted in the goodput metric")
    s.add_argument("--tenant-max-requests", type=int, default=None,
                   help="in-flight requests per tenant; beyond it that tenant gets 429 while others are served")
    s.add_argument("--max-tenant-labels", type=int, default=ServerConfig.max_tenant_labels)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--tiny", action="store_true", help="a tiny random-weight model with the real tokenizer (testing)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from cadence.server.app import run_server

    if args.model_path and args.model is None:
        args.model = args.model_path
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
    ).validate()
    return run_server(engine_cfg, server_cfg, tiny=args.tiny)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation: a prompt, or a JSONL file of requests")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--input", help="JSONL: one request a line, {'prompt': ...} or {'messages': [...]}, plus sampling fields")
    p.add_argument("--output", default="-", help="JSONL results (default: stdout)")
    p.add_argument("--chat", action="store_true", help="treat --prompt as a user message and apply the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", dest="sample_seed", type=int, default=None, help="seed of each request")
    p.add_argument("--tiny", action="store_true", help="a tiny random-weight model with the real tokenizer (testing)")
    add_engine_args(p)
    p.set_defaults(func=_generate)


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _generate(args: argparse.Namespace) -> int:
    from cadence.llm import LLM

    llm = LLM(tiny=args.tiny, **engine_config_from_args(args).as_options())
    base = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.sample_seed}
    rows = [{"prompt": args.prompt}] if args.prompt is not None else list(_read_jsonl(args.input))
    sink = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        for i, row in enumerate(rows):
            unknown = set(row) - _SAMPLING_FIELDS - {"prompt", "messages", "id"}
            if unknown:
                raise ValueError(f"line {i + 1}: unknown fields {sorted(unknown)}")
            params = SamplingParams(**{**base, **{k: v for k, v in row.items() if k in _SAMPLING_FIELDS}})
            if "messages" in row or args.chat:
                msgs = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
                out = llm.chat(msgs, params, use_tqdm=False)[0]
            else:
                out = llm.generate(row["prompt"], params, use_tqdm=False)[0]
            sink.write(json.dumps(_result_row(row.get("id", i), out)) + "\n")
            sink.flush()
    finally:
        if sink is not sys.stdout:
            sink.close()
    return 0


def _result_row(rid: Any, out: Any) -> dict[str, Any]:
    m = out.metrics
    return {
        "id": rid,
        "text": out.outputs[0].text,
        "token_ids": out.outputs[0].token_ids,
        "finish_reason": out.outputs[0].finish_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": m.ttft if m else None,
        "e2e_s": m.e2e_latency if m else None,
    }


def _read_jsonl(path: str):
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(row, dict) or not ({"prompt", "messages"} & set(row)):
                    raise ValueError(f"{path}:{n}: expected an object with 'prompt' or 'messages'")
                yield row


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: thousands of lines per benchmark run, none of them news.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
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
