"""Speculative decoding with a draft model: the scheduler's side (drafts asked for in
SchedulerOutput.draft_requests, kept per request, verified, dropped on preemption), on the fake
executor with a fake drafter; the drafter's cache (rolled back to the verified context, so its
proposals are those of a fresh run); the configuration's errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fakes import (
    VOCAB,
    FakeExecutor,
    generate_alone,
    make_engine,
    make_request,
    next_token,
    run_until_done,
    tokens_of,
)

from cadence import LLM, SamplingParams
from cadence.boundary import ModelOutput, SchedulerOutput
from cadence.config import EngineConfig, SpeculativeConfig
from cadence.engine.builder import random_weights, tiny_arch
from cadence.executor.drafter import Drafter
from cadence.model.loader import load_checkpoint
from cadence.model.make_draft import write_draft
from cadence.model.tokenizer import Tokenizer

DRAFT = {"method": "draft_model", "model": "a draft the fake executor stands in for", "num_speculative_tokens": 4,
         "adaptive": False}


class DraftingExecutor(FakeExecutor):
    """The fake model, plus a fake drafter: it keeps each request's context as the scheduler sends
    it (recording any offset out of step) and proposes the fake model's own next tokens, but a
    wrong one at every position divisible by `wrong_every` (3: drafts are both accepted and
    rejected)."""

    wrong_every = 3

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.contexts: dict[str, list[int]] = {}
        self.proposed: dict[str, tuple[int, ...]] = {}  # the latest proposals per request
        self.num_verified = 0

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for sr in out.scheduled:  # a verification row carries (a prefix of) what was proposed last
            if sr.num_draft_tokens:
                self.num_verified += 1
                if self.proposed.get(sr.request_id, ())[: sr.num_draft_tokens] != sr.draft_token_ids:
                    self.violations.append(f"{sr.request_id}: verified drafts that were not proposed")
        result = super().execute(out)
        for rid in (*out.finished_ids, *out.preempted_ids):
            self.contexts.pop(rid, None)
            self.proposed.pop(rid, None)
        drafts = {}
        for rid, want in out.draft_requests.items():
            context = self.contexts.setdefault(rid, [])
            if want.offset != len(context):
                self.violations.append(f"{rid}: tokens sent from {want.offset}, {len(context)} known")
            context[want.offset :] = want.new_tokens
            step = result.verified_token_ids.get(rid) or (result.sampled_token_ids[rid],)
            full = context + list(step)
            proposal: list[int] = []
            for _ in range(want.k):
                token = next_token(full + proposal)
                proposal.append((token + 1) % VOCAB if (len(full) + len(proposal)) % self.wrong_every == 0 else token)
            drafts[rid] = self.proposed[rid] = tuple(proposal)
        return replace(result, draft_token_ids=drafts)


def _engine(**options):
    return make_engine(executor=DraftingExecutor(), speculative_config=DRAFT, **options)


def _stats_counter(engine):
    """Sum the draft counters over the engine's steps."""
    counts = {"drafted": 0, "accepted": 0}
    step = engine.step

    def counted():
        deltas = step()
        counts["drafted"] += engine.last_stats.num_draft_tokens
        counts["accepted"] += engine.last_stats.num_accepted_tokens
        return deltas

    engine.step = counted
    return counts


# ---------------------------------------------------------------- the scheduler's side
def test_outputs_match_without_speculation_with_drafts_accepted_and_rejected() -> None:
    engine, ex, _ = _engine(num_kv_blocks=256)
    counts = _stats_counter(engine)
    reqs = [make_request(prompt_len=9 + i, max_tokens=30) for i in range(4)]
    for r in reqs:
        engine.add_request(r)
    out = run_until_done(engine)
    for r in reqs:
        assert tokens_of(out[r.request_id]) == generate_alone(r.prompt_token_ids, 30)
    assert not ex.violations
    assert ex.num_verified > 0 and 0 < counts["accepted"] < counts["drafted"]


def test_chunked_prefill_and_preemption_keep_outputs_and_resend_the_context() -> None:
    """Prompts chunked by a small budget; a cache too small for all at once preempts. A preempted
    request's context is sent again from index 0 (the fake drafter forgot it on the news)."""
    engine, ex, _ = _engine(num_kv_blocks=24, max_num_batched_tokens=16)
    reqs = [make_request(prompt_len=20 + 3 * i, max_tokens=24) for i in range(5)]
    for r in reqs:
        engine.add_request(r)
    out = run_until_done(engine)
    assert any(o.preempted_ids for o in ex.outputs)
    for r in reqs:
        assert tokens_of(out[r.request_id]) == generate_alone(r.prompt_token_ids, 24)
    assert not ex.violations and ex.num_verified > 0


