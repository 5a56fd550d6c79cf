"""benchmarks/quality.py's figures on a short text, pinned: a change that costs the bfloat16 model or
the 8-bit KV cache quality fails here (the full text's figures are in docs/performance.md).

The first 384 tokens of CPython's pydoc_data/topics.py, one window, the default model, one thread.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from cadence.model.cpu_kernels import cpu_kernels
from cadence.model.loader import default_model_path, load_checkpoint
from cadence.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 384
# Measured on the CPU kernels (AVX512-BF16), where the bfloat16 configurations run as served.
PINNED = {"f32": (18.388, 1.0), "bf16": (18.438, 0.9869), "kv8": (18.593, 0.9869)}


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
    try:
        tokens = quality.text_tokens(Tokenizer.from_model_path(path), TOKENS)
        return quality.evaluate(["bf16", "kv8"], tokens, TOKENS, 128, load_checkpoint(path, torch.float32))
    finally:
        torch.set_num_threads(threads)


def test_8bit_cache_within_the_goals_of_bfloat16(results) -> None:
    """Goals on the full text: perplexity within 1% of bfloat16's, top-1 agreement with float32
    within 1 point; on 383 positions one token is 0.26 points, so the bound here is 1.5 of each."""
    bf16, kv8 = results["bf16"], results["kv8"]
    assert kv8["positions"] == bf16["positions"] == TOKENS - 1
    assert kv8["perplexity"] / bf16["perplexity"] - 1 < 0.015
    assert kv8["agreement"] >= bf16["agreement"] - 0.015
    assert results["f32"]["agreement"] == 1.0


@pytest.mark.skipif(cpu_kernels() is None, reason="the pinned bfloat16 figures are the CPU kernels'")
def test_figures_as_pinned(results) -> None:
    for name, (perplexity, agreement) in PINNED.items():
        assert results[name]["perplexity"] == pytest.approx(perplexity, rel=2e-3), name
        assert results[name]["agreement"] == pytest.approx(agreement, abs=0.003), name
