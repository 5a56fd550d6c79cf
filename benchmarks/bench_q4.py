"""The Q4_1 kernels against the bfloat16 ones: the same model, the same process, alternating.

    .venv/bin/python benchmarks/bench_q4.py [--streams 1,8,32]

Two ModelRunners on the default GGUF: one on the dequantised bfloat16 weights (the packed bfloat16
kernel; what CADENCE_Q4_KERNELS=0 gives), one on the checkpoint's Q4_1 blocks (the default). It
prints decode tokens/s at each batch size (64-token prompts, best of 3 rounds of 15 steps) and a
prefill of 4 x 128 tokens, with the ratios.
"""

from __future__ import annotations

import cadence  # noqa: F401  (first: it sets cadence's OpenMP default, read when torch loads)

# isort: split
import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.executor.model_runner import ModelRunner
from cadence.model.loader import default_model_path, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import BLOCK, GREEDY, CadenceStreams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--json", default="", help="also write the tokens/s of both sides to this JSON file")
    args = ap.parse_args()
    ck = load_checkpoint(default_model_path(), torch.float32)
    runners = {"bf16": ModelRunner(ck.arch, ck.weights, dtype=torch.bfloat16),
               "q4_1": ModelRunner(ck.arch, ck.weights, dtype=torch.bfloat16, q4_1=ck.q4_1)}
    sizes = [int(s) for s in args.streams.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(ck.arch.vocab_size) for _ in range(64)] for _ in range(max(sizes))]
    first_free = -(-(64 + 300) // BLOCK) * max(sizes)
    for r in runners.values():
        r.initialize_kv_cache(num_blocks=first_free + 40, block_size=BLOCK)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bfloat16 dequantised vs Q4_1 blocks")
    decode: dict[str, dict[str, float]] = {}
    for b in sizes:
        streams = {k: CadenceStreams(r, prompts[:b], 300, 0) for k, r in runners.items()}
        for s in streams.values():
            s.decode(3)
        best = dict.fromkeys(runners, 0.0)
        for _ in range(3):
            for k, s in streams.items():
                best[k] = max(best[k], s.decode(15))
        print(f"decode {b:>3} streams: bf16 {best['bf16']:7.1f} tok/s  q4_1 {best['q4_1']:7.1f} tok/s  "
              f"{best['q4_1'] / best['bf16']:.2f}x")
        decode[str(b)] = best
    long = [[rng.randrange(ck.arch.vocab_size) for _ in range(128)] for _ in range(4)]

    def prefill(r: ModelRunner, step: int) -> float:
        reqs = tuple(ScheduledRequest(f"p{i}", tuple(p), 0, tuple(range(first_free + 8 * i, first_free + 8 * i + 8)),
                                      True, GREEDY) for i, p in enumerate(long))
        t0 = time.perf_counter()
        r.execute(SchedulerOutput(step=step, scheduled=reqs))
        return time.perf_counter() - t0

    best = dict.fromkeys(runners, 1e9)
    for it in range(4):
        for k, r in runners.items():
            best[k] = min(best[k], prefill(r, 1000 + it))
    print(f"prefill 4 x 128:     bf16 {512 / best['bf16']:7.0f} tok/s  q4_1 {512 / best['q4_1']:7.0f} tok/s  "
          f"{best['bf16'] / best['q4_1']:.2f}x")
    if args.json:
        prefill = {k: 512 / v for k, v in best.items()}
        Path(args.json).write_text(json.dumps(result_json(decode, prefill), indent=1) + "\n")


def result_json(decode: dict[str, dict[str, float]], prefill: dict[str, float]) -> dict:
    """tokens/s of each side ("bf16", "q4_1"): decode by stream count, and the 4 x 128 prefill."""
    return {"decode": decode, "prefill": {"prompts": 4, "tokens": 128, **prefill}}


if __name__ == "__main__":
    main()
