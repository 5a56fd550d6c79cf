"""The same parity and concurrency checks on a CUDA device, where one is present.

Skipped, with the reason shown in pytest's summary (`-ra`), on machines without CUDA, so CPU CI
stays green; `pytest -m gpu` runs only these. On a GPU machine they prove that the code path that
CPU CI never takes (device placement, pinned host copies, CUDA kernels for attention and
sampling) computes the same model and stays batch-invariant.
"""

from __future__ import annotations

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
