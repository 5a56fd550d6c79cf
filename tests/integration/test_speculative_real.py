"""Speculative decoding keeps outputs: on the real default model (bfloat16 kernels) and on the tiny
random one (whose attention runs in torch: greedy tokens only, alone and under preemption, as
batching moves them on it without speculation too), a request's greedy tokens with n-gram
speculation are those without, alone, batched with requests that do not speculate, and under
preemption; on the default model a seeded sampling request's tokens are too; on the tiny
model unseeded sampling keeps its token frequencies. Each scenario also checks that drafts were
accepted, so the verification path really ran.

Verification feeds the drafts as a chunk of 1 + k tokens and picks a token at each position as a
decode step would; on cadence's bfloat16 CPU kernels a position's logits are the same bits in a
chunk as in a decode step (tests/unit/test_exact.py), so no tolerance is needed.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import pytest

from cadence import LLM, SamplingParams
from cadence.model.cpu_kernels import cpu_kernels

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels() is None, reason="exact by construction on the bfloat16 CPU kernels, "
                       "which this CPU cannot run (the torch fallback is not bit-exact across batch shapes)"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 48

# Input-grounded prompts: the answer repeats spans of the prompt, so drafts get accepted.
PROMPTS = [
    "Repeat this list three times: apple, banana, cherry, date, elderberry, fig, grape.\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Copy the sentence exactly: The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    "Question: What is the capital of France?\nAnswer: Paris.\nQuestion: What is the capital of Spain?\nAnswer:",
    "<li>One</li>\n<li>Two</li>\n<li>Three</li>\n<li>Four</li>\n",
    "The water cycle. Evaporation, condensation, precipitation. The water cycle. Evaporation,",
    "Name: Alice; Age: 30; City: Paris.\nName: Bob; Age: 25; City: London.\nName: Carol;",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
OPTED_OUT = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, speculative=False)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=500 + i, max_tokens=MAX_TOKENS, ignore_eos=True)


class Counted:
    """An LLM whose engine steps add up the speculative-decoding counters."""

    def __init__(self, **options: object) -> None:
        self.llm = LLM(**options)
        core = self.llm.engine.core
        self.draft_tokens = self.accepted = 0
        self.token_runs: list[tuple[int, ...]] = []  # each step's new tokens of each request
        step: Callable[[], list] = core.step

        def counted() -> list:
            deltas = step()
            self.token_runs += [d.new_token_ids for d in deltas]
            self.draft_tokens += core.last_stats.num_draft_tokens
            self.accepted += core.last_stats.num_accepted_tokens
            return deltas

        core.step = counted  # type: ignore[method-assign]

    def tokens(self, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in self.llm.generate(prompts, params, use_tqdm=False)]


def _reference(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    """Each request alone, without speculation."""
    return [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def _assert_same(got: list[list[int]], want: list[list[int]], label: str) -> None:
    differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not differ, f"{label}: requests {differ} differ from the same requests without speculation"


@pytest.fixture(scope="module", params=["default", "tiny"])
def model(request) -> dict:
    return {"tiny": True, "dtype": "bfloat16"} if request.param == "tiny" else {}


@pytest.fixture(scope="module")
def reference(model: dict) -> dict[str, list[list[int]]]:
    plain = LLM(max_num_seqs=64, num_kv_blocks=2048, enable_prefix_caching=False, **model)
    n = len(PROMPTS)
    return {"greedy": _reference(plain, PROMPTS, [GREEDY] * n),
            "seeded": _reference(plain, PROMPTS, [_seeded(i) for i in range(n)])}


def test_alone_the_same_tokens_with_drafts_accepted(model: dict, reference) -> None:
    spec = Counted(num_kv_blocks=2048, enable_prefix_caching=False, speculative_config=NGRAM, **model)
    got = [spec.tokens([p], GREEDY)[0] for p in PROMPTS]
    _assert_same(got, reference["greedy"], "alone")
    assert spec.accepted > 0 and spec.draft_tokens > spec.accepted - 1


def test_batched_with_requests_that_do_not_speculate(model: dict, reference) -> None:
    """Speculating greedy requests beside opted-out ones and seeded sampling ones (which speculate too);
    on the tiny model, that such a batch verifies drafts."""
    spec = Counted(max_num_seqs=64, num_kv_blocks=2048, speculative_config=NGRAM, **model)
    n = len(PROMPTS)
    params = [GREEDY] * n + [OPTED_OUT] * n + [_seeded(i) for i in range(n)]
    got = spec.tokens(PROMPTS * 3, params)
    if not model:  # the tiny model runs attention in torch (its head size is not the kernels'), whose
        # tokens move with the batch's shape: without speculation, the same prompts batched three
        # times change a greedy request's tokens against it alone (its top two logits 0.002 apart).
        # Compared on the default model, where batching changes no bit.
        _assert_same(got[:n], reference["greedy"], "speculating, in a batch")
        _assert_same(got[n : 2 * n], reference["greedy"], "opted out, in a batch")
        _assert_same(got[2 * n :], reference["seeded"], "seeded sampling, in a batch")
    assert spec.accepted > 0


def test_under_preemption(model: dict, reference) -> None:
    # 12 blocks of 16 tokens cannot hold 8 requests of ~20-40 + 48 tokens at once.
    spec = Counted(max_num_seqs=16, num_kv_blocks=12, enable_prefix_caching=False, speculative_config=NGRAM, **model)
    outs = spec.llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sum(1 for o in outs if o.metrics.num_preemptions > 0) >= 2
    _assert_same([o.outputs[0].token_ids for o in outs], reference["greedy"], "preempted")
    assert spec.accepted > 0


def test_a_stop_string_inside_the_drafts_ends_the_output_as_without() -> None:
    """A stop string that first completes at a token in the middle of what one verification row
    accepted: the output ends at that token, as one token a step would have ended it."""
    spec = Counted(num_kv_blocks=256, speculative_config=NGRAM)
    prompt = PROMPTS[0]
    free = spec.tokens([prompt], GREEDY)[0]
    decode = spec.llm.engine.tokenizer.decode
    stop, end = _stop_inside_a_run(free, spec.token_runs, decode)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    plain = LLM(num_kv_blocks=256)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = spec.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and want.token_ids == free[:end]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, want.finish_reason, want.stop_reason)


def _stop_inside_a_run(tokens: list[int], runs: list[tuple[int, ...]], decode: Callable) -> tuple[str, int]:
    """A stop string whose first occurrence in the text of `tokens` completes at a token that is not
    the last of its step's run of several tokens; and how many tokens end with it."""
    at = 0
    for run in runs:
        for i in range(len(run) - 1):
            end = at + i + 1
            text, before = decode(tokens[:end]), decode(tokens[: end - 1])
            for n in range(4, 16):
                stop = text[-n:]
                if stop.strip() and len(text) - n >= len(before) - 1 and stop not in before \
                        and stop not in text[:-1]:
                    return stop, end
        at += len(run)
    raise AssertionError("no multi-token step to put a stop string in")


