"""Speculative decoding with a draft model keeps outputs: a request's greedy tokens with drafts
from a draft model are those without speculation, alone, batched with requests that do not
speculate, under preemption and with chunked prefill, on the default model (its first 4 layers
as the draft) and on the tiny random model (its first layer as the draft); a seeded sampling
request's tokens are too on the default model, and unseeded sampling keeps its token
frequencies on the tiny one. Each scenario checks that drafts were verified and some accepted.

As for n-gram drafts (test_speculative_real.py), exact because on cadence's bfloat16 CPU kernels
a position's logits are the same bits in a verification row as in a decode step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_speculative_real import (
    GREEDY,
    OPTED_OUT,
    PROMPTS,
    Counted,
    _assert_same,
    _reference,
    _seeded,
    assert_same_distribution,
)

from cadence import LLM
from cadence.engine.builder import random_weights, tiny_arch
from cadence.model.cpu_kernels import cpu_kernels
from cadence.model.loader import load_checkpoint
from cadence.model.make_draft import write_draft
from cadence.model.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels() is None, reason="exact by construction on the bfloat16 CPU kernels, "
                       "which this CPU cannot run (the torch fallback is not bit-exact across batch shapes)"),
]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default model's first 4 layers, and the tiny random model's first layer (the tiny
    engine's weights are `random_weights(tiny_arch(V), seed=0)`)."""
    root = tmp_path_factory.mktemp("drafts")
    tokenizer = Tokenizer.from_model_path(None)
    full = load_checkpoint(None)
    tiny = tiny_arch(tokenizer.vocab_size)
    return {"default": write_draft(full.arch, full.weights, 4, root / "default", tokenizer),
            "tiny": write_draft(tiny, random_weights(tiny, seed=0), 1, root / "tiny", tokenizer),
            "tiny-whole": write_draft(tiny, random_weights(tiny, seed=0), 2, root / "tiny-whole", tokenizer)}


def _spec_config(draft: Path) -> dict:
    # Not adaptive: drafts every step, whatever the expected gain, so every path runs.
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4, "adaptive": False}


def _default_spec(drafts: dict[str, Path]) -> dict:
    return _spec_config(drafts["default"])


@pytest.fixture(scope="module", params=["default", "tiny"])
def model(request, drafts: dict[str, Path]) -> dict:
    spec = _spec_config(drafts[request.param])
    base = {"tiny": True, "dtype": "bfloat16"} if request.param == "tiny" else {}
    return {"base": base, "spec": spec}


@pytest.fixture(scope="module")
def reference(model: dict) -> list[list[int]]:
    plain = LLM(max_num_seqs=64, num_kv_blocks=2048, enable_prefix_caching=False, **model["base"])
    return _reference(plain, PROMPTS, [GREEDY] * len(PROMPTS))


def _spec(model: dict, **options: object) -> Counted:
    return Counted(speculative_config=model["spec"], **model["base"], **options)


def test_alone_the_same_tokens_with_drafts_accepted(model: dict, reference) -> None:
    spec = _spec(model, num_kv_blocks=2048, enable_prefix_caching=False)
    got = [spec.tokens([p], GREEDY)[0] for p in PROMPTS]
    _assert_same(got, reference, "alone")
    assert spec.accepted > 0 and spec.draft_tokens > spec.accepted


def test_batched_with_requests_that_do_not_speculate(model: dict, reference) -> None:
    spec = _spec(model, max_num_seqs=64, num_kv_blocks=2048)
    n = len(PROMPTS)
    got = spec.tokens(PROMPTS * 2, [GREEDY] * n + [OPTED_OUT] * n)
    _assert_same(got[:n], reference, "speculating, in a batch")
    if not model["base"]:  # the tiny model's attention runs in torch, whose greedy tokens move with the
        # batch's shape without speculation too (one of these opted-out requests does, in a plain batch)
        _assert_same(got[n:], reference, "opted out, in a batch")
    assert spec.accepted > 0


def test_under_preemption(model: dict, reference) -> None:
    # 12 blocks of 16 tokens cannot hold 8 requests of ~20-40 + 48 tokens at once.
    spec = _spec(model, max_num_seqs=16, num_kv_blocks=12, enable_prefix_caching=False)
    outs = spec.llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sum(1 for o in outs if o.metrics.num_preemptions > 0) >= 2
    _assert_same([o.outputs[0].token_ids for o in outs], reference, "preempted")
    assert spec.accepted > 0


def test_with_chunked_prefill(drafts: dict[str, Path]) -> None:
    """Prompts fed in chunks of at most 8 tokens beside other requests' verification rows. On the
    default model only: the tiny model's torch attention gives one of these prompts other greedy
    tokens when chunked like this even without speculation."""
    want = _reference(LLM(num_kv_blocks=2048, enable_prefix_caching=False), PROMPTS, [GREEDY] * len(PROMPTS))
    spec = Counted(speculative_config=_default_spec(drafts), max_num_seqs=16, num_kv_blocks=2048,
                   max_num_batched_tokens=24, long_prefill_token_threshold=8)
    got = spec.tokens(PROMPTS, GREEDY)
    _assert_same(got, want, "chunked prefill")
    assert spec.accepted > 0


def test_seeded_sampled_requests_keep_their_tokens(drafts: dict[str, Path]) -> None:
    spec_config = _default_spec(drafts)
    params = [_seeded(i) for i in range(len(PROMPTS))]
    want = _reference(LLM(num_kv_blocks=2048, enable_prefix_caching=False), PROMPTS, params)
    spec = Counted(max_num_seqs=64, num_kv_blocks=2048, speculative_config=spec_config)
    _assert_same(spec.tokens(PROMPTS, params), want, "seeded sampling")
    assert spec.draft_tokens > 0


def test_sampling_keeps_the_token_distribution_on_the_tiny_model(drafts: dict[str, Path]) -> None:
    """Unseeded sampling, many times over: each output position's token frequencies with draft-model
    speculation match those without (within 5 standard errors of their difference). The draft is
    the whole tiny model, run greedily: at temperature 0.1 its drafts are often, not always, the
    tokens sampled, so both acceptance and rejection are exercised."""
    assert_same_distribution(_spec_config(drafts["tiny-whole"]))
