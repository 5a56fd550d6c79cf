"""cadence's own CPU kernels for bfloat16 models on AVX512-BF16 machines (kernels/cpu_bf16.c).

Why kernels of our own: a decode step multiplies a few rows by every weight of the model, so it is
bound by how fast the weights stream from memory. oneDNN's bfloat16 GEMV reads them at about half
the machine's bandwidth; `linear`, on a layout packed for it at load, reads them at about the
bandwidth. The rest of a small step is per-op overhead (~1,000 torch ops): `add_rms_norm`,
`silu_mul` and `rope_` do in one call what takes torch three to eight. A GGUF's Q4_1 matrices
run on their four-bit values (`pack_q4_1`, `linear_q4_1`); with int8 activations, Q4_1, Q4_0 and Q8_0
matrices run on AVX512-VNNI's integer dot products (`linear_q4_1_i8`, `linear_q8_0_i8`); and a step of single-token decodes runs
all decoder layers in one call (`decode_layers`). docs/performance.md has the figures. Every kernel computes a row the same way whatever else is in the batch, so a
request's output does not depend on its neighbours.

The C source ships in the package and is compiled on first use with the system's C compiler
(about a second), cached under ~/.cache/cadence/kernels by a hash of the source and flags, and
loaded through ctypes: no torch headers, no build step at install. Where the CPU lacks AVX512-BF16,
no compiler is found, the build fails, or CADENCE_CPU_KERNELS=0 is set, `cpu_kernels()` returns
None with the reason logged once, and the model keeps torch's oneDNN path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("cadence.model")

SOURCE = Path(__file__).with_name("kernels") / "cpu_bf16.c"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp",
         "-shared", "-fPIC"]
BLOCK_COLS = 64  # output columns per packed block (NB in the C source)
Q4_1_BLOCK, Q4_1_BYTES = 32, 20  # GGUF's Q4_1: 32 weights in 20 bytes (float16 d and m, 16 bytes of nibbles)
Q4_1_PACKED_BYTES = Q4_1_BLOCK // 2 * BLOCK_COLS + BLOCK_COLS * 4  # per 64 columns x 32 k (Q4_BYTES in the C)
Q8_0_BYTES = 34  # GGUF's Q8_0: 32 weights in 34 bytes (float16 d, 32 int8 q)
Q4_0_BYTES = 18  # GGUF's Q4_0: 32 weights in 18 bytes (float16 d, 16 bytes of nibbles; w = d (q - 8))
Q8_0_PACKED_BYTES = Q4_1_BLOCK * BLOCK_COLS + BLOCK_COLS * 2  # per 64 columns x 32 k (Q8_BYTES in the C)


_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Every exported function of kernels/cpu_bf16.c: (return type, argument types), in the C's order.
# tests/unit/test_kernel_abi.py parses the C prototypes and checks this table against them.
_SIGNATURES: dict[str, tuple[type[Any] | None, list[type[Any]]]] = {
    "cadence_pack": (None, [_P, _P, _I64, _I64]),
    "cadence_linear": (None, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_linear_f32": (None, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_pack_q4_1": (None, [_P, _P, _I64, _I64]),
    "cadence_decode_layers": (_INT, [_P] * 15 + [_I64, _P] + [_I64] * 10 + [_F32, _F32, _INT, _I64]),
    "cadence_linear_q4_1": (_INT, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_pack_q4_1_i8": (None, [_P, _P, _I64, _I64]),
    "cadence_pack_q4_0_i8": (None, [_P, _P, _I64, _I64]),
    "cadence_pack_q8_0_i8": (None, [_P, _P, _I64, _I64]),
    "cadence_linear_q4_1_i8": (_INT, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_linear_q8_0_i8": (_INT, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_linear_q8_0_i8_f32": (_INT, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_linear_q4_1_i8x2": (_INT, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_linear_q8_0_i8x2": (_INT, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_linear_q8_0_i8x2_f32": (_INT, [_P, _P, _P, _P, _I64, _I64, _I64, _INT]),
    "cadence_add_rms_norm": (None, [_P, _P, _P, _P, _I64, _I64, _F32, _INT]),
    "cadence_silu_mul": (None, [_P, _P, _I64, _I64, _INT]),
    "cadence_rope": (None, [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT]),
    "cadence_prefill_attention": (None, [_P, _I64, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32,
                                         _INT]),
    "cadence_sample": (_INT, [_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _INT]),
    "cadence_decode_attention": (None, [_P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                                        _F32, _I64, _INT]),
    "cadence_quantize_kv8": (None, [_P, _I64, _I64, _I64, _P, _P]),
    "cadence_decode_attention_kv8": (None, [_P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                                            _F32, _I64, _INT]),
    "cadence_prefill_attention_kv8": (None, [_P, _I64, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32,
                                             _INT]),
}
# One row of `DecodeLayers.pointers`: a layer's tensors in the order of the C's `DL_*` enum.
DL_FIELDS = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")
MAX_GROUP, MAX_HEAD_DIM = 8, 256  # the decode attention kernel's limits (MAX_GROUP, MAX_DIM in the C)
KV8_SCALE_BYTES = 4  # the 8-bit cache's float32 scale after each slot's int8 values (KV8_SCALE_BYTES in the C)


@dataclass(frozen=True)
class DecodeLayers:
    """A model's decoder layers as `decode_layers` reads them: per layer the addresses of its input
    norm, post norm, qkv, qkv bias (0: none), o, gate-up and down weights (`DL_*` in the C), and each
    linear's kind (0: `pack`'s bfloat16 layout, 1: `pack_q4_1`'s, 2: `pack_q4_1_i8`'s, 3:
    `pack_q8_0_i8`'s; 4 and 5: those two with the activations in two int8 terms). `keep` holds the tensors those addresses point into, so they live as long as
    this does."""

    pointers: torch.Tensor  # [layers, len(DL_FIELDS)] int64
    kinds: torch.Tensor  # [layers, 4] int64
    cos: torch.Tensor  # RoPE tables, float32 [P, D]
    sin: torch.Tensor
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    keep: tuple[torch.Tensor, ...]


def _kv8_layer(cache: torch.Tensor, head_dim: int) -> bool:
    """Whether a cache tensor is the 8-bit layout (checked: the C reads slots of D + 4 bytes)."""
    if cache.dtype == torch.bfloat16:
        assert cache.shape[-1] == head_dim, "cache: head_dim does not match the queries'"
        return False
    assert cache.dtype == torch.int8 and cache.shape[-1] == head_dim + KV8_SCALE_BYTES, "cache: bfloat16 or 8-bit"
    return True


def _bf16_rows(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()


class CpuKernels:
    """The loaded library. Weights: `pack` once at load, then `linear`. Activations: [rows, features]
    bfloat16 contiguous tensors (checked: the C code trusts its pointers)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (restype, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, restype
        # One attribute per C function, spelled out (not a loop of setattr) so that each wrapper's
        # use of its function is a name a reader and mypy can follow.
        self._pack = lib.cadence_pack
        self._linear = lib.cadence_linear
        self._linear_f32 = lib.cadence_linear_f32
        self._pack_q4_1 = lib.cadence_pack_q4_1
        self._linear_q4_1 = lib.cadence_linear_q4_1
        self._pack_q4_1_i8 = lib.cadence_pack_q4_1_i8
        self._pack_q4_0_i8 = lib.cadence_pack_q4_0_i8
        self._pack_q8_0_i8 = lib.cadence_pack_q8_0_i8
        self._linear_q4_1_i8 = lib.cadence_linear_q4_1_i8
        self._linear_q8_0_i8 = lib.cadence_linear_q8_0_i8
        self._linear_q8_0_i8_f32 = lib.cadence_linear_q8_0_i8_f32
        self._linear_q4_1_i8x2 = lib.cadence_linear_q4_1_i8x2
        self._linear_q8_0_i8x2 = lib.cadence_linear_q8_0_i8x2
        self._linear_q8_0_i8x2_f32 = lib.cadence_linear_q8_0_i8x2_f32
        self._add_rms_norm = lib.cadence_add_rms_norm
        self._silu_mul = lib.cadence_silu_mul
        self._rope = lib.cadence_rope
        self._decode_attention = lib.cadence_decode_attention
        self._decode_layers = lib.cadence_decode_layers
        self._prefill_attention = lib.cadence_prefill_attention
        self._sample = lib.cadence_sample
        self._quantize_kv8 = lib.cadence_quantize_kv8
        self._decode_attention_kv8 = lib.cadence_decode_attention_kv8
        self._prefill_attention_kv8 = lib.cadence_prefill_attention_kv8

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[1] % 2 == 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bfloat16 -> the kernel's blocked layout (N padded to a multiple of 64 with zeros)."""
        assert self.supports(weight), "pack: a 2-D bfloat16 CPU weight with an even K"
        w = weight.contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // BLOCK_COLS) * BLOCK_COLS * k, dtype=torch.bfloat16)
        self._pack(w.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x [.., K] bfloat16 -> [.., N] bfloat16; bias, when given, float32 [N]."""
        return self._matmul(self._linear, x, packed, n, bias, torch.bfloat16)

    def linear_f32(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear`, the output float32 and unrounded: the logits."""
        return self._matmul(self._linear_f32, x, packed, n, bias, torch.float32)

    def pack_q4_1(self, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """GGUF Q4_1 blocks of an [N, K] weight (uint8 [N, K/32*20], rows in the model's order) ->
        the layout `linear_q4_1` reads (columns padded to a multiple of 64 with zeros)."""
        assert k % Q4_1_BLOCK == 0, "pack_q4_1: K must be a multiple of 32"
        assert raw.dtype == torch.uint8 and tuple(raw.shape) == (n, k // Q4_1_BLOCK * Q4_1_BYTES)
        raw = raw.contiguous()
        packed = torch.empty(-(-n // BLOCK_COLS) * (k // Q4_1_BLOCK) * Q4_1_PACKED_BYTES, dtype=torch.uint8)
        self._pack_q4_1(raw.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear_q4_1(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear`, on `pack_q4_1`'s layout: the checkpoint's exact weights (d q + m in float32,
        not rounded to bfloat16), each row computed the same way whatever the batch."""
        return self._matmul(self._linear_q4_1, x, packed, n, bias, torch.bfloat16)

    # -- int8 activations against the checkpoint's quantized blocks (AVX512-VNNI: `has_vnni`) --

    def pack_q4_1_i8(self, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """GGUF Q4_1 blocks of an [N, K] weight (as `pack_q4_1` takes them) -> the layout
        `linear_q4_1_i8` reads."""
        return self._pack_blocks(self._pack_q4_1_i8, raw, n, k, Q4_1_BYTES, Q4_1_PACKED_BYTES)

    def pack_q4_0_i8(self, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """GGUF Q4_0 blocks of an [N, K] weight (uint8 [N, K/32*18]) -> `pack_q4_1_i8`'s layout (with
        m = -8 d), which `linear_q4_1_i8` reads."""
        return self._pack_blocks(self._pack_q4_0_i8, raw, n, k, Q4_0_BYTES, Q4_1_PACKED_BYTES)

    def pack_q8_0_i8(self, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """GGUF Q8_0 blocks of an [N, K] weight (uint8 [N, K/32*34]) -> the layout `linear_q8_0_i8` reads."""
        return self._pack_blocks(self._pack_q8_0_i8, raw, n, k, Q8_0_BYTES, Q8_0_PACKED_BYTES)

    def _pack_blocks(self, fn: Callable[..., None], raw: torch.Tensor, n: int, k: int, raw_bytes: int,
                     packed_bytes: int) -> torch.Tensor:
        assert has_vnni(), "the int8 kernels need AVX512-VNNI"
        assert k % Q4_1_BLOCK == 0, "pack: K must be a multiple of 32"
        assert raw.dtype == torch.uint8 and tuple(raw.shape) == (n, k // Q4_1_BLOCK * raw_bytes)
        raw = raw.contiguous()
        packed = torch.empty(-(-n // BLOCK_COLS) * (k // Q4_1_BLOCK) * packed_bytes, dtype=torch.uint8)
        fn(raw.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear_q4_1_i8(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear_q4_1`, with each row of x quantized per block of 32 to int8 (its own scale
        per block) and the products summed exactly in integers: each row the same whatever the batch."""
        return self._matmul(self._linear_q4_1_i8, x, packed, n, bias, torch.bfloat16)

    def linear_q8_0_i8(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear_q4_1_i8`, on `pack_q8_0_i8`'s layout."""
        return self._matmul(self._linear_q8_0_i8, x, packed, n, bias, torch.bfloat16)

    def linear_q8_0_i8_f32(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                           bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear_q8_0_i8`, the output float32 and unrounded: the logits."""
        return self._matmul(self._linear_q8_0_i8_f32, x, packed, n, bias, torch.float32)

    def linear_q4_1_i8x2(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear_q4_1_i8`, each block of 32 of x quantized to 15 bits, Q = 128 qx + qr (scale
        max|x| / (127 * 128)), in two int8 terms whose integer sums combine exactly: twice the
        integer products, a rounding step 128 times finer."""
        return self._matmul(self._linear_q4_1_i8x2, x, packed, n, bias, torch.bfloat16)

    def linear_q8_0_i8x2(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear_q4_1_i8x2`, on `pack_q8_0_i8`'s layout."""
        return self._matmul(self._linear_q8_0_i8x2, x, packed, n, bias, torch.bfloat16)

    def linear_q8_0_i8x2_f32(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                             bias: torch.Tensor | None) -> torch.Tensor:
        """As `linear_q8_0_i8x2`, the output float32 and unrounded: the logits."""
        return self._matmul(self._linear_q8_0_i8x2_f32, x, packed, n, bias, torch.float32)

    @staticmethod
    def _matmul(fn: Callable[..., int | None], x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
        """x [.., K] bfloat16 through one of the linear kernels into a new [.., N] `dtype` tensor."""
        assert x.dtype == torch.bfloat16 and x.device.type == "cpu", "linear: a bfloat16 CPU input"
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        m = x2.shape[0]
        y = torch.empty(m, n, dtype=dtype)
        if m and fn(x2.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                    m, n, k, torch.get_num_threads()):
            raise MemoryError("linear: the kernel could not allocate its buffer")
        return y.view(*x.shape[:-1], n)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += delta (in place, skipped when None), then rms_norm(x) * weight. [T, E] -> [T, E]."""
        assert _bf16_rows(x) and (delta is None or (_bf16_rows(delta) and delta.shape == x.shape))
        assert weight.dtype == torch.bfloat16 and weight.shape == x.shape[1:] and weight.is_contiguous()
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's silu(gate) * up from the fused [T, 2F] projection -> [T, F]."""
        assert _bf16_rows(gate_up) and gate_up.shape[1] % 2 == 0
        t, f = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(t, f, dtype=torch.bfloat16)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), t, f, torch.get_num_threads())
        return out

    def rope_(self, qkv: torch.Tensor, rot_heads: int, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
        """Rotate heads [0, rot_heads) of qkv [T, heads, D] in place at `positions` [T] (int64), with
        float32 tables cos and signed sin [P, D] (model/llama.py's `rope_tables`). Every position must
        be < P: the caller checks once per step, not once per layer."""
        t, heads, d = qkv.shape
        assert qkv.dtype == torch.bfloat16 and qkv.is_contiguous() and rot_heads <= heads
        assert positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == (t,)
        assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.shape[1] == d
        assert cos.is_contiguous() and sin.is_contiguous()
        self._rope(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads, rot_heads, d,
                   torch.get_num_threads())


    @staticmethod
    def supports_decode_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
                and head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM)

    def decode_attention(self, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                         total_len: int) -> torch.Tensor:
        """One query token per row against its context in the paged cache, read in place.

        q: [B, H, D] bfloat16, rows may be strided (a view into the fused qkv output); cache: one
        layer [2, KVH, num_blocks, block_size, D] bfloat16, or the 8-bit cache's int8 [.., D + 4]
        (model/attention.py, `quantize_kv`); tables: [B, W] int64 block ids; lens: [B] int64
        context lengths (this step's K/V already written); total_len = sum(lens). -> [B, H, D].
        Block ids and lengths are the caller's to check (the runner validates every block table).
        A row's result is the bits `prefill_attention` gives the same query at the same position.
        """
        b, h, d = q.shape
        _, kvh, num_blocks, bs, _ = cache.shape
        fn = self._decode_attention_kv8 if _kv8_layer(cache, d) else self._decode_attention
        assert q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == d
        assert cache.is_contiguous() and tables.dtype == lens.dtype == torch.int64
        assert tables.is_contiguous() and lens.is_contiguous() and tables.shape[0] == lens.shape[0] == b
        out = torch.empty(b, h, d, dtype=torch.bfloat16)
        fn(q.data_ptr(), q.stride(0), cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
           out.data_ptr(), b, h, kvh, d, bs, num_blocks, d**-0.5, total_len, torch.get_num_threads())
        return out

    def prefill_attention(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, start: int) -> torch.Tensor:
        """A chunk of one request's queries at positions start .. start+n-1, causal over its context
        read in place from the paged cache (this chunk's K/V already written): no gather, no mask.

        q: [n, H, D] bfloat16 (rows may be strided); cache: one layer; table: [nb] int64 block ids
        covering positions 0 .. start+n-1 (their ids are the caller's to check). -> [n, H, D].
        A query's result depends on its own row and context only: not on how the prompt was chunked,
        and not on whether it is computed here or as a decode row (`decode_attention`).
        """
        n, h, d = q.shape
        _, kvh, num_blocks, bs, _ = cache.shape
        fn = self._prefill_attention_kv8 if _kv8_layer(cache, d) else self._prefill_attention
        assert q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == d
        assert cache.is_contiguous() and table.dtype == torch.int64 and table.is_contiguous()
        assert table.shape[0] * bs >= start + n
        out = torch.empty(n, h, d, dtype=torch.bfloat16)
        fn(q.data_ptr(), q.stride(0), cache.data_ptr(), table.data_ptr(), start, n, out.data_ptr(), h, kvh, d, bs,
           num_blocks, d**-0.5, torch.get_num_threads())
        return out

    def quantize_kv8(self, x: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Rows x [N, D] bfloat16 (rows may be strided) into the 8-bit slots `slots` [N] (int64) of
        out, int8 [.., D + 4] viewed as [S, D + 4]: the bits `quantize_kv` gives (slots unchecked)."""
        n, d = x.shape
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and d % 16 == 0
        assert out.dtype == torch.int8 and out.is_contiguous() and out.shape[-1] == d + KV8_SCALE_BYTES
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (n,)
        self._quantize_kv8(x.data_ptr(), x.stride(0), n, d, slots.data_ptr(), out.data_ptr())

    def store_kv8(self, kv: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
        """A step's K/V rows kv [T, 2, KVH, D] bfloat16 (rows may be strided: a view into the fused
        qkv output) into their slots [T] (int64, unchecked) of one layer of the 8-bit cache
        [2, KVH, num_blocks, block_size, D + 4]: `quantize_kv8` per K/V head, without a torch op."""
        t, two, kvh, d = kv.shape
        assert two == 2 and kv.dtype == torch.bfloat16 and kv.stride(3) == 1 and kv.stride(2) == d and d % 16 == 0
        assert kv.stride(1) == kvh * d and cache.shape[:2] == (2, kvh) and _kv8_layer(cache, d) and cache.is_contiguous()
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (t,)
        plane = cache.shape[2] * cache.shape[3] * (d + KV8_SCALE_BYTES)  # bytes of one K or V head
        for s in range(2 * kvh):  # K heads, then V heads: as kv's and the cache's order
            self._quantize_kv8(kv.data_ptr() + 2 * s * d, kv.stride(0), t, d, slots.data_ptr(),
                               cache.data_ptr() + s * plane)

    def sample(self, logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor | None = None,
               top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of logits [S, V] float32 from softmax(logits / temps) at the uniforms
        u [S] in [0, 1) (inverse CDF, as a cumulative sum and a search would draw it). -> [S] int64.
        Tokens more than e^87 times less likely than the row's top one (filtered -inf ones among
        them) are never drawn. top_k (int64, 0 = off), top_p (1 = off), min_p (0 = off): per-row
        filters [S], each None when no row uses it; a filtered row draws among the tokens that
        `filter_logits` keeps (ties at the cut: lower token ids first)."""
        assert logits.dtype == temps.dtype == u.dtype == torch.float32 and logits.dim() == 2
        assert logits.device.type == "cpu" and logits.is_contiguous() and temps.is_contiguous() and u.is_contiguous()
        s, v = logits.shape
        assert temps.shape == u.shape == (s,)
        filters = []
        for t, dtype in ((top_k, torch.int64), (top_p, torch.float32), (min_p, torch.float32)):
            assert t is None or (t.dtype == dtype and t.shape == (s,) and t.is_contiguous() and t.device.type == "cpu")
            filters.append(None if t is None else t.data_ptr())
        out = torch.empty(s, dtype=torch.int64)
        if self._sample(logits.data_ptr(), s, v, temps.data_ptr(), u.data_ptr(), *filters, out.data_ptr(),
                        torch.get_num_threads()) != 0:
            raise MemoryError("cadence_sample: out of memory for a filtered row's buffers")
        return out

    def decode_layers(self, x: torch.Tensor, layers: DecodeLayers, cache: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, total_len: int) -> torch.Tensor:
        """Every decoder layer of an all-decode step in one call (kernels/cpu_bf16.c,
        `cadence_decode_layers`): x [T, E] (embedded tokens) becomes the residual stream in place;
        returns the last layer's MLP output [T, E], for the caller to add. cache: the whole paged
        cache [layers, 2, KVH, num_blocks, block_size, D]; slots, positions, tables, lens: int64, as
        `decode_attention` and the runner's metadata have them (checked by the runner)."""
        t, e = x.shape
        kv8 = _kv8_layer(cache, layers.head_dim)
        assert _bf16_rows(x) and e == layers.hidden and cache.is_contiguous()
        assert kv8 or (cache.dtype == torch.bfloat16 and cache.shape[5] == layers.head_dim)
        assert cache.shape[0] == layers.num_layers and tuple(cache.shape[1:3]) == (2, layers.kv_heads)
        for v in (slots, positions, lens):
            assert v.dtype == torch.int64 and v.is_contiguous() and v.shape == (t,)
        assert tables.dtype == torch.int64 and tables.is_contiguous() and tables.shape[0] == t
        d, f, h, kvh = layers.head_dim, layers.intermediate, layers.heads, layers.kv_heads
        hid, delta = torch.empty(t, e, dtype=torch.bfloat16), torch.empty(t, e, dtype=torch.bfloat16)
        qkv = torch.empty(t, (h + 2 * kvh) * d, dtype=torch.bfloat16)
        attn = torch.empty(t, h * d, dtype=torch.bfloat16)
        gu, act = torch.empty(t, 2 * f, dtype=torch.bfloat16), torch.empty(t, f, dtype=torch.bfloat16)
        rc = self._decode_layers(
            x.data_ptr(), hid.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gu.data_ptr(), act.data_ptr(),
            delta.data_ptr(), layers.pointers.data_ptr(), layers.kinds.data_ptr(), cache.data_ptr(),
            slots.data_ptr(), positions.data_ptr(), layers.cos.data_ptr(), layers.sin.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), total_len, t, layers.num_layers, e, h, kvh, d, f, cache.shape[4],
            cache.shape[3], layers.eps, d**-0.5, torch.get_num_threads(), int(kv8))
        if rc:
            raise MemoryError("decode_layers: a kernel could not allocate its buffer")
        return delta


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (its first `flags` line); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _cpu_has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw"} <= cpu_flags()


def has_vnni() -> bool:
    """Whether the CPU has AVX512-VNNI's `vpdpbusd`, which the int8-activation kernels use."""
    return "avx512_vnni" in cpu_flags()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "cadence" / "kernels"


def _build(compiler: str) -> Path:
    """Compile once per source and flags, into the user's cache (or, where that is not writable, the
    temporary directory); concurrent builders each write a temporary file and rename it into place,
    so no one ever loads a half-written library."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    name = f"cpu_bf16-{digest}.so"
    fallback = Path(tempfile.gettempdir()) / f"cadence-kernels-{os.getuid()}"
    for directory in (_cache_dir(), fallback):
        if (directory / name).exists():
            return directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        except OSError:
            continue
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-400:]}")
            os.replace(tmp, directory / name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return directory / name
    raise RuntimeError(f"no writable directory for the compiled kernels ({_cache_dir()}, {fallback})")


def _probe(kernel: CpuKernels) -> str | None:
    """The loaded linear kernel against torch on shapes that exercise every tile height and a ragged
    N: a library that loads but computes wrongly (a miscompile, a wrong CPU flag) is not used."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(100, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(100, generator=gen)
    x = torch.randn(13, 64, generator=gen).to(torch.bfloat16)
    got = kernel.linear(x, kernel.pack(w), 100, b).float()
    want = x.float() @ w.float().T + b
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
        return f"probe mismatch (max error {(got - want).abs().max().item():.3g})"
    return None


def q4_1_kernels_enabled() -> bool:
    """Whether Q4_1 layers compute on their four-bit values (CADENCE_Q4_KERNELS=0: on the dequantised
    bfloat16 weights, as before; the outputs differ in the last bits, not in quality)."""
    return os.environ.get("CADENCE_Q4_KERNELS", "1") != "0"


@cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and checked on first call; None (reason logged once) where unavailable."""
    if os.environ.get("CADENCE_CPU_KERNELS", "1") == "0":
        return _unavailable("disabled by CADENCE_CPU_KERNELS=0")
    if not sys.platform.startswith("linux") or not _cpu_has_avx512_bf16():
        return _unavailable("this CPU lacks AVX512-BF16")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return _unavailable("no C compiler (cc or gcc) on PATH")
    try:
        kernel = CpuKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return _unavailable(f"build failed: {exc}")
    reason = _probe(kernel)
    if reason is not None:
        return _unavailable(reason)
    log.info("CPU kernels: bfloat16 layers run on cadence's AVX512-BF16 kernels")
    return kernel


def _unavailable(reason: str) -> CpuKernels | None:
    """None, the reason logged."""
    log.info("CPU kernels not used (%s): bfloat16 layers run on torch ops", reason)
    return None
