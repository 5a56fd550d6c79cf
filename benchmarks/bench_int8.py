"""int8 activations against bfloat16 ones, kernel by kernel: one linear layer, alternating.

    .venv/bin/python benchmarks/bench_int8.py [--rows 1,8,32,512] [--rounds 7] [--threads N] [--json FILE]
        [--two-terms]

The default model's layer shapes on random GGUF blocks: qkv 960 x 576, gate-up 3072 x 576 and down
576 x 1536 as Q4_1 (`linear_q4_1`, bfloat16 activations, against `linear_q4_1_i8`), and the tied
output layer 49152 x 576 (bfloat16 `linear_f32` against Q8_0 `linear_q8_0_i8_f32`). For each shape
and row count, each round times both kernels in turn (best of a few calls); the script prints the
median time of each and the median of the per-round ratios (bfloat16 / int8: above 1, int8 is
faster). `--two-terms` times the int8 kernels with the activations in two int8 terms (`_i8x2`,
as `--activation-dtype int8` runs the gate-up and output layers) instead of one. A whole model's steps: benchmarks/profile_step.py or bench_kernels.py with
--activation-dtype int8.
"""

from __future__ import annotations

import cadence  # noqa: F401  (first: it sets cadence's OpenMP default, read when torch loads)

# isort: split
import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cadence.model import cpu_kernels as ck

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LABELS = {"qkv": "qkv 960 x 576, Q4_1", "gate_up": "gate-up 3072 x 576, Q4_1", "down": "down 576 x 1536, Q4_1",
          "lm_head": "output 49152 x 576, Q8_0 (bfloat16 weights before)"}


def blocks(n: int, k: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] matrix as GGUF blocks of `kind` (uint8 rows) and its bfloat16 dequantisation."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05).numpy()
    raw = quantize(w, qtype)
    return torch.from_numpy(raw.copy()).view(torch.uint8).reshape(n, -1), torch.from_numpy(
        dequantize(raw, qtype).copy()).to(torch.bfloat16)


def pair(kernels: ck.CpuKernels, name: str, two_terms: bool) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """(bfloat16-activation call, int8-activation call) for one layer shape."""
    n, k = SHAPES[name]
    if name == "lm_head":
        raw, w = blocks(n, k, "Q8_0")
        packed, i8 = kernels.pack(w), kernels.pack_q8_0_i8(raw, n, k)
        q8 = kernels.linear_q8_0_i8x2_f32 if two_terms else kernels.linear_q8_0_i8_f32
        return lambda x: kernels.linear_f32(x, packed, n, None), lambda x: q8(x, i8, n, None)
    raw, _ = blocks(n, k, "Q4_1")
    q4, i8 = kernels.pack_q4_1(raw, n, k), kernels.pack_q4_1_i8(raw, n, k)
    q4_i8 = kernels.linear_q4_1_i8x2 if two_terms else kernels.linear_q4_1_i8
    return lambda x: kernels.linear_q4_1(x, q4, n, None), lambda x: q4_i8(x, i8, n, None)


def best_of(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--layers", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--json", default="", help="also write every round's times to this JSON file")
    ap.add_argument("--two-terms", action="store_true", help="the int8 kernels with activations in two int8 terms")
    args = ap.parse_args()
    kernels = ck.cpu_kernels()
    if kernels is None or not ck.has_vnni():
        sys.exit("this machine cannot run the int8 kernels (AVX512-BF16, AVX512-VNNI and a C compiler are needed)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.get_num_threads()} threads; median us per call (best of a few calls a round), "
          f"{args.rounds} rounds alternating; ratio bfloat16 / int8")
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name in args.layers.split(","):
        bf16, int8 = pair(kernels, name, args.two_terms)
        for m in rows:
            x = torch.randn(m, SHAPES[name][1], generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            calls = max(3, min(50, 2000 // m))
            bf16(x), int8(x)  # warm up
            t: dict[str, list[float]] = {"bfloat16": [], "int8": []}
            for _ in range(args.rounds):
                t["bfloat16"].append(best_of(bf16, x, calls))
                t["int8"].append(best_of(int8, x, calls))
            ratios = [a / b for a, b in zip(t["bfloat16"], t["int8"], strict=True)]
            print(f"{name:>8} {SHAPES[name][0]:>5} x {SHAPES[name][1]:<4} {m:>4} rows: "
                  f"bfloat16 {statistics.median(t['bfloat16']) * 1e6:9.1f}  int8 {statistics.median(t['int8']) * 1e6:9.1f}"
                  f"  ratio {statistics.median(ratios):.2f} ({min(ratios):.2f} .. {max(ratios):.2f})")
            out.setdefault(name, {})[str(m)] = t
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "labels": LABELS, "times_s": out},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