def test_a_preempted_request_drops_its_drafts() -> None:
    engine, ex, _ = _engine(num_kv_blocks=64)
    req = make_request(prompt_len=8, max_tokens=40)
    engine.add_request(req)
    for _ in range(4):
        engine.step()
    proposals = engine.scheduler.speculation.draft_proposals
    assert proposals.propose(req, 4) != ()  # drafts kept for its next step
    assert engine.scheduler.force_preempt(req.request_id)
    assert proposals.propose(req, 4) == ()
    engine.step()  # admitted again: a prefill of its whole context, which asks for drafts from index 0
    last = ex.outputs[-1]
    assert last.scheduled[0].num_draft_tokens == 0 and last.draft_requests[req.request_id].offset == 0
    assert tokens_of(run_until_done(engine)[req.request_id])[-1:]  # and it runs to its end
    assert not ex.violations


def test_drafts_for_another_context_are_not_used() -> None:
    engine, ex, _ = _engine(num_kv_blocks=64)
    req = make_request(prompt_len=8, max_tokens=40)
    engine.add_request(req)
    engine.step()
    proposals = engine.scheduler.speculation.draft_proposals
    drafts = proposals.propose(req, 4)
    assert len(drafts) == 4
    req.output_token_ids.append(drafts[0])  # the context moved on without these drafts' verification
    assert proposals.propose(req, 4) == ()


def test_opted_out_and_min_tokens_requests_ask_for_no_drafts() -> None:
    engine, ex, _ = _engine(num_kv_blocks=64)
    out_opt = make_request(params=SamplingParams(max_tokens=10, ignore_eos=True, speculative=False))
    held = make_request(params=SamplingParams(max_tokens=20, min_tokens=6, ignore_eos=True))
    engine.add_request(out_opt)
    engine.add_request(held)
    run_until_done(engine)
    asked = [(o.step, rid, len(o.scheduled)) for o in ex.outputs for rid in o.draft_requests]
    assert all(rid != out_opt.request_id for _, rid, _ in asked)
    held_asks = [o for o in ex.outputs if held.request_id in o.draft_requests]
    assert held_asks  # once min_tokens is met
    first = next(sr for sr in held_asks[0].scheduled if sr.request_id == held.request_id)
    assert first.num_output_tokens + 1 >= 6


# ---------------------------------------------------------------- the drafter's cache
@pytest.fixture(scope="module")
def tiny_model() -> tuple:
    arch = tiny_arch(500)
    return arch, random_weights(arch, seed=3)


def _drafter(tiny_model: tuple) -> Drafter:
    arch, weights = tiny_model
    return Drafter(arch, weights, block_size=4, dtype=torch.float32)


def test_after_rejected_drafts_proposals_are_those_of_a_fresh_run(tiny_model: tuple) -> None:
    """Three requests proposed for together; then each context keeps a different number of the
    drafts (0, 2, all 4) and a token the draft did not propose: the cached drafter's next
    proposals equal a fresh drafter's over the same contexts."""
    drafter = _drafter(tiny_model)
    g = torch.Generator().manual_seed(0)
    contexts = {f"r{i}": torch.randint(0, 500, (5 + 7 * i,), generator=g).tolist() for i in range(3)}
    first = drafter.propose({rid: (ctx, 4) for rid, ctx in contexts.items()})
    assert {len(d) for d in first.values()} == {4}
    for keep, rid in zip((0, 2, 4), contexts, strict=True):
        d = first[rid]
        other = (d[keep] + 1) % 500 if keep < 4 else 7
        contexts[rid] = contexts[rid] + list(d[:keep]) + [other]
    again = drafter.propose({rid: (ctx, 4) for rid, ctx in contexts.items()})
    fresh = _drafter(tiny_model).propose({rid: (ctx, 4) for rid, ctx in contexts.items()})
    assert again == fresh
    # The cache holds the verified context and the drafts fed, nothing of the rejected ones.
    for rid, ctx in contexts.items():
        assert drafter.states[rid].fed == ctx + list(again[rid][:-1])


