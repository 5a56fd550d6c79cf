"""The int8-activation kernels (model/cpu_kernels.py, `linear_q4_1_i8`, `linear_q8_0_i8`) against
float64 references, and their batch invariance.

Each row of x is quantized per block of 32 to int8 (scale max|x| / 127, round to nearest even);
the reference does the same in float32 (as the kernel) and then multiplies in float64 by the
checkpoint's exact weights. What is left between the two is float32 summation and the output's
rounding. A second bound ties the result to the unquantized x: the quantization moves each x by at
most half a step, sx / 2 = max|x| / 254 of its block.

The two-term kernels (`_i8x2`) quantize each block to Q = 128 qx + qr, |Q| <= 127 * 128 (scale
max|x| / 16256), and sum both int8 terms: the same references with 16256 levels for 127.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_cpu_kernels import bf16, kernel_model, needs_kernels, q4_1_matrix

from cadence.model import cpu_kernels as ck

needs_vnni = pytest.mark.skipif(not ck.has_vnni(), reason="CPU without AVX512-VNNI: the int8 path is refused")
pytestmark = [needs_kernels, needs_vnni]


@pytest.fixture(scope="module")
def kernels() -> ck.CpuKernels:
    k = ck.cpu_kernels()
    assert k is not None
    return k


def q8_0_matrix(n: int, k: int, seed: int, scale: float = 0.05, kind: str = "Q8_0") -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] matrix quantized by gguf's own code, Q8_0 (or `kind`): (its blocks, uint8
    [n, k/32*34] for Q8_0; the float64 weights they stand for, d * q)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy() * scale
    raw = quantize(w.astype("float32"), qtype)
    exact = torch.from_numpy(dequantize(raw, qtype).astype("float64"))
    return torch.from_numpy(raw.copy()).view(torch.uint8).reshape(n, -1), exact


ONE_TERM, TWO_TERMS = 127.0, 127.0 * 128.0  # a block's levels each side of 0


def quantized_rows(x: torch.Tensor, levels: float = ONE_TERM) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bfloat16 as the kernel quantizes it: (q * sx in float64, [M, K]; max|x| per block
    of 32, [M, K/32])."""
    blocks = x.float().unflatten(1, (-1, 32))  # [M, K/32, 32]
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(levels) / amax, torch.zeros(()))  # float32, as the kernel
    q = torch.round(blocks * inv)  # half to even, as vcvtps2dq
    sx = amax / torch.tensor(levels)
    return (q.double() * sx.double()).flatten(1), amax.squeeze(-1).double()


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_ulp: float,
          levels: float = ONE_TERM) -> None:
    """got against both references: float64 with x quantized (float32 sums and the output's
    rounding, `out_ulp` relative), and float64 with x as given (plus half a quantization step)."""
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    xq, amax = quantized_rows(x, levels)
    want = xq @ w.T + b
    mags = xq.abs() @ w.abs().T
    assert ((got.double() - want).abs() <= want.abs() * out_ulp + 1e-6 * mags + 1e-6).all()
    # |sum_k w (x - xq)| <= sum_blocks max|x| / (2 levels) * sum_{k in block} |w|
    step = (amax / (2 * levels)) @ w.abs().unflatten(1, (-1, 32)).sum(-1).T
    exact = x.double() @ w.T + b
    assert ((got.double() - exact).abs() <= step + exact.abs() * out_ulp + 1e-6 * mags + 1e-6).all()
    # The bound is not vacuous: int8 activations differ from bfloat16 ones, by far less than the step
    # (two terms' step is below a bfloat16 output's rounding).
    if levels == ONE_TERM:
        assert (got.double() - exact).abs().max() < step.max()


def rows_batch_invariant(fn, x: torch.Tensor, got: torch.Tensor) -> None:
    """Every tile shape (up to 6 rows over 64 columns below 12 rows, 6-row tiles over 32 columns from
    12): each row bit-identical whatever the batch."""
    for m in (1, 2, 3, 4, 5, 6, 8, 11, 12, 13, 17, 25, 39):
        assert torch.equal(fn(x[:m]), got[:m]), f"{m}-row batch differs"
    assert torch.equal(fn(x[29:30])[0], got[29])
    assert torch.equal(fn(x.flip(0)).flip(0), got), "row order changed a row's result"
    assert fn(x[:0]).shape == (0, got.shape[1])


