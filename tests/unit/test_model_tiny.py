"""Tiny random Llama / Qwen2 models: cadence's model and runner against Hugging Face transformers.

The reference is transformers' own forward over the whole sequence (float32, no cache); cadence must
match it whether the sequence is fed at once, in chunks through the paged cache, or mixed into a
flat batch with other requests.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.executor.model_runner import ModelRunner
from cadence.model.arch import ModelArchConfig
from cadence.model.attention import AttentionMetadata, PagedKVCache, SeqSpan, decode_groups, paged_attention
from cadence.model.llama import LlamaModel
from cadence.request import SamplingParams

ATOL = 1e-4
VOCAB = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def tiny_hf(kind: str = "llama", *, tie: bool = True, seed: int = 0) -> tuple[torch.nn.Module, ModelArchConfig]:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        initializer_range=0.1,
    )
    if kind == "qwen2":
        hf = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0)).eval()
        theta = 1000000.0
    else:
        hf = LlamaForCausalLM(LlamaConfig(**common, rope_theta=5000.0)).eval()
        theta = 5000.0
    with torch.no_grad():  # init leaves norms at 1 and biases at 0: randomise them so they are tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    arch = ModelArchConfig(
        architecture=kind, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=theta, rms_norm_eps=1e-6, max_position_embeddings=512,
        tie_word_embeddings=tie, attention_bias=kind == "qwen2",
    )
    return hf, arch


def weights_of(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [L, V]


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def runner_for(hf: torch.nn.Module, arch: ModelArchConfig, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
    runner = ModelRunner(arch, weights_of(hf), dtype=torch.float32, device="cpu")
    runner.initialize_kv_cache(num_blocks, block_size)
    return runner


def sched(rid: str, tokens: list[int], start: int, table: list[int], sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(rid, tuple(tokens), start, tuple(table), sample, GREEDY)


@pytest.fixture(scope="module")
def llama():
    return tiny_hf("llama")


def test_whole_prompt_matches_hf_at_every_position(llama):
    hf, arch = llama
    tokens = random_tokens(40, seed=1)
    model = LlamaModel(arch, weights_of(hf))
    cache = PagedKVCache.allocate(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=16,
                                  dtype=torch.float32, device=torch.device("cpu"))
    table = [7, 2, 11, 0, 5, 9, 3, 14, 1, 8]
    meta = AttentionMetadata.build([SeqSpan(0, 40, table)], 4, torch.device("cpu"), num_kv_heads=2)
    with torch.inference_mode():
        ours = model(torch.tensor(tokens), meta, cache, torch.arange(40))
    ref = hf_logits(hf, tokens)
    assert ours.dtype == torch.float32 and ours.shape == (40, VOCAB)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ref.std() > 0.1  # the reference is not near-constant, so the comparison means something


def feed_in_chunks(runner: ModelRunner, tokens: list[int], chunks: list[int], table: list[int]) -> list[torch.Tensor]:
    """Feed `chunks` sizes, then the rest one token at a time; logits of each step's last token."""
    sizes = chunks + [1] * (len(tokens) - sum(chunks))
    out, pos = [], 0
    for step, n in enumerate(sizes):
        so = SchedulerOutput(step=step, scheduled=(sched("a", tokens[pos : pos + n], pos, table),))
        out.append(runner.compute_logits(so)["a"])
        pos += n
    return out


def ends_of(chunks: list[int], total: int) -> list[int]:
    sizes = chunks + [1] * (total - sum(chunks))
    ends, pos = [], 0
    for n in sizes:
        pos += n
        ends.append(pos - 1)
    return ends


