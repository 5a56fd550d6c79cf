"""The same parity and concurrency checks on a CUDA device, where one is present.

Skipped, with the reason shown in pytest's summary (`-ra`), on machines without CUDA, so CPU CI
stays green; `pytest -m gpu` runs only these. On a GPU machine they prove that the code path that
CPU CI never takes (device placement, pinned host copies, CUDA kernels for attention and
sampling) computes the same model and stays batch-invariant.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_parity_real import (
    BLOCK,
    NEW_TOKENS,
    Job,
    Reference,
    assert_same_or_near_tie,
    hf_logits,
    one_step,
    run_jobs,
)

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.executor.model_runner import ModelRunner
from cadence.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU parity tests need one"),
]

CUDA_LOGIT_ATOL = 2e-3  # float32 on CUDA (TF32 off): cuBLAS sums in another order than the CPU


@pytest.fixture(scope="module")
def cuda_runner(ref: Reference) -> ModelRunner:
    torch.backends.cuda.matmul.allow_tf32 = False
    runner = ModelRunner(ref.ckpt.arch, ref.ckpt.weights, dtype=torch.float32, device="cuda")
    runner.initialize_kv_cache(num_blocks=160, block_size=BLOCK)
    return runner


def test_cuda_logits_match_transformers(ref: Reference, cuda_runner: ModelRunner):
    for i, prompt in enumerate(ref.prompts):
        want = hf_logits(ref, prompt)[-1]
        got = one_step(cuda_runner, f"g{i}", prompt, 0, list(range(i * 8, i * 8 + 8))).cpu()
        torch.testing.assert_close(got, want, atol=CUDA_LOGIT_ATOL, rtol=0)


def test_cuda_greedy_same_as_cpu_and_batch_invariant(ref: Reference, cuda_runner: ModelRunner, alone):
    solo = {rid: run_jobs(cuda_runner, [Job(rid, j.prompt)], seed=3)[rid] for rid, j in alone.items()}
    for rid, job in alone.items():  # CUDA alone vs CPU alone
        assert_same_or_near_tie(solo[rid].out, job.out, solo[rid].top2, job.top2, f"{rid} cuda vs cpu")
    jobs = [Job(rid, j.prompt, arrive=i, chunk=6 + 2 * i) for i, (rid, j) in enumerate(alone.items())]
    mixed = run_jobs(cuda_runner, jobs, seed=7)
    for rid, s in solo.items():  # CUDA batched vs CUDA alone
        assert_same_or_near_tie(mixed[rid].out, s.out, mixed[rid].top2, s.top2, f"{rid} cuda batched vs alone")


def test_cuda_engine_many_requests_same_as_alone():
    """The whole engine on CUDA: 24 requests at once == each alone (float32, where a flipped greedy
    choice would take a near-tie that 32 tokens of these prompts do not have)."""
    from cadence import LLM

    llm = LLM(device="cuda", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS // 2)
    prompts = [f"Write one sentence about the number {i}." for i in range(24)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i in (0, 7, 23):
        alone = llm.generate(prompts[i], params, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == together[i]


# -- A tiny random Llama (no checkpoint needed): transformers on the CPU is the reference ----------


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cadence.model.arch import ModelArchConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=5000.0, initializer_range=0.1,
                      tie_word_embeddings=True)
    hf = LlamaForCausalLM(cfg).eval()
    arch = ModelArchConfig(
        architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=5000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
        tie_word_embeddings=True, attention_bias=False,
    )
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return hf, arch, weights


def _tiny_step(reqs: list[tuple[str, list[int], int, list[int]]], step: int,
               params: SamplingParams = SamplingParams(temperature=0.0, max_tokens=64)) -> SchedulerOutput:
    return SchedulerOutput(step=step, scheduled=tuple(
        ScheduledRequest(rid, tuple(toks), start, tuple(table), True, params) for rid, toks, start, table in reqs))


def test_cuda_tiny_chunked_and_batched_match_transformers():
    """Chunks, decodes and four requests in one flat batch on CUDA == transformers' full forward."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf, arch, weights = _tiny_llama()
    runner = ModelRunner(arch, weights, dtype=torch.float32, device="cuda")
    runner.initialize_kv_cache(num_blocks=64, block_size=4)
    rng = random.Random(1)
    lengths = {"a": 23, "b": 9, "c": 31, "d": 14}
    tokens = {rid: [rng.randrange(256) for _ in range(n)] for rid, n in lengths.items()}
    pool = random.Random(4).sample(range(64), 64)
    tables = {rid: pool[i * 10: i * 10 + 10] for i, rid in enumerate(lengths)}
    plan = {"a": [8, 8, 7], "b": [9], "c": [5, 12, 3, 4], "d": [1, 1, 6]}  # then 1-token steps
    pos = dict.fromkeys(lengths, 0)
    got: dict[str, list[tuple[int, torch.Tensor]]] = {rid: [] for rid in lengths}
    step = 0
    while any(pos[r] < lengths[r] for r in lengths):
        reqs = []
        for rid in lengths:
            if pos[rid] >= lengths[rid] or (rid == "d" and step < 2):
                continue
            n = plan[rid].pop(0) if plan[rid] else 1
            reqs.append((rid, tokens[rid][pos[rid]: pos[rid] + n], pos[rid], tables[rid]))
            pos[rid] += n
        logits = runner.compute_logits(_tiny_step(reqs, step))
        for rid, toks, start, _ in reqs:
            assert logits[rid].device.type == "cuda"
            got[rid].append((start + len(toks) - 1, logits[rid].cpu()))
        step += 1
    for rid in lengths:
        with torch.no_grad():
            ref = hf(torch.tensor([tokens[rid]])).logits[0].float()
        ends = [e for e, _ in got[rid]]
        torch.testing.assert_close(torch.stack([g for _, g in got[rid]]), ref[ends], atol=1e-4, rtol=0)


def test_cuda_tiny_bfloat16_and_sampling():
    """bfloat16 on CUDA tracks float32; a seeded temperature-1 row draws the same token alone and
    beside others; greedy rows are argmaxes."""
    hf, arch, weights = _tiny_llama(seed=3)
    toks = [random.Random(5).randrange(256) for _ in range(20)]
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0, -1].float()
    bf = ModelRunner(arch, weights, dtype=torch.bfloat16, device="cuda")
    bf.initialize_kv_cache(16, 4)
    got = bf.compute_logits(_tiny_step([("x", toks, 0, [3, 1, 4, 0, 5])], 0))["x"].cpu()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0.05)

    runner = ModelRunner(arch, weights, dtype=torch.float32, device="cuda")
    runner.initialize_kv_cache(64, 4)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=8)
    alone = runner.execute(_tiny_step([("s", toks, 0, [0, 1, 2, 3, 4])], 0, seeded))
    so = SchedulerOutput(step=1, scheduled=(
        ScheduledRequest("g", tuple(toks[:12]), 0, (10, 11, 12), True, SamplingParams(temperature=0.0)),
        ScheduledRequest("s2", tuple(toks), 0, (20, 21, 22, 23, 24), True, seeded),
        ScheduledRequest("p", tuple(toks[:7]), 0, (30, 31), True, SamplingParams(temperature=0.8, top_p=0.5)),
    ))
    mixed = runner.execute(so)
    assert mixed.sampled_token_ids["s2"] == alone.sampled_token_ids["s"]
    with torch.no_grad():
        want_g = int(hf(torch.tensor([toks[:12]])).logits[0, -1].argmax())
    assert mixed.sampled_token_ids["g"] == want_g
    assert 0 <= mixed.sampled_token_ids["p"] < 256
