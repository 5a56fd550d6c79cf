"""benchmarks/quality.py's figures on a short text, pinned: a change that costs the bfloat16 model,
the 8-bit KV cache, int8 activations or both together quality fails here (the full text's figures
are in docs/performance.md, "Quality of the reduced-precision paths").

The first 512 tokens of CPython's pydoc_data/topics.py, one window fed in prefill chunks of 128 (so
later chunks read their context from the KV cache), the default model, one thread.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from cadence.model.cpu_kernels import cpu_kernels, has_vnni
from cadence.model.loader import default_model_path, load_checkpoint
from cadence.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENS, CHUNK = 512, 128
VNNI = cpu_kernels() is not None and has_vnni()
needs_vnni = pytest.mark.skipif(not VNNI, reason="int8 activations need cadence's CPU kernels and AVX512-VNNI")
# (perplexity, top-1 agreement with float32), measured on the CPU kernels (AVX512-BF16 and -VNNI),
# where the bfloat16 configurations run as served.
# act8 has its gate-up and output layers' inputs in two int8 terms, act8-1 every layer's in one.
PINNED = {"f32": (17.5397, 1.0), "bf16": (17.5766, 0.9902), "kv8": (17.6739, 0.9843), "act8": (17.5872, 0.9765),
          "act8+kv8": (17.5051, 0.9706), "act8-1": (17.5400, 0.9687)}


def _quality_script():
    spec = importlib.util.spec_from_file_location("quality", ROOT / "benchmarks" / "quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality"] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, float]]:
    quality = _quality_script()
    path = default_model_path()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    quality.CONFIGS["emu-32"] = quality.Config(torch.bfloat16, emulate=quality.parse_emulation("*:32"))
    configs = ["bf16", "kv8", "emu-32", *(["act8", "act8+kv8", "act8-1"] if VNNI else [])]
    try:
        tokens = quality.text_tokens(Tokenizer.from_model_path(path), TOKENS)
        return quality.evaluate(configs, tokens, TOKENS, CHUNK, load_checkpoint(path, torch.float32))
    finally:
        torch.set_num_threads(threads)


def _within_goals(results, name: str, agreement_points: float) -> None:
    """Goals on the full text: perplexity within 1% of bfloat16's, top-1 agreement with float32
    within 1 point; on 511 positions one token is 0.2 points, so perplexity is held to 1.5% here."""
    base, got = results["bf16"], results[name]
    assert got["positions"] == base["positions"] == TOKENS - 1
    assert got["perplexity"] / base["perplexity"] - 1 < 0.015, name
    assert got["agreement"] >= base["agreement"] - agreement_points / 100, name
    assert results["f32"]["agreement"] == 1.0


def test_8bit_cache_within_the_goals_of_bfloat16(results) -> None:
    _within_goals(results, "kv8", 1.5)


@needs_vnni
def test_int8_activations_within_the_goals_of_bfloat16(results) -> None:
    """int8 activations (two terms where one costs most) meet both goals on the full text
    (docs/performance.md); on this one 7 of 511 positions (1.4 points) move: held to 2 points here,
    and pinned below."""
    _within_goals(results, "act8", 2.0)


@needs_vnni
def test_int8_activations_with_the_8bit_cache_within_the_goals_of_bfloat16(results) -> None:
    _within_goals(results, "act8+kv8", 2.0)


@needs_vnni
def test_two_terms_agree_with_float32_more_often_than_one(results) -> None:
    """What the second term buys: every layer in one int8 term moves 3 points of this text."""
    assert results["act8"]["agreement"] > results["act8-1"]["agreement"]
    _within_goals(results, "act8-1", 4.0)


@needs_vnni
def test_emulated_one_term_lands_on_the_kernels_one_term(results) -> None:
    """`quality.py --emulate` asks what a quantization would cost before its kernel exists: emulated
    on every layer in one int8 term per block of 32 (fake-quantized inputs, float32 products), it
    moves the top choice about as often as the kernels' own one term (act8-1), and below bf16."""
    emu, kernels, bf16 = (results[n]["agreement"] for n in ("emu-32", "act8-1", "bf16"))
    assert abs(emu - kernels) <= 0.01
    assert emu < bf16


@pytest.mark.skipif(cpu_kernels() is None, reason="the pinned bfloat16 figures are the CPU kernels'")
@pytest.mark.parametrize("name", list(PINNED))
def test_figures_as_pinned(results, name: str) -> None:
    if name.startswith("act8") and not VNNI:
        pytest.skip("int8 activations need AVX512-VNNI")
    perplexity, agreement = PINNED[name]
    assert results[name]["perplexity"] == pytest.approx(perplexity, rel=2e-3), name
    assert results[name]["agreement"] == pytest.approx(agreement, abs=0.003), name
