"""A draft model under adaptive k: the drafter is asked for drafts only for the requests adaptive
k would verify (a request it turned down is weighed again next step without drafts, and drafted
for once it would speculate), and drafting is priced at the draft model's share of a decode step,
so that drafts that would pay on their own are turned down where drafting them costs more."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fakes import make_engine, make_request, run_until_done, tokens_of
from test_speculative_adaptive import fake_cost
from test_speculative_draft import DRAFT, DraftingExecutor

from cadence import LLM
from cadence.engine.builder import random_weights, tiny_arch
from cadence.executor.drafter import Drafter
from cadence.model.attention import PagedKVCache
from cadence.model.make_draft import write_draft
from cadence.model.tokenizer import Tokenizer
from cadence.request import SamplingParams
from cadence.sched.adaptive import Candidate, DraftModelCost, choose_ks
from cadence.sched.features import StepFeatures

ADAPTIVE_DRAFT = {**DRAFT, "adaptive": True}


class RejectedDrafts(DraftingExecutor):
    wrong_every = 1  # every draft is wrong


class AcceptedDrafts(DraftingExecutor):
    wrong_every = 10**9  # every draft is the model's own token


def _run(executor: DraftingExecutor, spec: dict | None, max_tokens: int = 120, draft_cost_ratio: float = 0.0):
    engine, ex, _ = make_engine(executor=executor, speculative_config=spec, num_kv_blocks=256)
    engine.scheduler.step_cost = fake_cost
    if engine.scheduler.speculation is not None:
        engine.scheduler.speculation.draft_cost_ratio = draft_cost_ratio
    req = make_request(rid="r", prompt=[5, 6, 7, 8, 9], params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                                ignore_eos=True))
    engine.add_request(req)
    tokens = tokens_of(run_until_done(engine)["r"])
    assert not ex.violations, ex.violations
    drafted = [bool(out.draft_requests) for out in ex.outputs]
    verified = [any(sr.num_draft_tokens for sr in out.scheduled) for out in ex.outputs]
    # Drafts made after a step that the next step did not verify (the last step's are never used).
    wasted = sum(d and not v for d, v in zip(drafted[:-1], verified[1:], strict=True))
    return tokens, sum(drafted), wasted, len(ex.outputs)


def test_a_request_adaptive_k_turns_down_is_not_drafted_for() -> None:
    plain, *_ = _run(RejectedDrafts(), None)
    tokens, drafted, wasted, steps = _run(RejectedDrafts(), ADAPTIVE_DRAFT)
    assert tokens == plain
    # Drafts always rejected: after the first tries, drafted for only when the estimate, fading
    # back towards its prior, says a draft would pay: about one step in nine here, that step's
    # drafts verified (and rejected) in the next, which is drafted for too (fixed k drafts every step).
    assert drafted < steps / 3 and wasted < steps / 6, (drafted, wasted, steps)
    _, fixed_drafted, _, fixed_steps = _run(RejectedDrafts(), DRAFT)
    assert fixed_drafted >= fixed_steps - 2


def test_a_draft_model_that_can_never_pay_is_never_run_not_even_after_the_prompt() -> None:
    # Drafting priced at 5 decode steps a pass: no acceptance repays it, so adaptive k never
    # drafts: not after the step that ends the prompt either (that request had not been weighed).
    plain, *_ = _run(AcceptedDrafts(), None, max_tokens=40)
    tokens, drafted, _, steps = _run(AcceptedDrafts(), ADAPTIVE_DRAFT, max_tokens=40, draft_cost_ratio=5.0)
    assert tokens == plain and steps == len(plain)
    assert drafted == 0
    # Priced as a tenth of a step, the same drafts pay: drafted for from the step after the prompt's.
    _, drafted, _, steps = _run(AcceptedDrafts(), ADAPTIVE_DRAFT, max_tokens=40, draft_cost_ratio=0.1)
    assert drafted >= steps - 2


def test_a_request_whose_drafts_pay_is_drafted_for_every_step_and_verifies_them() -> None:
    plain, *_ = _run(AcceptedDrafts(), None)
    tokens, drafted, wasted, steps = _run(AcceptedDrafts(), ADAPTIVE_DRAFT)
    assert tokens == plain
    assert steps < len(plain) / 3  # k = 4 nearly every step
    assert drafted >= steps - 2 and wasted <= 1, (drafted, wasted, steps)


def test_drafting_is_priced_so_that_drafts_are_turned_down_as_the_batch_grows() -> None:
    """The same requests and acceptance: without the drafting time, drafts pay alone and in a batch of
    four; with a draft of a third of the layers drafting four tokens, they still pay alone, not in
    the batch."""
    drafting = DraftModelCost(ratio=1 / 3, num_tokens=4)

    def chosen(n: int, draft: DraftModelCost | None) -> int:
        base = StepFeatures(decode_seqs=n, sampled=n, decode_context=100 * n, decode_padded=100 * n)
        cands = [Candidate(f"c{i}", 99, 4, 0.95) for i in range(n)]
        return len(choose_ks(base, cands, fake_cost, 512, drafting=draft))

    assert chosen(1, None) == 1 and chosen(4, None) == 4
    assert chosen(1, drafting) == 1 and chosen(4, drafting) < 4


def test_the_engine_prices_drafting_at_the_draft_models_share_of_the_weight_bytes(tmp_path: Path) -> None:
    # A decode pass of a few rows is bound by reading its weights: the draft's decoder layers and its
    # whole output layer, beside the served model's (in float32 here: 4 bytes a weight in both).
    tokenizer = Tokenizer.from_model_path(None)
    arch = tiny_arch(tokenizer.vocab_size)
    draft = write_draft(arch, random_weights(arch, seed=0), 1, tmp_path / "draft", tokenizer, torch.float32)
    llm = LLM(tiny=True, dtype="float32", speculative_config={**ADAPTIVE_DRAFT, "model": str(draft)})
    speculation = llm.engine.core.scheduler.speculation
    e, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    layer = (arch.num_heads + 2 * arch.num_kv_heads) * d * e + e * arch.num_heads * d + 2 * f * e + e * f
    head = arch.vocab_size * e
    assert speculation is not None
    assert speculation.draft_cost_ratio == pytest.approx((layer + head) / (arch.num_layers * layer + head), rel=1e-12)
    assert speculation.draft_cost_ratio > 1 / arch.num_layers  # the output layer counts too


# ---------------------------------------------------------------- the draft cache in the KV budget
def test_the_draft_models_cache_is_counted_in_the_kv_cache_memory(tmp_path: Path, caplog) -> None:
    tokenizer = Tokenizer.from_model_path(None)
    arch = tiny_arch(tokenizer.vocab_size)
    draft = write_draft(arch, random_weights(arch, seed=0), 1, tmp_path / "draft", tokenizer, torch.float32)
    memory = 3 * 2**20
    with caplog.at_level(logging.INFO, logger="cadence.executor"):
        llm = LLM(tiny=True, dtype="float32", block_size=4, kv_cache_memory=memory,
                  speculative_config={**ADAPTIVE_DRAFT, "model": str(draft)})
    runner = llm.engine.core.executor
    drafter = runner.drafter
    target = PagedKVCache.bytes_per_block(num_layers=arch.num_layers, block_size=4, num_kv_heads=arch.num_kv_heads,
                                          head_dim=arch.head_dim, dtype=torch.float32)
    num_blocks = llm.engine.core.num_blocks
    assert num_blocks == memory // (target + drafter.bytes_per_block()) < memory // target
    assert drafter.cache.num_blocks == num_blocks == runner.kv_cache.num_blocks
    assert runner.kv_cache.kv.nbytes + drafter.cache.kv.nbytes <= memory
    assert any("draft model's KV cache" in r.getMessage() and str(num_blocks) in r.getMessage()
               for r in caplog.records)
    # It stays within it: more requests than the draft cache holds at once still get proposals.
    outs = llm.generate([{"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(40)]} for i in range(6)],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert drafter.cache.num_blocks == num_blocks


def test_a_budgeted_draft_cache_drops_idle_requests_and_proposes_as_a_fresh_run() -> None:
    """A draft cache of 12 blocks of 4 holds two contexts of 20: proposing for others drops the K/V
    of the idle ones (least recently drafted for first), and the proposals, then and when the first
    ones are drafted for again, are a fresh drafter's. A request that alone needs more blocks
    than the cache has gets no drafts; the cache never grows."""
    arch = tiny_arch(500)
    weights = random_weights(arch, seed=3)
    drafter = Drafter(arch, weights, block_size=4, dtype=torch.float32)
    drafter.initialize_cache(12)
    g = torch.Generator().manual_seed(1)
    ctx = {f"r{i}": torch.randint(0, 500, (20,), generator=g).tolist() for i in range(5)}

    def fresh(rids: list[str]) -> dict:
        return Drafter(arch, weights, block_size=4, dtype=torch.float32).propose({r: (ctx[r], 4) for r in rids})

    def holding() -> set[str]:
        return {rid for rid, state in drafter.states.items() if state.blocks}

    # Each context of 20 and its 3 fed drafts take 6 blocks: two fit.
    for batch, held in ((["r0", "r1"], {"r0", "r1"}), (["r2"], {"r1", "r2"}), (["r3"], {"r2", "r3"}),
                        (["r4"], {"r3", "r4"}), (["r0"], {"r4", "r0"}), (["r1", "r2"], {"r1", "r2"})):
        assert drafter.propose({r: (ctx[r], 4) for r in batch}) == fresh(batch), batch
        assert holding() == held, batch
    assert drafter.propose({"long": (list(range(60)), 4)}) == {}
    assert drafter.cache.num_blocks == 12
