"""The Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) in reading order.

    tokens -> embed -> N x [ x + attn(rmsnorm(x)) ; x + mlp(rmsnorm(x)) ] -> rmsnorm -> lm_head

One forward pass runs ONE FLAT BATCH: the tokens of every scheduled request concatenated (prefill
chunks and single decode tokens together), so every linear layer sees one [T, hidden] matrix.
Attention is the only place where requests are told apart, through `AttentionMetadata` and the
paged KV cache (model/attention.py). Shapes: T tokens in the batch, H query heads, KVH key/value
heads, D head_dim, E hidden size, F intermediate size, V vocabulary.

Weights arrive in Hugging Face naming and are fused at load: q, k and v into one [(H+2*KVH)*D, E]
matrix, gate and up into one [2F, E] matrix, because one large matmul beats three small ones.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadence.model.arch import ModelArchConfig
from cadence.model.attention import AttentionMetadata, PagedDecode, PagedKVCache, paged_attention
from cadence.model.cpu_kernels import (
    DL_FIELDS,
    CpuKernels,
    DecodeLayers,
    cpu_kernels,
    has_vnni,
    q4_1_kernels_enabled,
)

log = logging.getLogger("cadence.model")

# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight. [.., E] -> [.., E]

    torch's fused kernel accumulates in float32 whatever x's dtype: one op instead of eight.
    """
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_tables(arch: ModelArchConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for every position, [max_positions, D] each, float32.

    Checkpoints in Hugging Face layout rotate pairs (i, i + D/2). The sin table carries the sign of
    that rotation (-sin for the first half, +sin for the second) so `apply_rope` needs only a roll.
    """
    d = arch.head_dim
    # float32 throughout, as the reference computes it: float64 angles would be more exact but drift
    # from the checkpoint's reference by ~1e-5 at long positions.
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [D/2]
    # Room beyond the model's nominal context: a table lookup past the end would be an index error.
    n = max(arch.max_position_embeddings, 8192)
    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # [n, D]
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos.to(device), sin.to(device)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x in place: [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin] with x1, x2 the halves of D.

    x: [T, heads, D] (may be a strided view); cos, sin: [T, 1, D] from `rope_tables`.
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]
    torch.addcmul(x * cos, swapped, sin, out=x)


# ---------------------------------------------------------------------------------------------
# Weights, fused at load
# ---------------------------------------------------------------------------------------------


class Linear:
    """y = x @ weight.T + bias, [.., in] -> [.., out].

    bfloat16 on a CPU with AVX512-BF16: cadence's own kernel (model/cpu_kernels.py) on a weight
    packed for it at load. It streams the weights at about the memory bandwidth where oneDNN's GEMV
    reaches half of it (a single-stream step's linear layers 3x faster, 32 rows 1.3x), and sums
    every row in the same order whatever the batch, so outputs are bit-identical alone or batched.

    Otherwise on CPU the weight is packed once, at load, into oneDNN's blocked layout: measured
    here, bfloat16 matmuls of decode shapes (1 to 32 rows) run ~40% faster than F.linear on the
    plain weight, with identical results (float32: ~10-20% faster, equal to rounding). The packing
    is checked on a probe input; a torch build without these ops, or any mismatch, falls back to
    F.linear.

    Given `q4_1` (the GGUF blocks of this matrix) and the bfloat16 kernels, the layer computes on
    the four-bit values instead (`CpuKernels.linear_q4_1`): a third of the bytes a decode step reads.

    With `int8` (the engine's `activation_dtype`), on a CPU with AVX512-VNNI, a Q4_1, Q4_0 or Q8_0
    matrix (`q4_1`, `q4_0`, `q8_0`) is multiplied by its input quantized per row and block of 32 to int8, in
    integers (`CpuKernels.linear_q4_1_i8`, which also takes Q4_0 packed as Q4_1 with m = -8 d, and
    `linear_q8_0_i8`): `i8` holds it in that layout and `i8_format` says which.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, q4_1: torch.Tensor | None = None,
                 *, q8_0: torch.Tensor | None = None, q4_0: torch.Tensor | None = None,
                 int8: bool = False, int8_terms: int = 1) -> None:
        self.shape = tuple(weight.shape)  # (out, in)
        self.bias = bias
        self.kernel = cpu_kernels() if CpuKernels.supports(weight) else None
        # The kernel adds a float32 bias; torch's paths take `bias` as it is.
        self.kernel_bias = None if self.kernel is None or bias is None else bias.float().contiguous()
        self.i8, self.i8_format = self._pack_i8(q4_1, q8_0, q4_0) if int8 else (None, None)
        self.i8_terms = int8_terms  # 1: int8 activations; 2: in two int8 terms (15 bits)
        # A Q4_1 checkpoint's matrix, when the kernels are on: computed from its four-bit values.
        self.q4_1 = (self.kernel.pack_q4_1(q4_1, *self.shape)
                     if self.kernel is not None and q4_1 is not None and q4_1_kernels_enabled()
                     and self.i8 is None else None)
        if self.q4_1 is not None or self.i8 is not None:
            self.packed = None
        elif self.kernel is not None:
            self.packed = self.kernel.pack(weight)
        else:
            self.packed = _pack_for_cpu(weight.contiguous(), bias)
        # Keep only one copy of the weight: the packed one when there is one.
        self.weight = weight.contiguous() if self.packed is None and self.q4_1 is None and self.i8 is None else None
        self._forward = self._choose_forward()  # the one place the layer's path is chosen

    def _pack_i8(self, q4_1: torch.Tensor | None, q8_0: torch.Tensor | None,
                 q4_0: torch.Tensor | None) -> tuple[torch.Tensor | None, str | None]:
        """The matrix in the int8-activation kernels' layout, and its format; (None, None) where the
        kernels or VNNI are missing or the matrix is not Q4_1, Q4_0 or Q8_0 (it keeps its bfloat16
        path)."""
        if self.kernel is None or not has_vnni():
            return None, None
        if q4_1 is not None:
            return self.kernel.pack_q4_1_i8(q4_1, *self.shape), "Q4_1"
        if q4_0 is not None:
            return self.kernel.pack_q4_0_i8(q4_0, *self.shape), "Q4_0"
        if q8_0 is not None:
            return self.kernel.pack_q8_0_i8(q8_0, *self.shape), "Q8_0"
        return None, None

    @property
    def fused_kind(self) -> int | None:
        """The layer's weight kind in `CpuKernels.decode_layers` (`DecodeLayers.kinds`); None when
        it is not on the kernels."""
        if self.kernel is None:
            return None
        if self.i8 is not None:  # Q4_0 is packed as Q4_1
            return (3 if self.i8_format == "Q8_0" else 2) + 2 * (self.i8_terms - 1)
        return 1 if self.q4_1 is not None else 0 if self.packed is not None else None

    @property
    def kernel_weight(self) -> torch.Tensor | None:
        """The weight `fused_kind` names."""
        return self.i8 if self.i8 is not None else self.q4_1 if self.q4_1 is not None else self.packed

    @property
    def weight_bytes(self) -> int:
        """The bytes of weights one call reads, in the form its path computes from (a decode step of
        a few rows takes about the time its weights take to read)."""
        w = self.kernel_weight if self.kernel is not None else self.weight
        if w is None or w.is_mkldnn:  # (oneDNN's packed weight: the matrix's own size)
            return self.shape[0] * self.shape[1] * (self.packed.element_size() if self.packed is not None else 4)
        return w.numel() * w.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output in float32. On the bfloat16 kernel, the sums unrounded (the logits: a
        bfloat16 logit moves in steps of 0.125 at 25 and would settle near-ties by rounding)."""
        return self._float32(x)

    def _choose_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The layer's path, and with it (`_float32`) its float32 output: the bfloat16 kernel's
        unrounded sums, else the path's output converted."""
        n, kernel, bias = self.shape[0], self.kernel, self.kernel_bias
        self._float32: Callable[[torch.Tensor], torch.Tensor] = lambda x: self(x).float()
        if kernel is not None and self.i8 is not None:
            two = self.i8_terms == 2
            i8, self.path = self.i8, (f"cadence's kernel on the checkpoint's {self.i8_format} blocks, int8 activations"
                                      + (" in two terms" if two else ""))
            if self.i8_format == "Q8_0":
                f32, bf16 = ((kernel.linear_q8_0_i8x2_f32, kernel.linear_q8_0_i8x2) if two
                             else (kernel.linear_q8_0_i8_f32, kernel.linear_q8_0_i8))
                self._float32 = lambda x: f32(x, i8, n, bias)
                return lambda x: bf16(x, i8, n, bias)
            q4_i8 = kernel.linear_q4_1_i8x2 if two else kernel.linear_q4_1_i8
            return lambda x: q4_i8(x, i8, n, bias)
        if kernel is not None and self.q4_1 is not None:
            q4, self.path = self.q4_1, "cadence's kernel on the checkpoint's Q4_1 blocks"
            return lambda x: kernel.linear_q4_1(x, q4, n, bias)
        if kernel is not None and self.packed is not None:
            packed, self.path = self.packed, "cadence's kernel on bfloat16 weights"
            self._float32 = lambda x: kernel.linear_f32(x, packed, n, bias)
            return lambda x: kernel.linear(x, packed, n, bias)
        if self.packed is not None:
            onednn, self.path = self.packed, "oneDNN on packed weights"
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, self.bias, "none", [], "")
        weight, self.path = self.weight, "torch's linear"
        assert weight is not None
        return lambda x: F.linear(x, weight, self.bias)


def _pack_for_cpu(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        want = F.linear(probe, weight, bias)
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return None
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return packed if torch.allclose(got.float(), want.float(), rtol=tol, atol=tol) else None


class TorchOps:
    """Norms, RoPE and SwiGLU on torch ops: float32, CUDA, or bfloat16 without cadence's kernels."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, eps: float) -> None:
        self.cos, self.sin, self.dtype, self.eps = cos, sin, dtype, eps

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """x += delta (in place; skipped when None), then rms_norm(x) * weight. [T, E] -> [T, E]"""
        if delta is not None:
            x += delta
        return rms_norm(x, weight, self.eps)

    def rope_for(self, positions: torch.Tensor) -> Callable[[torch.Tensor, int], None]:
        """This step's rotary embedding: f(qkv [T, heads, D], n) rotates heads [0, n) in place.
        The table lookup is done here, once for all layers."""
        cos = self.cos[positions].to(self.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(self.dtype)[:, None, :]
        return lambda qkv, n: apply_rope_(qkv[:, :n], cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's silu(gate) * up from the fused [T, 2F] projection -> [T, F]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class KernelOps:
    """The same on cadence's bfloat16 CPU kernels (model/cpu_kernels.py)."""

    def __init__(self, kernels: CpuKernels, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> None:
        self.kernels, self.cos, self.sin, self.eps = kernels, cos, sin, eps

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.add_rms_norm(x, delta, weight, self.eps)

    def rope_for(self, positions: torch.Tensor) -> Callable[[torch.Tensor, int], None]:
        """The kernel reads the tables by position unchecked: checked here, once for all layers."""
        check_positions(positions, self.cos.shape[0])
        pos = positions.contiguous()
        return lambda qkv, n: self.kernels.rope_(qkv, n, pos, self.cos, self.sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)


def check_positions(positions: torch.Tensor, table_len: int) -> None:
    """Positions past the RoPE tables are an error (a kernel would read past them unchecked)."""
    if positions.numel() and int(positions.max()) >= table_len:
        raise ValueError(f"position {int(positions.max())} beyond the RoPE table ({table_len})")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [E]
    qkv: Linear  # [(H + 2*KVH) * D, E], with qwen2's bias
    o: Linear  # [E, H*D]
    post_norm: torch.Tensor  # [E]
    gate_up: Linear  # [2F, E]
    down: Linear  # [E, F]


def _take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise ValueError(f"weights: missing {name!r}")
    return weights[name]


# The linear layer kinds, and those whose inputs int8 activations quantize in two int8 terms (15
# bits, `Linear`) by default: the ones where one term's rounding costs the most agreement with the
# float32 model (docs/performance.md, "Quality of the reduced-precision paths").
LINEAR_KINDS = ("qkv", "o", "gate_up", "down", "output")
INT8_TWO_TERMS: frozenset[str] = frozenset({"gate_up", "output"})


def _load_layer(
    arch: ModelArchConfig, weights: dict[str, torch.Tensor], i: int, dtype: torch.dtype, device: torch.device,
    q4_1: dict[str, torch.Tensor], q8_0: dict[str, torch.Tensor], q4_0: dict[str, torch.Tensor], int8: bool,
    two_terms: frozenset[str],
) -> LayerWeights:
    p = f"model.layers.{i}."

    def w(name: str) -> torch.Tensor:
        return _take(weights, p + name).to(device=device, dtype=dtype)

    def blocks(stored: dict[str, torch.Tensor], *names: str) -> torch.Tensor | None:
        """The stored blocks of these matrices, rows concatenated as the fused weight's; None unless
        every part is in `stored` (on CPU)."""
        parts = [x for name in names if (x := stored.get(p + name)) is not None]
        if device.type != "cpu" or len(parts) != len(names):
            return None
        return torch.cat(parts)

    def linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, *names: str) -> Linear:
        if not int8:
            return Linear(weight, bias, blocks(q4_1, *names))
        return Linear(weight, bias, blocks(q4_1, *names), q8_0=blocks(q8_0, *names), q4_0=blocks(q4_0, *names),
                      int8=True, int8_terms=2 if kind in two_terms else 1)

    qkv = torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])
    expected = ((arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, arch.hidden_size)
    if tuple(qkv.shape) != expected:
        raise ValueError(f"layer {i}: fused qkv shape {tuple(qkv.shape)} != {expected} for this architecture")
    bias = None
    if arch.attention_bias:
        bias = torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
    return LayerWeights(
        input_norm=w("input_layernorm.weight"),
        qkv=linear("qkv", qkv, bias, "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        o=linear("o", w("self_attn.o_proj.weight"), None, "self_attn.o_proj.weight"),
        post_norm=w("post_attention_layernorm.weight"),
        gate_up=linear("gate_up", torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]), None,
                       "mlp.gate_proj.weight", "mlp.up_proj.weight"),
        down=linear("down", w("mlp.down_proj.weight"), None, "mlp.down_proj.weight"),
    )


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class LlamaModel:
    """Weights plus the forward pass; holds no per-request state (that lives in the KV cache)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        q4_1: dict[str, torch.Tensor] | None = None,
        q8_0: dict[str, torch.Tensor] | None = None,
        q4_0: dict[str, torch.Tensor] | None = None,
        activation_dtype: str = "auto",
        int8_two_terms: frozenset[str] = INT8_TWO_TERMS,
    ) -> None:
        """`q4_1`, `q8_0`, `q4_0`: a GGUF checkpoint's Q4_1, Q8_0 and Q4_0 matrices as stored
        (`Checkpoint.q4_1`, ...). In bfloat16 with the CPU kernels, Q4_1 layers compute on their blocks
        rather than on the dequantised `weights`; with `activation_dtype` "int8", Q4_1, Q4_0 and Q8_0
        layers (and a Q8_0 output layer) multiply them by int8-quantized activations (`Linear`), in two
        int8 terms for the kinds in `int8_two_terms` (of `LINEAR_KINDS`). "int8" where it cannot
        apply to any layer is a ValueError saying why (`int8_refusal`)."""
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        q4_1, q8_0, q4_0 = q4_1 or {}, q8_0 or {}, q4_0 or {}
        int8 = activation_dtype == "int8"
        if unknown := set(int8_two_terms) - set(LINEAR_KINDS):
            raise ValueError(f"int8_two_terms: {sorted(unknown)} are not of {LINEAR_KINDS}")
        two = 2 if "output" in int8_two_terms else 1
        if int8 and (reason := int8_refusal(dtype, self.device, bool(q4_1 or q8_0 or q4_0))) is not None:
            raise ValueError(f"activation_dtype: int8 {reason}")
        self.embed = _take(weights, "model.embed_tokens.weight").to(self.device, dtype).contiguous()  # [V, E]
        if tuple(self.embed.shape) != (arch.vocab_size, arch.hidden_size):
            raise ValueError(f"embed_tokens shape {tuple(self.embed.shape)} does not match the architecture")
        self.layers = [_load_layer(arch, weights, i, dtype, self.device, q4_1, q8_0, q4_0, int8,
                                   frozenset(int8_two_terms)) for i in range(arch.num_layers)]
        self.norm = _take(weights, "model.norm.weight").to(self.device, dtype)
        # The output layer with int8 activations: on Q8_0 blocks only (its float32 logits' kernel).
        if arch.tie_word_embeddings or "lm_head.weight" not in weights:
            # Tied: the output projection is the embedding table (SmolLM2 and small Qwen2).
            head_q8 = q8_0.get("model.embed_tokens.weight") if int8 else None
            self.lm_head = Linear(self.embed, q8_0=head_q8, int8=head_q8 is not None, int8_terms=two)
        else:
            head_q8 = q8_0.get("lm_head.weight") if int8 else None
            self.lm_head = Linear(weights["lm_head.weight"].to(self.device, dtype), q8_0=head_q8,
                                  int8=head_q8 is not None, int8_terms=two)  # [V, E]
        if self.lm_head.shape != (arch.vocab_size, arch.hidden_size):
            raise ValueError(f"lm_head shape {self.lm_head.shape} does not match the architecture")
        self.cos, self.sin = rope_tables(arch, self.device)
        # Norms, SwiGLU and RoPE through cadence's CPU kernels where its linear layers use them:
        # chosen here, once.
        self.kernels = self.lm_head.kernel
        self.ops: TorchOps | KernelOps = (
            KernelOps(self.kernels, self.cos, self.sin, arch.rms_norm_eps) if self.kernels is not None
            else TorchOps(self.cos, self.sin, dtype, arch.rms_norm_eps))
        # ... and decode attention, where the kernel handles the head layout.
        self.decode_kernels = self.kernels if self.kernels is not None and CpuKernels.supports_decode_attention(
            arch.num_heads, arch.num_kv_heads, arch.head_dim) else None
        self.q_size = arch.num_heads * arch.head_dim
        # All-decode steps run every layer in one kernel call (same kernels, same order, same bits).
        self.fused_decode = self._fused_decode_layers() if self.decode_kernels is not None else None
        paths = Counter(lin.path for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        log.info("linear layers: %s; output layer: %s", ", ".join(f"{k} x {v}" for k, v in paths.items()),
                 self.lm_head.path)

    @property
    def decode_weight_bytes(self) -> int:
        """The weight bytes a decode step reads: every decoder layer's matrices and the output
        layer (the embedding's rows are looked up, not read whole)."""
        layers = sum(lin.weight_bytes for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return layers + self.lm_head.weight_bytes

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids: [T]; logits_indices: [S] rows of the batch to predict from -> logits [S, V] float32."""
        hidden = self.hidden_states(input_ids, meta, kv_cache)  # [T, E]
        return self.logits(hidden[logits_indices])

    __call__ = forward

    def hidden_states(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache) -> torch.Tensor:
        """Run every decoder layer over the flat batch. [T] -> [T, E] (before the final norm)."""
        if self.fused_decode is not None and _all_decode(meta, input_ids.shape[0]):
            return self._decode_step(input_ids, meta, kv_cache)
        rope = self.ops.rope_for(meta.positions)
        add_norm = self.ops.add_norm
        x = F.embedding(input_ids, self.embed)  # [T, E]
        h = add_norm(x, None, self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            # Residuals are added in place (no new [T, E]), fused with the norm that reads them next.
            h = add_norm(x, self._attention(h, layer, rope, kv_cache.layer(i), meta), layer.post_norm)
            if i + 1 < len(self.layers):
                h = add_norm(x, self._mlp(h, layer), self.layers[i + 1].input_norm)
            else:
                x += self._mlp(h, layer)
        return x

    def _decode_step(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache) -> torch.Tensor:
        """`hidden_states` of a step of single-token rows, through `CpuKernels.decode_layers`."""
        assert self.kernels is not None and self.fused_decode is not None
        check_positions(meta.positions, self.cos.shape[0])
        d = meta.decodes[0]
        assert isinstance(d, PagedDecode)
        x = F.embedding(input_ids, self.embed)  # [T, E]
        x += self.kernels.decode_layers(x, self.fused_decode, kv_cache.kv, meta.slot_mapping, meta.positions,
                                        d.tables, d.lens, d.total_len)
        return x

    def _fused_decode_layers(self) -> DecodeLayers | None:
        """The layers' addresses for `decode_layers`; None where a layer is not all on the kernels."""
        pointers: list[list[int]] = []
        kinds: list[list[int]] = []
        keep: list[torch.Tensor] = []
        for layer in self.layers:
            fields: dict[str, torch.Tensor | None] = {"input_norm": layer.input_norm, "post_norm": layer.post_norm,
                                                      "qkv_bias": layer.qkv.kernel_bias}
            kind = []
            for name, lin in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down)):
                weight, fused_kind = lin.kernel_weight, lin.fused_kind
                if weight is None or fused_kind is None or (lin is not layer.qkv and lin.kernel_bias is not None):
                    return None
                kind.append(fused_kind)
                fields[name] = weight
            row = [fields[name] for name in DL_FIELDS]
            if any(t is not None and not t.is_contiguous() for t in row):
                return None
            pointers.append([0 if t is None else t.data_ptr() for t in row])
            kinds.append(kind)
            keep.extend(t for t in row if t is not None)
        a = self.arch
        return DecodeLayers(torch.tensor(pointers, dtype=torch.int64), torch.tensor(kinds, dtype=torch.int64),
                            self.cos, self.sin, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads,
                            a.head_dim, a.intermediate_size, a.rms_norm_eps, tuple(keep))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, E] -> [S, V] float32: the sampler always works in float32."""
        if hidden.shape[0] == 0:  # no request samples this step (all mid-prefill)
            return hidden.new_zeros(0, self.arch.vocab_size, dtype=torch.float32)
        return self.lm_head.float32(self.ops.add_norm(hidden.contiguous(), None, self.norm))

    def _attention(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        rope: Callable[[torch.Tensor, int], None],
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        h, kvh = self.arch.num_heads, self.arch.num_kv_heads
        qkv = layer.qkv(x).view(t, h + 2 * kvh, self.arch.head_dim)  # [T, H+2KVH, D]
        # q and k are rotated together and in place, so k and v stay adjacent in `qkv` and reach
        # the cache as one [T, 2, KVH, D] view without a copy.
        rope(qkv, h + kvh)
        q = qkv[:, :h]  # [T, H, D]
        kv = qkv[:, h:].unflatten(1, (2, kvh))  # [T, 2, KVH, D]
        o = paged_attention(q, kv, cache, meta)  # [T, H, D]
        return layer.o(o.reshape(t, self.q_size))  # [T, E]

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return layer.down(self.ops.silu_mul(layer.gate_up(x)))  # SwiGLU, [T, 2F] -> [T, F] -> [T, E]


def int8_refusal(dtype: torch.dtype, device: torch.device, quantized: bool) -> str | None:
    """Why int8 activations cannot apply to a model (None: they can). Asked for explicitly, they are
    refused with the reason rather than ignored, so that a run meant to measure them never measures
    the bfloat16 path instead."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"needs --dtype bfloat16 on the CPU (this model is {str(dtype).removeprefix('torch.')} on {device.type})"
    if cpu_kernels() is None:
        return "needs cadence's CPU kernels (AVX512-BF16 and a C compiler; the log says why they are off)"
    if not has_vnni():
        return "needs a CPU with AVX512-VNNI (vpdpbusd); this one lacks it"
    if not quantized:
        return ("needs a GGUF checkpoint with Q4_1, Q4_0 or Q8_0 matrices (it quantizes the activations those "
                "are multiplied with); this one has none")
    return None


def _all_decode(meta: AttentionMetadata, num_rows: int) -> bool:
    """Every row of the step a single-token decode, all read by the paged decode kernel."""
    return (not meta.prefills and len(meta.decodes) == 1 and isinstance(meta.decodes[0], PagedDecode)
            and meta.decodes[0].num_rows == num_rows)
