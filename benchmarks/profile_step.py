"""Where the time of a decode step goes: tokens/s and a per-kind breakdown from torch's profiler.

    .venv/bin/python benchmarks/profile_step.py [--streams 1,8,32] [--dtype bfloat16] [--threads N]
        [--context 64] [--weights bf16|q4_1] [--kv-cache-dtype auto|int8] [--ops 0]

For each batch size, streams of a `--context`-token prompt decode through `ModelRunner.execute`
(flat batch, paged cache, sampler, exactly as the engine calls it; `--weights q4_1` keeps the
GGUF's four-bit layers as the server does, bf16 dequantises them; `--activation-dtype int8` with
`--weights q4_1` runs its Q4_1 and Q8_0 layers on int8 activations, as `cadence serve
--activation-dtype int8` does) and the script prints the step
time, then the profiled self time per kind of op: linear layers, attention (gather, kernels,
masks), norms, RoPE, sampling, host-side preparation and the rest. `--kv-cache-dtype int8` runs
on the 8-bit KV cache (as `cadence serve --kv-cache-dtype int8`). `--ops N` also prints the top N
torch ops. The OpenMP wait policy is whatever the environment says (cadence's default: a short
spin; see docs/performance.md), so the same script shows the cost of each setting.
"""

from __future__ import annotations

import os

import cadence  # noqa: F401  (first: it sets cadence's OpenMP default, read when torch loads)

# isort: split
import argparse
import functools
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cadence.executor.model_runner import ModelRunner
from cadence.model.cpu_kernels import cpu_kernels
from cadence.model.loader import default_model_path, load_checkpoint

OMP_ENV = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')}"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import BLOCK, CadenceStreams, load_weights  # noqa: E402

# torch op name -> kind; anything not listed is "other" (views, copies, elementwise glue).
KINDS = {
    "mkldnn::_linear_pointwise": "linear",
    "aten::linear": "linear",
    "aten::addmm": "linear",
    "aten::mm": "linear",
    "aten::bmm": "attention",
    "aten::_softmax": "attention",
    "aten::index_select": "attention",
    "aten::index_copy_": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::masked_fill_": "attention",
    "aten::_fused_rms_norm": "norm",
    "aten::rms_norm": "norm",
    "aten::roll": "rope",
    "aten::addcmul": "rope",
    "aten::argmax": "sampling",
    "aten::embedding": "other",
    "aten::silu": "mlp activation",
    # cadence's CPU kernels (model/cpu_kernels.py) are ctypes calls, invisible to the profiler
    # unless labelled: `label_kernels` wraps each in a record_function of these names.
    "cadence::linear": "linear",
    "cadence::add_rms_norm": "norm",
    "cadence::silu_mul": "mlp activation",
    "cadence::rope_": "rope",
}


@functools.cache
def label_kernels_once() -> None:
    """After the unprofiled timing: the labels cost a little per call."""
    kernels = cpu_kernels()
    if kernels is None:
        return
    for name in ("linear", "add_rms_norm", "silu_mul", "rope_"):
        fn = getattr(kernels, name)

        def labelled(*args, _fn=fn, _label=f"cadence::{name}", **kw):
            with record_function(_label):
                return _fn(*args, **kw)

        setattr(kernels, name, labelled)


def breakdown(prof: profile, steps: int) -> dict[str, float]:
    """CPU ms per step by kind, each top-level torch op counted with its children (rms_norm's casts
    count as norm); everything under `prepare` (host-side batch building) as one kind."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name == "prepare":
            out["prepare (host)"] += ev.cpu_time_total / 1e3 / steps
        elif ev.cpu_parent is None:
            out[KINDS.get(ev.name, "other")] += ev.cpu_time_total / 1e3 / steps
    return dict(out)


class Profiled(CadenceStreams):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        prepare = self.runner.prepare

        def traced(scheduled):
            with record_function("prepare"):
                return prepare(scheduled)

        self.runner.prepare = traced  # type: ignore[method-assign]


def result_json(context: int, weights: str, dtype: str, threads: int) -> dict:
    """The run's settings; main adds, under "streams", each batch size's tok_s, step_ms and breakdown_ms."""
    return {"context": context, "weights": weights, "dtype": dtype, "threads": threads, "streams": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ops", type=int, default=0, help="also print the top N torch ops")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each stream before it decodes")
    ap.add_argument("--activation-dtype", choices=("auto", "int8"), default="auto",
                    help="int8: the checkpoint's Q4_1, Q4_0 and Q8_0 layers on int8 activations (needs --weights q4_1)")
    ap.add_argument("--weights", choices=("bf16", "q4_1"), default="bf16",
                    help="q4_1: the checkpoint's four-bit layers as served (needs --dtype bfloat16)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                    help="the KV cache's storage: the model's dtype, or the 8-bit cache")
    ap.add_argument("--json", default="", help="also write the step times and breakdowns to this JSON file")
    args = ap.parse_args()
    if args.activation_dtype == "int8" and args.weights != "q4_1":
        ap.error("--activation-dtype int8: runs on the checkpoint's quantized blocks (--weights q4_1)")
    if args.context < 1:
        ap.error("--context: must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {OMP_ENV}, "
          f"load average {os.getloadavg()[0]:.1f}, {args.dtype}, {args.weights} weights, {args.context}-token context, "
          f"KV cache {args.kv_cache_dtype}")
    if args.weights == "q4_1":
        if dtype is not torch.bfloat16:
            ap.error("--weights q4_1: the four-bit kernels compute in bfloat16 (--dtype bfloat16)")
        ckpt = load_checkpoint(default_model_path(), torch.float32)
        arch, weights, q4_1, q8_0, q4_0 = ckpt.arch, ckpt.weights, ckpt.q4_1, ckpt.q8_0, ckpt.q4_0
    else:
        arch, weights, _ = load_weights(torch.float32)
        q4_1 = q8_0 = q4_0 = None
    runner = ModelRunner(arch, weights, dtype=dtype, q4_1=q4_1, q8_0=q8_0, q4_0=q4_0,
                         kv_cache_dtype=args.kv_cache_dtype, activation_dtype=args.activation_dtype)
    print(f"activations: {args.activation_dtype}")
    sizes = [int(s) for s in args.streams.split(",")]
    per_stream = -(-(args.context + 4 * args.steps + 16) // BLOCK)
    runner.initialize_kv_cache(num_blocks=per_stream * max(sizes) + 1, block_size=BLOCK)
    rng = random.Random(0)
    prompts = [[rng.randrange(arch.vocab_size) for _ in range(args.context)] for _ in range(max(sizes))]
    result = result_json(args.context, args.weights, args.dtype, torch.get_num_threads())
    result["activation_dtype"] = args.activation_dtype
    for b in sizes:
        s = Profiled(runner, prompts[:b], 4 * args.steps, 0)
        s.decode(3)
        best = max(s.decode(args.steps) for _ in range(2))
        label_kernels_once()
        with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use cost
            s.decode(2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            s.decode(args.steps)
            wall = (time.perf_counter() - t0) / args.steps * 1e3
        parts = breakdown(prof, args.steps)
        total = sum(parts.values())
        print(f"\n{b} streams: {best:.1f} tok/s, step {b / best * 1e3:.1f} ms "
              f"(under the profiler {wall:.1f} ms, of which {total:.1f} ms in torch ops and prepare)")
        for kind, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<16} {ms:7.2f} ms/step  {100 * ms / total:5.1f}%")
        if args.ops:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
        result["streams"][str(b)] = {"tok_s": best, "step_ms": b / best * 1e3, "breakdown_ms": parts}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
