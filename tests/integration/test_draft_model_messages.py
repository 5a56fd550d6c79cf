"""What start-up says about a draft model: where its KV cache sits, and why a path is not a model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cadence import LLM
from cadence.engine.builder import random_weights, tiny_arch
from cadence.model.make_draft import write_draft
from cadence.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer.from_model_path(None)
    arch = tiny_arch(tokenizer.vocab_size)
    return write_draft(arch, random_weights(arch, seed=0), 1, tmp_path_factory.mktemp("draft") / "d", tokenizer)


def _draft_cache_line(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("draft model's KV cache")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    return lines[0]


def _spec(draft: Path) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}


def test_given_blocks_put_the_draft_cache_outside_any_memory_figure(draft, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="cadence"):
        LLM(tiny=True, num_kv_blocks=64, speculative_config=_spec(draft))
    line = _draft_cache_line(caplog)
    assert "64 blocks" in line and "outside any memory figure" in line and "within" not in line, line


def test_blocks_from_memory_keep_the_draft_cache_within_it(draft, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="cadence"):
        LLM(tiny=True, kv_cache_memory=64 * 2**20, speculative_config=_spec(draft))
    assert "within the KV cache memory" in _draft_cache_line(caplog)
