"""This tree's C kernels against another git revision's, in one process, alternating.

    .venv/bin/python benchmarks/bench_kernels.py --baseline HEAD~1 [--rounds 5] [--streams 1,8,32]
        [--context 256] [--weights q4_1|bf16] [--kv-cache-dtype auto|int8]

Two ModelRunners on the default GGUF, alike but for the kernel library each computes with: this
tree's `kernels/cpu_bf16.c` and the one at `--baseline` (read with `git show`, compiled with the
same flags; `--activation-dtype int8`: both on the GGUF's Q4_1 and Q8_0 layers with int8
activations, as `cadence serve --activation-dtype int8` runs them). Each round measures, for each side in turn:
  prefill 1 x 512   one 512-token prompt in one step (tokens/s)
  prefill 4 x 128   four 128-token prompts in one step (tokens/s)
  decode xB         B streams of `--context`-token prompts, 20 decode steps (tokens/s)
and the script prints each side's median over the rounds, the ratio of medians (this tree /
baseline; above 1 is faster) and the spread of the per-round ratios. Both sides run the same Python
code (this tree's), so the C library's calling convention must be the same at both revisions.

`--kv-cache-dtype int8` puts this tree's side on the 8-bit KV cache (the baseline keeps the model's
dtype): with `--baseline HEAD`, the same kernels on the 8-bit cache against the bfloat16 one.
"""

from __future__ import annotations

import cadence  # noqa: F401  (first: it sets cadence's OpenMP default, read when torch loads)

# isort: split
import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.executor.model_runner import ModelRunner
from cadence.model import cpu_kernels as ck
from cadence.model import llama
from cadence.model.loader import default_model_path, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import BLOCK, GREEDY, CadenceStreams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DECODE_STEPS = 20


def baseline_kernels(rev: str, workdir: Path) -> ck.CpuKernels:
    """The kernel library at `rev`, compiled as cpu_kernels() compiles this tree's."""
    path = "src/cadence/model/kernels/cpu_bf16.c"  # (git show wants the path in the repository)
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True,
                            check=True).stdout
    src, lib = workdir / "baseline.c", workdir / "baseline.so"
    src.write_text(source)
    subprocess.run(["cc", *ck.FLAGS, "-o", str(lib), str(src)], check=True)
    return ck.CpuKernels(ctypes.CDLL(str(lib)))


def runner_with(kernels: ck.CpuKernels, ckpt, weights: str, num_blocks: int,
                kv_cache_dtype: str = "auto", activation_dtype: str = "auto") -> ModelRunner:
    """A runner whose every kernel call goes to `kernels` (the model fetches them at construction)."""
    with mock.patch.object(llama, "cpu_kernels", lambda: kernels):
        runner = ModelRunner(ckpt.arch, ckpt.weights, dtype=torch.bfloat16,
                             q4_1=ckpt.q4_1 if weights == "q4_1" else None,
                             q8_0=ckpt.q8_0 if weights == "q4_1" else None,
                             q4_0=ckpt.q4_0 if weights == "q4_1" else None, kv_cache_dtype=kv_cache_dtype,
                             activation_dtype=activation_dtype)
    assert runner.model.kernels is kernels and runner.model.fused_decode is not None
    runner.initialize_kv_cache(num_blocks=num_blocks, block_size=BLOCK)
    return runner


