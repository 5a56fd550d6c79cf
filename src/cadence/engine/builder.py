"""Assemble an engine from a config: checkpoint, tokenizer, model runner, engine core.

This is the one place that knows every part; the parts know only their neighbours' contracts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from cadence.clock import Clock
from cadence.config import EngineConfig, GiB
from cadence.engine.core import EngineCore
from cadence.executor.drafter import load_drafter
from cadence.executor.model_runner import ModelRunner
from cadence.executor.step_log import StepLog
from cadence.model.arch import ModelArchConfig
from cadence.model.cpu_kernels import cpu_flags
from cadence.model.llama import LlamaModel
from cadence.model.loader import default_model_path, load_checkpoint
from cadence.model.template_limits import RenderLimits
from cadence.model.tokenizer import Tokenizer
from cadence.structured import StructuredOutputs

log = logging.getLogger("cadence")

# Never plan for more context than this by default: the KV budget and attention cost grow with it.
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class Engine:
    core: EngineCore
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is present")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 dot products (AVX512-BF16 or AMX), where bf16 matmuls are ~4x fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def tiny_arch(vocab_size: int) -> ModelArchConfig:
    """A small random Llama for fast tests: real tokenizer, random weights, same code paths."""
    return ModelArchConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        name="cadence-tiny-random",
    )


def random_weights(arch: ModelArchConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face naming for `arch`."""
    g = torch.Generator().manual_seed(seed)
    h, i, hd = arch.hidden_size, arch.intermediate_size, arch.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.08).to(dtype)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(arch.vocab_size, h)}
    for n in range(arch.num_layers):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = rnd(arch.num_heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(arch.num_kv_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(arch.num_kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, arch.num_heads * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(i, h)
        w[p + "mlp.up_proj.weight"] = rnd(i, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, i)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    w["model.norm.weight"] = torch.ones(h, dtype=dtype)
    if not arch.tie_word_embeddings:
        w["lm_head.weight"] = rnd(arch.vocab_size, h)
    return w


def build_engine(config: EngineConfig, *, tiny: bool = False, clock: Clock | None = None) -> Engine:
    """Load the model named by `config` (the default model when None) and wire an EngineCore to it.

    `tiny=True` keeps the real tokenizer of the model but uses a small random-weight Llama: every
    code path of a real engine, at test speed.
    """
    config.validate()
    path = Path(config.model.model) if config.model.model else default_model_path()
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    limits = RenderLimits(
        config.model.chat_template_timeout,
        config.model.chat_template_max_chars,
        config.model.chat_template_max_iterations,
    )
    tokenizer = Tokenizer.from_model_path(path, limits, read_chat_template(config.model.chat_template))
    q4_1: dict[str, torch.Tensor] = {}
    q8_0: dict[str, torch.Tensor] = {}
    q4_0: dict[str, torch.Tensor] = {}
    if tiny:
        arch = tiny_arch(tokenizer.vocab_size)
        weights = random_weights(arch, seed=config.model.seed)
    else:
        ckpt = load_checkpoint(path, dtype)
        arch, weights, q4_1, q8_0, q4_0 = ckpt.arch, ckpt.weights, ckpt.q4_1, ckpt.q8_0, ckpt.q4_0
    runner = ModelRunner(arch, weights, dtype=dtype, device=device, q4_1=q4_1, q8_0=q8_0, q4_0=q4_0,
                         kv_cache_dtype=config.cache.kv_cache_dtype, activation_dtype=config.model.activation_dtype)
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        assert spec.model is not None  # (validated)
        runner.kv_blocks_given = config.cache.num_kv_blocks is not None
        runner.drafter = load_drafter(spec.model, arch.vocab_size, tokenizer.vocabulary(),
                                      block_size=config.cache.block_size, dtype=dtype, device=device)
        log.info("speculative decoding: draft model %s, up to %d drafts a step", spec.model, spec.num_speculative_tokens)
    config = resolve_kv_cache_fraction(config, device)
    max_len = config.model.max_model_len or min(arch.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_len} exceeds the model's context length ({arch.max_position_embeddings})"
        )
    structured = StructuredOutputs(tokenizer, arch.vocab_size)  # the grammar library loads on first use
    core = EngineCore(config, runner, clock=clock, max_model_len=max_len, eos_token_ids=tokenizer.eos_token_ids,
                      structured=structured)
    if runner.drafter is not None and core.scheduler.speculation is not None:
        # Adaptive k prices a draft pass at the draft model's weight bytes over the served model's: a
        # decode pass of a few rows is bound by reading its weights, and a draft's share of the layers
        # leaves out its output layer (a bfloat16 draft of 4 of 30 layers reads about what the Q4_1 model does).
        core.scheduler.speculation.draft_cost_ratio = draft_cost_ratio(runner.drafter.model, runner.model)
    if config.model.record_steps:
        core.step_observer = StepLog(config.model.record_steps, config.cache.block_size)
    name = config.model.served_model_name or (arch.name if tiny else _model_name(path))
    log.info("model %s (%s) on %s in %s, max_model_len %d", name, path.name, device, dtype, max_len)
    return Engine(core, tokenizer, name, max_len, arch.vocab_size, config, device, dtype)


def draft_cost_ratio(draft: LlamaModel, served: LlamaModel) -> float:
    """What a draft model's decode pass costs beside a served decode step: their weight bytes."""
    return draft.decode_weight_bytes / served.decode_weight_bytes


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: the text of the file it names, or the template itself (as vLLM reads it)."""
    if value is None:
        return None
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path:
        p = Path(value).expanduser()
        if not p.is_file():
            raise ValueError(f"chat_template: {value}: no such file (give a file or the template's text)")
        return p.read_text(encoding="utf-8")
    return value


def available_memory(device: torch.device) -> int:
    """Bytes this process could still take: free memory on the GPU, MemAvailable on the host."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("kv_cache_memory_fraction: this system does not report its available memory; "
                     "give --kv-cache-memory instead")


def resolve_kv_cache_fraction(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`kv_cache_memory_fraction` as bytes of `kv_cache_memory`, measured now (after the weights
    are loaded) and logged; the config unchanged when the fraction is not set or blocks are given."""
    cache = config.cache
    if cache.kv_cache_memory_fraction is None or cache.num_kv_blocks is not None:
        return config
    free = available_memory(device)
    size = int(free * cache.kv_cache_memory_fraction)
    log.info("KV cache memory: %g of the %.2f GiB available on %s = %.2f GiB (--kv-cache-memory-fraction)",
             cache.kv_cache_memory_fraction, free / GiB, device.type, size / GiB)
    return config.replace(kv_cache_memory=max(size, 1), kv_cache_memory_fraction=None)


def _model_name(path: Path) -> str:
    stem = path.stem if path.is_file() else path.name
    return stem.split(".")[0] if path.suffix == ".gguf" else stem