def test_seeded_sampled_requests_speculate_and_keep_their_tokens() -> None:
    """temperature 1 with a seed, on the default model: each position draws with the uniform of its
    output index, so the tokens are those of plain decoding (on the kernels, whose logits are the
    same bits). Not on the tiny model: its attention runs in torch, whose sampled tokens move with
    the batch's shape even without speculation; its distribution is tested below."""
    params = [_seeded(i) for i in range(len(PROMPTS))]
    want = _reference(LLM(num_kv_blocks=2048, enable_prefix_caching=False), PROMPTS, params)
    spec = Counted(max_num_seqs=64, num_kv_blocks=2048, speculative_config=NGRAM)
    _assert_same(spec.tokens(PROMPTS, params), want, "seeded sampling")
    assert spec.accepted > 0


def test_sampling_keeps_the_token_distribution_on_the_tiny_model() -> None:
    """Unseeded sampling, many times over: the frequencies of each output position's tokens with
    speculation match those without (within 5 standard errors of their difference). At temperature
    0.1 the tiny model's distribution has a few likely tokens, which it tends to repeat: drafts. Not
    adaptive: 64 requests at a time, where adaptive k finds few drafts worth their time, and this
    test needs many rows verified."""
    assert_same_distribution({**NGRAM, "adaptive": False})


def assert_same_distribution(speculative_config: dict) -> None:
    """2,000 unseeded samples of 6 tokens at temperature 0.1 on the tiny model, without speculation
    and with `speculative_config`: each position's token frequencies agree within 5 standard errors
    of their difference, and more than half the requests accepted drafts."""
    n, length = 2000, 6
    plain = LLM(tiny=True, dtype="bfloat16", max_num_seqs=64, num_kv_blocks=1024)  # (the seed makes the weights)
    greedy = plain.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    prompt = {"prompt_token_ids": list(greedy[:24])}
    params = SamplingParams(temperature=0.1, max_tokens=length, ignore_eos=True)
    spec = Counted(tiny=True, dtype="bfloat16", max_num_seqs=64, num_kv_blocks=1024,
                   speculative_config=speculative_config)
    runs = {"plain": [o.outputs[0].token_ids for o in plain.generate([prompt] * n, params, use_tqdm=False)],
            "spec": spec.tokens([prompt] * n, params)}
    assert spec.accepted > n // 2, "too few drafts were accepted to test anything"
    for pos in range(length):
        a = collections.Counter(t[pos] for t in runs["plain"])
        b = collections.Counter(t[pos] for t in runs["spec"])
        assert max(a.values()) < 0.9 * n  # a distribution, not one token
        for token in set(a) | set(b):
            p = (a[token] + b[token]) / (2 * n)
            assert abs(a[token] - b[token]) / n <= 5 * math.sqrt(2 * p * (1 - p) / n) + 1e-9, (pos, token, a, b)
