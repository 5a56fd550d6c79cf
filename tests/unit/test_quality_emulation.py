"""benchmarks/quality.py's `--emulate`: activations rounded as an int8 kernel would round them, and
the SPEC that names which layer kinds, in what blocks."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def quality():
    return load_benchmark("quality")


@pytest.mark.parametrize(("block", "terms"), [(32, 1), (16, 1), (8, 1), (32, 2)])
def test_fake_quantize_rounds_each_block_to_its_own_grid(quality, block: int, terms: int) -> None:
    g = torch.Generator().manual_seed(block + terms)
    x = torch.randn(5, 96, generator=g) * torch.rand(5, 96, generator=g) * 10
    x[1, :block] = 0.0  # an all-zero block stays zero
    q = quality.fake_quantize(x, block, terms)
    levels = quality.LEVELS[terms]
    xb, qb = x.reshape(5, -1, block), q.reshape(5, -1, block)
    step = xb.abs().amax(-1, keepdim=True) / levels
    assert torch.all((qb - xb).abs() <= step / 2 * (1 + 1e-6))  # to the nearest step
    ints = torch.where(step > 0, qb / step, torch.zeros_like(qb))
    assert torch.allclose(ints, ints.round(), atol=1e-3)  # on the block's grid
    assert ints.abs().max() <= levels + 1e-3
    assert torch.equal(q[1, :block], torch.zeros(block))


def test_a_block_is_quantized_by_itself(quality) -> None:
    x = torch.randn(2, 64)
    y = x.clone()
    y[:, 32:] *= 100  # another block's outlier moves nothing in this one
    assert torch.equal(quality.fake_quantize(x, 32)[:, :32], quality.fake_quantize(y, 32)[:, :32])
    assert not torch.equal(quality.fake_quantize(x, 64)[:, :32], quality.fake_quantize(y, 64)[:, :32])


def test_two_terms_round_finer_than_one(quality) -> None:
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(0))
    one = (quality.fake_quantize(x, 32, 1) - x).abs().mean()
    two = (quality.fake_quantize(x, 32, 2) - x).abs().mean()
    assert two < one / 100


def test_emulation_spec(quality) -> None:
    assert quality.parse_emulation("*:32,gate_up:16,output:8x2") == (
        ("qkv", 32, 1), ("o", 32, 1), ("gate_up", 16, 1), ("down", 32, 1), ("output", 8, 2))
    assert quality.parse_emulation("output:16, qkv:32") == (("qkv", 32, 1), ("output", 16, 1))


@pytest.mark.parametrize(("spec", "words"), [
    ("", "expected KIND:BLOCK"), ("mlp:32", "'mlp' is not"), ("qkv:12", "BLOCK 8, 16 or 32"),
    ("qkv", "BLOCK 8, 16 or 32"), ("qkv:32x3", "BLOCK 8, 16 or 32"),
])
def test_emulation_spec_refused_with_the_reason(quality, spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        quality.parse_emulation(spec)


def test_fake_quantize_refuses_a_block_that_does_not_divide_k(quality) -> None:
    with pytest.raises(ValueError, match="does not divide"):
        quality.fake_quantize(torch.zeros(1, 40), 32)