@pytest.mark.parametrize("chunks,block_size", [([5, 1, 7, 3], 4), ([16, 9], 16), ([1, 2, 3], 1), ([30], 8)])
def test_chunked_prefill_then_decode_matches_hf(llama, chunks, block_size):
    hf, arch = llama
    tokens = random_tokens(37, seed=2)
    num_blocks = 64 if block_size > 1 else 128
    table = random.Random(3).sample(range(num_blocks), -(-len(tokens) // block_size))  # non-contiguous
    runner = runner_for(hf, arch, num_blocks, block_size)
    got = feed_in_chunks(runner, tokens, chunks, table)
    ref = hf_logits(hf, tokens)
    ends = ends_of(chunks, len(tokens))
    torch.testing.assert_close(torch.stack(got), ref[ends], atol=ATOL, rtol=0)


def test_mixed_flat_batch_matches_each_alone(llama):
    """Prefill chunks and decodes of four requests share steps; each must match HF and a solo run."""
    hf, arch = llama
    lengths = {"a": 23, "b": 9, "c": 31, "d": 14}
    tokens = {rid: random_tokens(n, seed=10 + i) for i, (rid, n) in enumerate(lengths.items())}
    # Disjoint, shuffled blocks per request (block size 4).
    pool = random.Random(4).sample(range(64), 64)
    tables = {rid: pool[i * 10 : i * 10 + 10] for i, rid in enumerate(lengths)}
    plan = {"a": [8, 8, 7], "b": [9], "c": [5, 12, 3, 4], "d": [1, 1, 6]}  # then 1-token decodes
    runner = runner_for(hf, arch)
    pos = dict.fromkeys(lengths, 0)
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in lengths}
    step = 0
    while any(pos[r] < lengths[r] for r in lengths):
        scheduled = []
        for rid in lengths:  # requests join and leave in different steps
            if pos[rid] >= lengths[rid] or (rid == "d" and step < 2):
                continue
            n = plan[rid].pop(0) if plan[rid] else 1
            scheduled.append(sched(rid, tokens[rid][pos[rid] : pos[rid] + n], pos[rid], tables[rid]))
            pos[rid] += n
        logits = runner.compute_logits(SchedulerOutput(step=step, scheduled=tuple(scheduled)))
        assert set(logits) == {s.request_id for s in scheduled}
        for s in scheduled:
            got[s.request_id].append((s.end_pos - 1, logits[s.request_id]))
        step += 1
    for rid in lengths:
        ref = hf_logits(hf, tokens[rid])
        ends = [e for e, _ in got[rid]]
        torch.testing.assert_close(torch.stack([g for _, g in got[rid]]), ref[ends], atol=ATOL, rtol=0)
        solo = runner_for(hf, arch)
        alone = feed_in_chunks(solo, tokens[rid], [], tables[rid])  # token by token
        torch.testing.assert_close(torch.stack([g for _, g in got[rid]]), torch.stack(alone)[ends], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_other_variants_match_hf(kind, tie):
    hf, arch = tiny_hf(kind, tie=tie, seed=5)
    if not tie:  # an untied head must really differ from the embedding, or the test proves nothing
        assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    tokens = random_tokens(29, seed=6)
    runner = runner_for(hf, arch)
    got = feed_in_chunks(runner, tokens, [11, 5], random.Random(7).sample(range(64), 8))
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(torch.stack(got), ref[ends_of([11, 5], len(tokens))], atol=ATOL, rtol=0)


def test_execute_samples_only_where_asked_and_greedy_is_argmax(llama):
    hf, arch = llama
    runner = runner_for(hf, arch)
    ta, tb = random_tokens(10, 20), random_tokens(12, 21)
    out = runner.execute(SchedulerOutput(step=0, scheduled=(
        sched("a", ta, 0, [0, 1, 2]), sched("b", tb[:6], 0, [3, 4, 5], sample=False),
    )))
    assert set(out.sampled_token_ids) == {"a"}
    assert out.sampled_token_ids["a"] == int(hf_logits(hf, ta)[-1].argmax())
    out = runner.execute(SchedulerOutput(step=1, scheduled=(sched("b", tb[6:], 6, [3, 4, 5]),)))
    assert out.sampled_token_ids == {"b": int(hf_logits(hf, tb)[-1].argmax())}


def test_bfloat16_runner_tracks_float32(llama):
    hf, arch = llama
    tokens = random_tokens(20, seed=8)
    runner = ModelRunner(arch, weights_of(hf), dtype=torch.bfloat16, device="cpu")
    runner.initialize_kv_cache(16, 4)
    got = feed_in_chunks(runner, tokens, [12], [3, 1, 4, 0, 5])
    ref = hf_logits(hf, tokens)[ends_of([12], 20)]
    assert all(g.dtype == torch.float32 for g in got)
    err = (torch.stack(got) - ref).abs().max().item()
    assert 0 < err < 0.1 * ref.abs().max().item()  # bf16 rounding shows, but stays small


def test_kv_sizing_and_bad_input(llama):
    hf, arch = llama
    runner = ModelRunner(arch, weights_of(hf), dtype=torch.float32)
    assert runner.kv_bytes_per_block(16) == 2 * 3 * 16 * 2 * 16 * 4
    with pytest.raises(RuntimeError):
        runner.execute(SchedulerOutput(step=0, scheduled=(sched("a", [1, 2], 0, [0]),)))
    runner.initialize_kv_cache(4, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(SchedulerOutput(step=0, scheduled=(sched("a", [1] * 5, 0, [0]),)))
    with pytest.raises(ValueError, match="block id"):
        runner.execute(SchedulerOutput(step=0, scheduled=(sched("a", [1], 0, [4]),)))
    with pytest.raises(ValueError, match="vocabulary"):
        runner.execute(SchedulerOutput(step=0, scheduled=(sched("a", [VOCAB], 0, [0]),)))
    with pytest.raises(ValueError, match="missing"):
        LlamaModel(arch, {k: v for k, v in weights_of(hf).items() if "layers.1.mlp.up" not in k})


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "lengths",
    [[1, 5, 17, 1100, 640, 3, 999, 64], [1, 3, 5, 17, 64, 640, 999, 1100], [33], sorted(61 + i % 4 for i in range(20))],
)
def test_batched_decode_attention_matches_naive(dtype, atol, lengths):
    """Paged, padded, batched decode attention against a per-request float64 loop over positions.

    Small groups go through the fused kernel, the 20-request group through two batched matmuls; the
    sorted case is split into several length groups, the unsorted one into less tight groups.
    """
    kvh, g, d, bs = 2, 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=2400, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                  dtype=dtype, device=torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    pool = random.Random(1).sample(range(2400), 2400)
    tables, start = [], 0
    for n in lengths:
        tables.append(pool[start : start + -(-n // bs)])
        start += len(tables[-1])
    meta = AttentionMetadata.build([SeqSpan(n - 1, 1, t) for n, t in zip(lengths, tables, strict=True)], bs,
                                   torch.device("cpu"), num_kv_heads=kvh)
    q = torch.randn(len(lengths), kvh * g, d, generator=gen).to(dtype)
    kv_new = torch.randn(len(lengths), 2, kvh, d, generator=gen).to(dtype)
    if lengths == sorted(lengths) and max(lengths) > 10 * min(lengths):
        assert len(meta.decodes) > 1
    if len(lengths) == 20:
        assert [(d.num_rows, d.fused) for d in meta.decodes] == [(20, False)]  # one group, too big to fuse
    out = paged_attention(q, kv_new, cache.layer(0), meta)
    layer = cache.layer(0).double()  # [2, KVH, NB, bs, D], now holding the new K/V too
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        pos = torch.arange(n)
        ctx = layer[:, :, torch.tensor(table)[pos // bs], pos % bs]  # [2, KVH, n, D]
        torch.testing.assert_close(ctx[:, :, -1], kv_new[i].double())  # the new K/V landed in its slot
        for head in range(kvh * g):
            k, v = ctx[0, head // g], ctx[1, head // g]
            p = torch.softmax(k @ q[i, head].double() / d**0.5, dim=0)
            torch.testing.assert_close(out[i, head].double(), p @ v, atol=atol, rtol=0)


def test_decode_groups_minimise_padded_work():
    # One long context among short ones: alone in its group (64 + 31*8 + 64 + 40 < 64 + 32*40).
    assert decode_groups([8] * 31 + [40], overhead=64) == [(0, 31), (31, 32)]
    # Close lengths: one group beats paying the overhead twice.
    assert decode_groups([5, 6, 7, 8, 9, 10], overhead=64) == [(0, 6)]
    # No overhead: every distinct length is its own group; huge overhead: one group.
    assert decode_groups([1, 1, 2, 3, 3], overhead=0) == [(0, 2), (2, 3), (3, 5)]
    assert decode_groups([1, 2, 300], overhead=10**6) == [(0, 3)]
    assert decode_groups([]) == [] and decode_groups([7]) == [(0, 1)]
    # Brute force over every split of a small unsorted case agrees on the cost.
    nbs = [3, 9, 1, 9, 2, 20, 4]
    def cost(groups):
        return sum(5 + (hi - lo) * max(nbs[lo:hi]) for lo, hi in groups)
    best = min(
        cost([(a, b) for a, b in zip([0, *cuts], [*cuts, len(nbs)], strict=True)])
        for k in range(len(nbs))
        for cuts in itertools.combinations(range(1, len(nbs)), k)
    )
    groups = decode_groups(nbs, overhead=5)
    assert [lo for lo, _ in groups][0] == 0 and groups[-1][1] == len(nbs)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
    assert cost(groups) <= best + 0  # splitting inside equal runs never helps, so exact here too


def test_execute_returns_logprobs_and_seeded_samples_by_request(llama):
    hf, arch = llama
    runner = runner_for(hf, arch)
    tokens = random_tokens(6, 30)
    params = SamplingParams(temperature=0.8, seed=5, logprobs=3)
    step = (ScheduledRequest("s", tuple(tokens), 0, (0, 1), True, params),
            ScheduledRequest("g", tuple(tokens), 0, (2, 3), True, GREEDY))
    first = runner.execute(SchedulerOutput(step=0, scheduled=step))
    again = runner.execute(SchedulerOutput(step=1, scheduled=step[:1]))  # same step index, alone
    assert set(first.logprobs) == {"s"} and len(first.logprobs["s"].top) == 3
    assert first.logprobs["s"].token_id == first.sampled_token_ids["s"] == again.sampled_token_ids["s"]
    ref = torch.log_softmax(hf_logits(hf, tokens)[-1], -1)
    assert first.logprobs["s"].logprob == pytest.approx(ref[first.sampled_token_ids["s"]].item(), abs=1e-4)