@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (64, 1536), (17, 32)])
def test_q4_1_i8_matches_float64_and_is_batch_invariant(kernels, n, k):
    raw, w = q4_1_matrix(n, k, seed=6)
    x = bf16(40, k, seed=7)
    x[3, :32] = 0  # an all-zero block: scale 0, no division by zero
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    packed = kernels.pack_q4_1_i8(raw, n, k)
    got = kernels.linear_q4_1_i8(x, packed, n, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (40, n)
    check(got, x, w, bias, 2**-8)
    rows_batch_invariant(lambda v: kernels.linear_q4_1_i8(v, packed, n, bias), x, got)


@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (64, 1536), (17, 32)])
def test_q8_0_i8_matches_float64_and_is_batch_invariant(kernels, n, k):
    raw, w = q8_0_matrix(n, k, seed=16)
    x = bf16(40, k, seed=17, scale=3.0)
    x[5, -32:] = 0
    x[6, :32] = -x[6, :32].abs()  # a block of one sign, its extreme at -127
    bias = torch.randn(n, generator=torch.Generator().manual_seed(18))
    packed = kernels.pack_q8_0_i8(raw, n, k)
    got = kernels.linear_q8_0_i8(x, packed, n, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (40, n)
    check(got, x, w, bias, 2**-8)
    rows_batch_invariant(lambda v: kernels.linear_q8_0_i8(v, packed, n, bias), x, got)
    # The logits' variant: the same sums, unrounded.
    f32 = kernels.linear_q8_0_i8_f32(x, packed, n, bias)
    assert f32.dtype == torch.float32 and torch.equal(f32.to(torch.bfloat16), got)
    check(f32, x, w, bias, 2**-20)
    rows_batch_invariant(lambda v: kernels.linear_q8_0_i8_f32(v, packed, n, bias), x, f32)


@pytest.mark.parametrize("n,k", [(960, 576), (17, 32)])
def test_q4_0_i8_matches_float64_and_is_batch_invariant(kernels, n, k):
    """Q4_0 (w = d (q - 8)) packed as Q4_1 with m = -8 d, through the Q4_1 kernel."""
    raw, w = q8_0_matrix(n, k, seed=26, kind="Q4_0")
    assert raw.shape == (n, k // 32 * 18)
    x = bf16(40, k, seed=27)
    packed = kernels.pack_q4_0_i8(raw, n, k)
    got = kernels.linear_q4_1_i8(x, packed, n, None)
    check(got, x, w, None, 2**-8)
    rows_batch_invariant(lambda v: kernels.linear_q4_1_i8(v, packed, n, None), x, got)


@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (64, 1536), (17, 32)])
def test_q4_1_i8x2_matches_float64_and_is_batch_invariant(kernels, n, k):
    """Two int8 terms: the 15-bit quantization's reference, within a step 128 times finer."""
    raw, w = q4_1_matrix(n, k, seed=36)
    x = bf16(40, k, seed=37, scale=3.0)
    x[3, :32] = 0
    x[4, -32:] = -x[4, -32:].abs()  # its extreme at Q = -16256: qx = -127, qr = 0
    bias = torch.randn(n, generator=torch.Generator().manual_seed(38))
    packed = kernels.pack_q4_1_i8(raw, n, k)
    got = kernels.linear_q4_1_i8x2(x, packed, n, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (40, n)
    check(got, x, w, bias, 2**-8, TWO_TERMS)
    rows_batch_invariant(lambda v: kernels.linear_q4_1_i8x2(v, packed, n, bias), x, got)


@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (64, 1536), (17, 32)])
def test_q8_0_i8x2_matches_float64_and_is_batch_invariant(kernels, n, k):
    raw, w = q8_0_matrix(n, k, seed=46)
    x = bf16(40, k, seed=47, scale=3.0)
    x[5, -32:] = 0
    x[6, :32] = -x[6, :32].abs()
    x[7, :32] = x[7, :32].abs()  # every weight times the largest terms: the int32 sums' widest
    bias = torch.randn(n, generator=torch.Generator().manual_seed(48))
    packed = kernels.pack_q8_0_i8(raw, n, k)
    got = kernels.linear_q8_0_i8x2(x, packed, n, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (40, n)
    check(got, x, w, bias, 2**-8, TWO_TERMS)
    rows_batch_invariant(lambda v: kernels.linear_q8_0_i8x2(v, packed, n, bias), x, got)
    f32 = kernels.linear_q8_0_i8x2_f32(x, packed, n, bias)
    assert f32.dtype == torch.float32 and torch.equal(f32.to(torch.bfloat16), got)
    check(f32, x, w, bias, 2**-20, TWO_TERMS)
    rows_batch_invariant(lambda v: kernels.linear_q8_0_i8x2_f32(v, packed, n, bias), x, f32)
    # Finer than one term: nearer the unquantized product than the one-term kernel, row by row (but
    # an all-zero row, exact in both).
    exact = x.double() @ w.T + bias.double()
    err_two = (f32.double() - exact).abs().amax(1)
    err_one = (kernels.linear_q8_0_i8_f32(x, packed, n, bias).double() - exact).abs().amax(1)
    assert ((err_two < err_one) | (err_one == 0)).all() and (err_one > 0).sum() >= 39


def test_packing_refuses_partial_blocks(kernels):
    raw, _ = q8_0_matrix(64, 64, seed=1)
    with pytest.raises(AssertionError):
        kernels.pack_q8_0_i8(raw[:, :-1], 64, 64)
    raw4, _ = q4_1_matrix(64, 64, seed=1)
    with pytest.raises(AssertionError):
        kernels.pack_q4_1_i8(raw4, 64, 48)


def int8_model(seed: int) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(arch, weights, q4_1, q8_0, q4_0) of a random model as a GGUF's: the projections Q4_1 but the
    down projections Q8_0 and the o projections Q4_0, and the (tied) embedding Q8_0, as the default
    model's; the weights the blocks' exact values."""
    arch, weights, q4_1 = kernel_model(True, False, seed=seed)
    q8_0, q4_0 = {}, {}
    for name in [n for n in weights if n.endswith(("down_proj.weight", "o_proj.weight"))
                 or n == "model.embed_tokens.weight"]:
        q4_1.pop(name, None)
        scale = 1.0 if "embed" in name else 0.05  # embeddings ~1, as a real model's
        kind, out = ("Q4_0", q4_0) if "o_proj" in name else ("Q8_0", q8_0)
        out[name], exact = q8_0_matrix(*weights[name].shape, seed=seed + len(q8_0) + len(q4_0), scale=scale,
                                       kind=kind)
        weights[name] = exact.float()
    return arch, weights, q4_1, q8_0, q4_0