def prefill_rate(runner: ModelRunner, prompts: list[list[int]], step: int) -> float:
    """tokens/s of one step prefilling `prompts` whole, each in its own blocks."""
    reqs, first = [], 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // BLOCK)
        reqs.append(ScheduledRequest(f"p{i}", tuple(p), 0, tuple(range(first, first + n)), True, GREEDY))
        first += n
    start = time.perf_counter()
    runner.execute(SchedulerOutput(step=step, scheduled=tuple(reqs)))
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose kernels/cpu_bf16.c to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decode stream")
    ap.add_argument("--activation-dtype", choices=("auto", "int8"), default="auto",
                    help="int8: the quantized layers on int8 activations, both sides (needs --weights q4_1)")
    ap.add_argument("--weights", choices=("q4_1", "bf16"), default="q4_1",
                    help="the GGUF's Q4_1 layers as served (default) or their bfloat16 dequantisation")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                    help="this tree's side on the model's dtype's KV cache or the 8-bit one (the baseline: auto)")
    ap.add_argument("--json", default="", help="also write every round's tokens/s to this JSON file")
    args = ap.parse_args()
    if args.activation_dtype == "int8" and args.weights != "q4_1":
        ap.error("--activation-dtype int8: runs on the checkpoint's quantized blocks (--weights q4_1)")
    if args.rounds < 1 or args.context < 1:
        ap.error("--rounds and --context must be >= 1")
    streams = [int(s) for s in args.streams.split(",")]
    ours = ck.cpu_kernels()
    if ours is None:
        sys.exit("this machine cannot run cadence's CPU kernels (AVX512-BF16 and a C compiler are needed)")
    ckpt = load_checkpoint(default_model_path(), torch.float32)
    vocab = ckpt.arch.vocab_size
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=gen).tolist()

    per_stream = -(-(args.context + DECODE_STEPS * (args.rounds + 1) + 1) // BLOCK)
    num_blocks = max(per_stream * max(streams), 64) + 8
    with tempfile.TemporaryDirectory() as tmp:
        act = args.activation_dtype
        sides = {"this tree": runner_with(ours, ckpt, args.weights, num_blocks, args.kv_cache_dtype, act),
                 args.baseline: runner_with(baseline_kernels(args.baseline, Path(tmp)), ckpt, args.weights,
                                            num_blocks, args.kv_cache_dtype, act)}
        work: dict[str, Callable[[ModelRunner, int], float]] = {
            "prefill 1 x 512": lambda r, s, p=[tokens(512)]: prefill_rate(r, p, s),
            "prefill 4 x 128": lambda r, s, p=[tokens(128) for _ in range(4)]: prefill_rate(r, p, s),
        }
        prompts = [tokens(args.context) for _ in range(max(streams))]
        for b in streams:
            made: dict[int, CadenceStreams] = {}

            def decode(r: ModelRunner, s: int, b: int = b, made: dict[int, CadenceStreams] = made) -> float:
                if id(r) not in made:  # prefilled once per side, then advanced round after round
                    made[id(r)] = CadenceStreams(r, prompts[:b], DECODE_STEPS * (args.rounds + 1), 0)
                    made[id(r)].decode(2)
                return made[id(r)].decode(DECODE_STEPS)

            work[f"decode x{b} (context {args.context})"] = decode
        rates: dict[str, dict[str, list[float]]] = {w: {k: [] for k in sides} for w in work}
        for rnd in range(args.rounds):
            order = list(sides.items()) if rnd % 2 == 0 else list(sides.items())[::-1]
            for name, fn in work.items():
                for side, runner in order:
                    rates[name][side].append(fn(runner, 1000 * rnd + len(rates[name][side])))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, weights {args.weights}, "
          f"this tree's KV cache {args.kv_cache_dtype}, "
          f"{args.rounds} alternating rounds; tokens/s, medians")
    print(f"{'workload':<28}{'this tree':>11}{args.baseline[:12]:>13}{'ratio':>8}   per-round ratios")
    for name, by_side in rates.items():
        a, b = by_side["this tree"], by_side[args.baseline]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        print(f"{name:<28}{statistics.median(a):>11.1f}{statistics.median(b):>13.1f}"
              f"{statistics.median(a) / statistics.median(b):>8.3f}   {min(ratios):.3f} .. {max(ratios):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result_json(args.baseline, args.weights, rates), indent=1) + "\n")


def result_json(baseline: str, weights: str, rates: dict[str, dict[str, list[float]]]) -> dict:
    """Every round's tokens/s: {workload: {"this tree": [...], "baseline": [...]}}."""
    return {"baseline": baseline, "weights": weights,
            "workloads": {w: {"this tree": s["this tree"], "baseline": s[baseline]} for w, s in rates.items()}}


if __name__ == "__main__":
    main()
