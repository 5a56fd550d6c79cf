"""Engine configuration: one frozen dataclass per section; `validate()` raises ValueError naming the field.

Every field is also an engine option (`LLM(max_num_seqs=32)`) and a command-line flag
(`--max-num-seqs 32`): `EngineConfig.from_options` maps flat options onto the sections, so a new
field needs no other wiring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlparse

from cadence.checks import is_finite, is_int

SCHEDULERS = ("continuous", "static")
POLICIES = ("fcfs", "priority", "fair", "deadline")
HASH_ALGOS = ("sha256", "builtin")  # the prefix cache's block hashes (kv/hashing.py)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other spellings (torch's names)
# auto: activations in --dtype; int8: a quantized checkpoint's linear layers quantize their inputs
# to int8 per block of 32 (llama.cpp's arithmetic on its quantized types)
ACTIVATION_DTYPES = ("auto", "int8")
DEVICES = ("auto", "cpu", "cuda")
# --kv-cache-dtype: auto (the model's dtype) or int8 (8-bit values and a scale per token and KV head).
KV_CACHE_DTYPES = ("auto", "int8")
KV_CACHE_DTYPES_REFUSED = ("fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's, not implemented here: refused by name
METRICS_COMPAT = ("vllm",)  # --metrics-compat: other servers' metric names served beside cadence's
OTLP_SCHEMES = ("http", "https", "grpc")  # --otlp-traces-endpoint: OTLP/HTTP over http(s); gRPC over any
GiB = 1 << 30


def _require(cond: bool, name: str, why: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {why}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1e9', '1073741824' -> bytes; ValueError otherwise."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 512MiB, 2GiB)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_human_int(text: str) -> int:
    """A count as vLLM reads one (--max-model-len): '32k' -> 32000 and '25.6k' -> 25600 (lower-case
    suffixes are powers of ten), '32K' -> 32768 (upper-case, powers of two, whole numbers only),
    '4096' -> 4096; ValueError otherwise."""
    value = text.strip()
    m = _HUMAN_INT.fullmatch(value)
    if not m:
        raise ValueError(f"not a count: {text!r} (examples: 4096, 32k = 32000, 32K = 32768, 1m = 1000000)")
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        hint = f"; did you mean {value.lower()}?" if suffix else ""
        raise ValueError(f"not a whole count: {text!r} (decimals only with k, m, g, t{hint})")
    return int(number) * _BINARY.get(suffix, 1)


def _type_ok(value: Any, kind: str) -> bool:
    """Does `value` fit the annotation `kind` (a string, as `from __future__ import annotations`
    leaves it)? bool is refused where an int or float is meant: `max_num_seqs=True` is a mistake."""
    if value is None:
        return kind.endswith("| None")
    base = kind.removesuffix(" | None")
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return is_int(value)
    if base == "float":
        return is_finite(value)
    if base == "str":
        return isinstance(value, str)
    return True  # structured fields check themselves


_TYPE_WORDS = {"bool": "True or False", "int": "an integer", "float": "a finite number", "str": "a string"}


def _check_types(section: Any) -> None:
    """ValueError naming the first field whose value has the wrong type (a float where an integer
    is meant would otherwise be accepted and misused; a string where a bool is meant is truthy)."""
    for f in fields(section):
        kind = str(f.type)
        value = getattr(section, f.name)
        if not _type_ok(value, kind):
            base = kind.removesuffix(" | None")
            want = _TYPE_WORDS.get(base, base) + (" or None" if kind.endswith("| None") else "")
            raise ValueError(f"{f.name}: must be {want}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # GGUF file or Hugging Face directory; None = the default model
    dtype: str = "auto"  # auto: bfloat16 where the CPU or GPU has fast bf16, else float32
    device: str = "auto"  # auto: cuda when present, else cpu
    activation_dtype: str = "auto"  # auto: the activations in `dtype`; int8: see ACTIVATION_DTYPES
    max_model_len: int | None = None  # None: the model's context length, capped at 8192
    served_model_name: str | None = None
    chat_template: str | None = None  # a Jinja chat template, or a file holding one, instead of the model's
    seed: int = 0  # seeds unseeded random sampling
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # The served engine is declared stalled (unhealthy) when one step runs longer than this many
    # seconds, or than 5x the longest step it expects from the steps it has run; 0: never.
    step_timeout: float = 60.0
    # What rendering one chat with a chat template may cost (see model/template_limits.py).
    chat_template_timeout: float = 5.0  # seconds
    chat_template_max_chars: int = 4_000_000  # characters of output, or of any string the template builds
    chat_template_max_iterations: int = 10_000_000  # loop iterations and calls
    record_steps: str | None = None  # a file that gets each step's shape and duration (JSON lines)

    def validate(self) -> None:
        _check_types(self)
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        _require(self.device in DEVICES, "device", f"must be one of {DEVICES}")
        _require(self.activation_dtype in ACTIVATION_DTYPES, "activation_dtype",
                 f"must be one of {ACTIVATION_DTYPES}")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        _require(self.step_timeout >= 0, "step_timeout", "must be >= 0 seconds (0: no watchdog)")
        _require(self.chat_template_timeout > 0, "chat_template_timeout", "must be > 0 seconds")
        _require(self.chat_template_max_chars >= 1024, "chat_template_max_chars", "must be >= 1024")
        _require(self.chat_template_max_iterations >= 1000, "chat_template_max_iterations", "must be >= 1000")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 1 * GiB  # bytes of K/V; the block count follows and is logged at start-up
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, simulations)
    # A share of the memory available once the model is loaded (vLLM's --gpu-memory-utilization,
    # for the KV cache alone); overrides kv_cache_memory, resolved and logged at start-up.
    kv_cache_memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    tenant_isolation: bool = False  # salt prefix-cache hashes with the tenant
    # sha256: collisions cannot be crafted; builtin: Python's hash(), ~3x cheaper, for trusted traffic
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_dtype: str = "auto"  # auto: K/V in the model's dtype; int8: half the bytes of bfloat16

    def validate(self) -> None:
        _check_types(self)
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "must be a power of two <= 128")
        _require(self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0 bytes")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _require(self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 0.95,
                 "kv_cache_memory_fraction", "must be in (0, 0.95]: the rest is the process's own")
        _require(self.prefix_caching_hash_algo in HASH_ALGOS, "prefix_caching_hash_algo", f"must be one of {HASH_ALGOS}")
        accepted = ", ".join(KV_CACHE_DTYPES)
        _require(self.kv_cache_dtype not in KV_CACHE_DTYPES_REFUSED, "kv_cache_dtype (--kv-cache-dtype)",
                 f"{self.kv_cache_dtype} caches are not implemented here; accepted values: {accepted}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype (--kv-cache-dtype)",
                 f"{self.kv_cache_dtype!r} is not a KV cache dtype; accepted values: {accepted}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts one verification row may carry


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's spelling (`--speculative-config '{"method": "ngram", ...}'`).

    ngram (prompt lookup): the drafts are the tokens that followed the latest earlier occurrence
    of the request's last n tokens in its own prompt and output, for the longest n in
    [prompt_lookup_min, prompt_lookup_max] that occurs; each decode step verifies up to
    `num_speculative_tokens` of them. As in vLLM, a missing bound takes the other's value, and
    both missing are 5. With draft_model they stay None (no lookup), and giving them is an error.

    draft_model: the drafts are what a small model of the same vocabulary (`model`, a GGUF file
    or Hugging Face directory) predicts greedily after the request's context; the model runner
    owns and runs it (executor/drafter.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # cadence's own: choose k per request per step from its measured acceptance and the step's
    # cost (0 under load); False: always up to num_speculative_tokens.
    adaptive: bool = True
    model: str | None = None  # draft_model: the draft model's checkpoint

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig:
        """From a dict (or its JSON text, as on the command line); ValueError names the bad key."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        for key, bound in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if bound is None:
                continue
            # Checked before a bound given alone is copied to the other, so the error names the key given.
            _require(value.get("method", "ngram") != "draft_model", f"speculative_config.{key}", "only with method ngram")
            _require(_type_ok(bound, "int"), f"speculative_config.{key}", f"must be an integer, got {bound!r}")
            _require(bound >= 1, f"speculative_config.{key}", "must be >= 1")
        if value.get("method", "ngram") == "draft_model":
            return cls(**value)  # no n-gram lookup: its bounds stay None
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        return cls(**{**value, "prompt_lookup_min": lo, "prompt_lookup_max": hi})

    def validate(self) -> None:
        for f in fields(self):
            kind, v = str(f.type), getattr(self, f.name)
            _require(_type_ok(v, kind), f"speculative_config.{f.name}",
                     f"must be {_TYPE_WORDS.get(kind.removesuffix(' | None'), kind)}, got {v!r}")
        _require(self.method in SPECULATIVE_METHODS, "speculative_config.method", f"must be one of {SPECULATIVE_METHODS}")
        _require(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS, "speculative_config.num_speculative_tokens",
                 f"must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method == "draft_model":
            _require(bool(self.model), "speculative_config.model",
                     "required with method draft_model: a GGUF file or Hugging Face directory of the draft model")
        else:
            _require(self.model is None, "speculative_config.model", "only with method draft_model")
        if self.method == "draft_model":
            _require(self.prompt_lookup_min is None, "speculative_config.prompt_lookup_min", "only with method ngram")
            _require(self.prompt_lookup_max is None, "speculative_config.prompt_lookup_max", "only with method ngram")
            return
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _require(lo is not None and lo >= 1, "speculative_config.prompt_lookup_min", "must be >= 1")
        _require(hi is not None and lo is not None and hi >= lo, "speculative_config.prompt_lookup_max",
                 "must be >= prompt_lookup_min")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SchedulerConfig:
    scheduler: str = "continuous"  # or "static": hold a batch until its last member finishes
    policy: str = "fcfs"  # fcfs | priority | fair | deadline
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk per step; 0 = budget only
    max_num_partial_prefills: int = 1  # requests that may be mid-prefill at once
    max_queue_len: int = 1024  # waiting requests; beyond it, refused (HTTP 429)
    max_queued_tokens: int | None = None  # prompt tokens waiting; None = unbounded
    tenant_max_running: int | None = None  # running requests per tenant
    tenant_weights: tuple[tuple[str, float], ...] = ()  # fair share weights; others weigh 1
    deadline_aging: float = 1.0  # seconds of waiting that count as one second nearer a deadline
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding

    def validate(self) -> None:
        _check_types(self)
        _require(self.scheduler in SCHEDULERS, "scheduler", f"must be one of {SCHEDULERS}")
        _require(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0")
        _require(self.max_num_partial_prefills >= 1, "max_num_partial_prefills", "must be >= 1")
        _require(self.max_queue_len >= 1, "max_queue_len", "must be >= 1")
        _require(self.max_queued_tokens is None or self.max_queued_tokens >= 1, "max_queued_tokens", "must be >= 1")
        _require(self.tenant_max_running is None or self.tenant_max_running >= 1, "tenant_max_running", "must be >= 1")
        _require(
            isinstance(self.tenant_weights, tuple)
            and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and _type_ok(p[1], "float")
                    for p in self.tenant_weights),
            "tenant_weights", f"must be NAME=WEIGHT pairs such as {{'alice': 2.0}}, got {self.tenant_weights!r}",
        )
        _require(all(w > 0 for _, w in self.tenant_weights), "tenant_weights", "weights must be > 0")
        _require(self.deadline_aging > 0, "deadline_aging", "must be > 0")
        spec = self.speculative_config
        _require(spec is None or isinstance(spec, SpeculativeConfig), "speculative_config",
                 "must be a SpeculativeConfig, a dict or its JSON text")
        if spec is not None:
            spec.validate()


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> EngineConfig:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        return self

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return self.scheduler.speculative_config

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from flat options (`max_num_seqs=32`). Unknown names raise TypeError."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in options.items():
            section = _FIELD_TO_SECTION.get(key)
            if section is None:
                raise TypeError(f"unknown engine option {key!r}")
            sections[section][key] = _normalise(key, value)
        cfg = cls(**{name: _SECTIONS[name](**kw) for name, kw in sections.items()})
        return cfg.validate()

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with some flat options changed."""
        merged = {**self.as_options(), **options}
        return EngineConfig.from_options(**merged)

    def as_options(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out


def _is_otlp_url(endpoint: object) -> bool:
    """http(s) for OTLP/HTTP, http, https or grpc for gRPC; a host; a port that parses."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        return False
    try:
        url = urlparse(endpoint)
        port = url.port
    except ValueError:  # a bracket left open, a port that is no number or out of range
        return False
    return url.scheme.lower() in OTLP_SCHEMES and bool(url.hostname) and port != 0


@dataclass(frozen=True)
class ServerConfig:
    """HTTP front end; not an engine option (the offline `LLM` has no server)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    api_key_tenants: tuple[tuple[str, str], ...] = ()  # (key, tenant): requests with that key belong to it
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    allow_request_chat_template: bool = False  # a chat_template sent in a request is refused unless set
    slo_ttft: float | None = None  # seconds; goodput counts requests meeting every SLO given
    slo_itl: float | None = None
    max_tenant_labels: int = 32  # Prometheus labels per tenant beyond this fold into "other"
    tenant_max_requests: int | None = None  # in-flight requests per tenant; beyond it 429 (None: no cap)
    log_level: str = "info"
    uvicorn_log_level: str | None = None  # uvicorn's own log lines; None: as log_level
    log_requests: bool = False  # one INFO line per request admitted (vLLM's --enable-log-requests)
    model_aliases: tuple[str, ...] = ()  # more names the API answers to (--served-model-name A B ...)
    # The request head (request line and header fields), as read off the socket: over a limit, 414/431.
    max_header_count: int = 100
    max_header_bytes: int = 64 << 10  # request line and header fields together
    max_request_line_bytes: int = 8 << 10
    header_timeout: float = 10.0  # seconds from a connection's or a request's first byte to its last header
    keep_alive_timeout: float = 5.0  # seconds an idle connection stays open between requests
    body_timeout: float = 60.0  # seconds from a request's head to the end of its body
    # CORS: off unless origins are given.
    allowed_origins: tuple[str, ...] = ()  # "*" for any
    allowed_methods: tuple[str, ...] = ("GET", "POST")
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Observability (docs/observability.md): OTLP traces, off unless an endpoint is given.
    otlp_traces_endpoint: str | None = None
    otlp_traces_sample_ratio: float | None = None  # None: OTEL_TRACES_SAMPLER / _ARG (default: every trace)
    metrics_compat: tuple[str, ...] = ()  # "vllm": vllm:-named series beside cadence's
    # The step-cost profile that predicts a waiting request's time to first token (GET
    # /v1/requests/{id}); None: the shipped profile the simulator uses; "none": no prediction.
    cost_profile: str | None = None

    def validate(self) -> ServerConfig:
        _require(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        _require(self.max_body_bytes >= 1024, "max_body_bytes", "must be >= 1024")
        _require(self.shutdown_timeout >= 0, "shutdown_timeout", "must be >= 0")
        _require(self.tenant_max_requests is None or self.tenant_max_requests >= 1, "tenant_max_requests", "must be >= 1")
        self._validate_http()
        self._validate_observability()
        return self

    def _validate_observability(self) -> None:
        ep = self.otlp_traces_endpoint
        _require(ep is None or _is_otlp_url(ep), "otlp_traces_endpoint",
                 f"must be a URL such as http://localhost:4318 (http, https or grpc, a host, a port "
                 f"in [1, 65535] if any), got {ep!r}")
        ratio = self.otlp_traces_sample_ratio
        _require(ratio is None or (is_finite(ratio) and 0.0 <= ratio <= 1.0), "otlp_traces_sample_ratio",
                 f"must be a number in [0, 1], got {ratio!r}")
        _require(all(c in METRICS_COMPAT for c in self.metrics_compat), "metrics_compat",
                 f"must be among {', '.join(METRICS_COMPAT)}, got {', '.join(self.metrics_compat)}")

    def _validate_http(self) -> None:
        _require(is_int(self.max_header_count) and self.max_header_count >= 1, "max_header_count", "must be an integer >= 1")
        _require(is_int(self.max_header_bytes) and self.max_header_bytes >= 1024, "max_header_bytes", "must be >= 1024 bytes")
        _require(
            is_int(self.max_request_line_bytes) and 64 <= self.max_request_line_bytes <= self.max_header_bytes,
            "max_request_line_bytes", f"must be between 64 bytes and max_header_bytes ({self.max_header_bytes})",
        )
        for name in ("header_timeout", "keep_alive_timeout", "body_timeout"):
            value = getattr(self, name)
            _require(is_finite(value) and value > 0, name, f"must be a number of seconds > 0, got {value!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            _require(isinstance(value, tuple) and all(isinstance(v, str) and v for v in value),
                     name, f"must be a tuple of non-empty strings, got {value!r}")
        _require(
            not (self.allow_credentials and "*" in self.allowed_origins), "allow_credentials",
            "cannot be combined with allowed_origins '*': any web page could then send credentialed requests",
        )


def _normalise(key: str, value: Any) -> Any:
    """The spellings an option may take from Python besides the stored one: a path object for
    `model`, a size string for `kv_cache_memory` (as on the command line), a dict or list of pairs
    for `tenant_weights`."""
    if key == "model" and isinstance(value, os.PathLike):
        return os.fspath(value)
    if key == "dtype" and isinstance(value, str):
        return DTYPE_ALIASES.get(value, value)
    if key == "max_model_len" and isinstance(value, str):
        try:
            return parse_human_int(value)
        except ValueError as e:
            raise ValueError(f"max_model_len: {e}") from None
    if key == "kv_cache_memory" and isinstance(value, float) and value.is_integer():
        return int(value)
    if key == "kv_cache_memory" and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as e:
            raise ValueError(f"kv_cache_memory: {e}") from None
    if key == "speculative_config" and value is not None:
        return SpeculativeConfig.parse(value)
    if key == "tenant_weights":
        if isinstance(value, dict):
            return tuple(value.items())
        if isinstance(value, list):
            return tuple(tuple(p) if isinstance(p, list) else p for p in value)
    return value


_SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
_FIELD_TO_SECTION: dict[str, str] = {f.name: sec for sec, cls in _SECTIONS.items() for f in fields(cls)}


def option_flags(name: str, value: Any) -> list[str]:
    """One engine option as `cadence serve` takes it: a boolean is --name or --no-name, tenant
    weights NAME=WEIGHT pairs, anything else --name VALUE."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{flag}" if value else f"--no-{flag}"]
    if name == "tenant_weights":
        return [f"--{flag}", ",".join(f"{k}={w}" for k, w in value)]
    if name == "speculative_config":
        spec = value if isinstance(value, dict) else SpeculativeConfig.parse(value).as_dict()
        return [f"--{flag}", json.dumps(spec)]
    return [f"--{flag}", str(value)]