@pytest.mark.parametrize("num_kv_blocks", [256, 12])
def test_in_an_engine_every_proposal_is_a_fresh_runs(tmp_path: Path, num_kv_blocks: int) -> None:
    """The tiny engine with its first layer as the draft: every proposal the drafter made, over
    steps where the target accepted some drafts and rejected others (and, with 12 blocks, where
    requests were preempted and ran again, and the draft cache had no room for some), equals what
    a fresh drafter proposes over the same context."""
    tokenizer = Tokenizer.from_model_path(None)
    arch = tiny_arch(tokenizer.vocab_size)
    weights = random_weights(arch, seed=0)
    draft = write_draft(arch, weights, 1, tmp_path / "draft", tokenizer, torch.float32)
    spec = {**DRAFT, "model": str(draft)}
    llm = LLM(tiny=True, dtype="float32", num_kv_blocks=num_kv_blocks, block_size=4, speculative_config=spec)
    drafter = llm.engine.core.executor.drafter
    calls: list[tuple[dict, dict]] = []
    propose = drafter.propose

    def recorded(contexts):
        got = propose(contexts)
        calls.append(({rid: (list(c), k) for rid, (c, k) in contexts.items()}, got))
        return got

    drafter.propose = recorded
    core = llm.engine.core
    stats = _stats_counter(core)
    prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % 400 + 5 for j in range(6 + 5 * i)]} for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert (num_kv_blocks == 12) == any(o.metrics.num_preemptions for o in outs)
    assert 0 < stats["accepted"] < stats["drafted"]
    assert sum(len(got) for _, got in calls) > 10  # proposals, from the draft model, over many steps
    ckpt = load_checkpoint(draft, torch.float32)
    fresh = Drafter(ckpt.arch, ckpt.weights, block_size=4, dtype=torch.float32)
    for contexts, got in calls:
        fresh.forget(list(fresh.states))
        want = fresh.propose(contexts)
        # With 12 blocks the draft cache (as many blocks) may have no room for a request in a step:
        # it gets no drafts then; every proposal made is a fresh run's.
        assert got == (want if num_kv_blocks == 256 else {rid: want[rid] for rid in got})


# ---------------------------------------------------------------- configuration
def test_the_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model: required with method draft_model"):
        EngineConfig.from_options(speculative_config={"method": "draft_model", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens: must be in \[1, 16\]"):
        EngineConfig.from_options(speculative_config={**DRAFT, "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match=r"speculative_config\.model: only with method draft_model"):
        EngineConfig.from_options(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "model": "x"})
    assert SpeculativeConfig.parse(json.dumps(DRAFT)).model == DRAFT["model"]


def test_a_missing_draft_is_refused_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*nowhere: no such file"):
        LLM(tiny=True, num_kv_blocks=16, speculative_config={**DRAFT, "model": str(tmp_path / "nowhere")})


def test_a_draft_of_another_vocabulary_size_is_refused(tmp_path: Path) -> None:
    arch = tiny_arch(1000)
    draft = write_draft(arch, random_weights(arch), 1, tmp_path / "draft")
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft model's vocabulary \(1000 tokens\) "
                                         r"is not the target model's \(49152 tokens\)"):
        LLM(tiny=True, num_kv_blocks=16, speculative_config={**DRAFT, "model": str(draft)})


def test_a_draft_whose_tokenizer_maps_other_ids_is_refused(tmp_path: Path) -> None:
    """Same size, but two tokens swap ids: a draft token would mean other text to the target."""
    tokenizer = Tokenizer.from_model_path(None)
    arch = tiny_arch(tokenizer.vocab_size)
    draft = write_draft(arch, random_weights(arch), 1, tmp_path / "draft", tokenizer)
    spec = json.loads((draft / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[300], list(vocab)[301]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft model's tokenizer maps tokens to other ids") as e:
        LLM(tiny=True, num_kv_blocks=16, speculative_config={**DRAFT, "model": str(draft)})
    # Each example names one token with both of its ids, so the reader can tell which side is which.
    for token in (a, b):
        assert f"{token!r}: draft {vocab[token]}, target {vocab[a if token == b else b]}" in str(e.value), str(e.value)


def test_make_draft_writes_a_loadable_truncated_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cadence.model.make_draft import main

    assert main(["--num-layers", "2", "--out", str(tmp_path / "d")]) == 0
    ckpt = load_checkpoint(tmp_path / "d")
    full = load_checkpoint(None)
    assert (ckpt.arch.num_layers, ckpt.arch.vocab_size) == (2, full.arch.vocab_size)
    assert set(ckpt.weights) == {k for k in full.weights if not k.startswith("model.layers.") or k.split(".")[2] in ("0", "1")}
    assert torch.equal(ckpt.weights["model.layers.1.mlp.down_proj.weight"],
                       full.weights["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16).float())
    assert Tokenizer.from_model_path(tmp_path / "d").vocabulary() == Tokenizer.from_model_path(None).vocabulary()
    with pytest.raises(SystemExit):
        main(["--num-layers", "31", "--out", str(tmp_path / "e")])
    assert "num_layers: must be in [1, 30]" in capsys.readouterr().err