# One line of help per engine option: `cadence serve --help` and `cadence generate --help` show it
# with the option's choices and default (tests/unit/test_cli_help.py checks that none is missing).
OPTION_HELP: dict[str, str] = {
    "model": "GGUF file or Hugging Face directory to serve (none: the default model, SmolLM2-135M-Instruct)",
    "dtype": "weights and activations; auto: bfloat16 where the CPU or GPU computes it fast, else float32 "
             "(half: float16, float: float32, as in vLLM)",
    "device": "auto: CUDA when present, else the CPU",
    "activation_dtype": "what a quantized checkpoint's linear layers multiply their weights with; auto: activations "
                        "in --dtype; int8: each input row quantized per block of 32 to int8 (the gate-up and output "
                        "layers' in two int8 terms, 15 bits), summed in integers against the GGUF Q4_1, Q4_0 and "
                        "Q8_0 blocks as stored (bfloat16 on a CPU with AVX512-VNNI only)",
    "max_model_len": "longest context (prompt + output) a request may use: 4096, or 32k (32000), 32K (32768), "
                     "1m (1000000), as vLLM reads them (none: the model's, at most 8192)",
    "served_model_name": "the model name the API answers to (none: the model file's name up to its first dot, "
                         "SmolLM2-135M-Instruct for the default model; a directory's name)",
    "chat_template": "a Jinja chat template, or the path of a file holding one, used instead of the model's "
                     "(under the same limits, checked at start-up)",
    "seed": "seeds sampling of requests that give no seed",
    "num_threads": "torch and kernel threads (none: one per core)",
    "step_timeout": "seconds one engine step may run before the server reports itself unhealthy; 0: no watchdog",
    "chat_template_timeout": "seconds rendering one chat with a chat template may take",
    "chat_template_max_chars": "characters a chat template may output, or build in any one string",
    "chat_template_max_iterations": "loop iterations and calls rendering one chat may take",
    "record_steps": "append each engine step's shape, duration, end time and process to this file as JSON lines, "
                    "to compare served steps with the simulator's cost model (benchmarks/serving_breakdown.py); "
                    "none: off",
    "block_size": "tokens per KV cache block (a power of two up to 128)",
    "kv_cache_memory": "size of the KV cache (512MiB, 2GiB, or bytes); the block count follows and is logged",
    "num_kv_blocks": "KV cache blocks, overriding --kv-cache-memory (none: from --kv-cache-memory)",
    "kv_cache_memory_fraction": "KV cache as a share of the memory available once the model is loaded "
                                "(RAM on CPU, free GPU memory on CUDA), at most 0.95, overriding --kv-cache-memory; "
                                "--gpu-memory-utilization is taken as this (unlike vLLM's, the share is of what "
                                "the loaded model leaves, for the KV cache alone, and on CPU of the RAM)",
    "kv_cache_dtype": "K/V storage: auto (the model's dtype) or int8 (8-bit values with a float32 scale per token "
                      "and KV head: the same --kv-cache-memory holds about twice the tokens of bfloat16); vLLM's "
                      "fp8, fp8_e4m3 and fp8_e5m2 are refused",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes seen before",
    "tenant_isolation": "prefix-cache hits only within a tenant (hashes salted with the tenant)",
    "prefix_caching_hash_algo": "block hash: sha256 (collisions cannot be crafted) or builtin (cheaper; trusted traffic)",
    "scheduler": "continuous: iteration-level batching; static: a batch runs until its last request ends",
    "policy": "order of the waiting queue: fcfs, priority (lower value first), fair (per-tenant shares), "
              "deadline (earliest first)",
    "max_num_seqs": "requests running at once",
    "max_num_batched_tokens": "tokens one step may compute (prefill chunks and decodes together)",
    "enable_chunked_prefill": "split long prompts across steps, sharing them with decodes",
    "long_prefill_token_threshold": "tokens one request's prefill chunk may take in a step; 0: only the step's budget",
    "max_num_partial_prefills": "requests that may be part-way through their prefill at once",
    "max_queue_len": "requests that may wait; beyond it new ones get 429",
    "max_queued_tokens": "prompt tokens that may wait; beyond it 429 (none: no bound)",
    "tenant_max_running": "running requests per tenant; more wait (none: no cap)",
    "tenant_weights": "fair-share weights, NAME=WEIGHT[,NAME=WEIGHT...]; unnamed tenants weigh 1",
    "deadline_aging": "seconds of waiting that count as one second nearer a deadline (deadline policy)",
    "speculative_config": 'speculative decoding as JSON, in vLLM\'s spelling: {"method": "ngram", '
                          '"num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B}, or '
                          '{"method": "draft_model", "model": PATH, "num_speculative_tokens": K} (none: off)',
}
OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": (*DTYPES, *DTYPE_ALIASES), "device": DEVICES, "activation_dtype": ACTIVATION_DTYPES,
    "scheduler": SCHEDULERS, "policy": POLICIES,
    "prefix_caching_hash_algo": HASH_ALGOS,
}


def engine_option_fields() -> list[tuple[str, dataclasses.Field[Any]]]:
    """(section, field) for every engine option, in declaration order: the CLI derives flags from it."""
    return [(sec, f) for sec, cls in _SECTIONS.items() for f in fields(cls)]
