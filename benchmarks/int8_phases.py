"""Where a decode step's time goes, phase by phase, bfloat16 against int8 activations and the 8-bit KV cache.

    .venv/bin/python benchmarks/int8_phases.py [--rows 1,8,32] [--context 64] [--rounds 9]
        [--arms bf16,act8,kv8,both] [--threads N] [--json FILE]

Builds one runner per arm over the default model (its Q4_1 layers as served; `act8` with
`--activation-dtype int8`, `kv8` with `--kv-cache-dtype int8`, `both` with the two; `act8-1` with
every layer's activations in one int8 term, `act8-out` with only the output layer's in two) in one process
and, round after round in a turning order, times for each arm:

- the step: `ModelRunner.execute` of `--rows` single-token decodes at `--context` tokens (as the
  engine calls it);
- the decoder layers as `decode_layers` runs them, one kernel at a time through the raw ctypes
  calls with the layers' own weights (norm, qkv, RoPE, K/V store, attention, o, gate-up, SwiGLU,
  down): the sum of the parts beside the one fused call shows what a call costs beyond its kernels;
- the output layer (final norm and the logits' matmul) and the sampler.

Prints each phase's median time per step and the median of the per-round ratios against the first
arm (first arm's time / this arm's: above 1, this arm is faster). The machine's noise moves every
figure; the ratios, taken round by round in one process, are what to read.
"""

from __future__ import annotations

import cadence  # noqa: F401  (first: it sets cadence's OpenMP default, read when torch loads)

# isort: split
import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from cadence.executor.model_runner import ModelRunner
from cadence.model.cpu_kernels import CpuKernels, cpu_kernels
from cadence.model.loader import default_model_path, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import BLOCK, CadenceStreams  # noqa: E402

# name -> (activation dtype, KV cache dtype, kinds in two int8 terms: None for the default)
ARMS: dict[str, tuple[str, str, frozenset[str] | None]] = {
    "bf16": ("auto", "auto", None), "act8": ("int8", "auto", None), "kv8": ("auto", "int8", None),
    "both": ("int8", "int8", None), "act8-1": ("int8", "auto", frozenset()),
    "act8-out": ("int8", "auto", frozenset({"output"}))}
PHASES = ("norm", "qkv", "rope", "kv store", "attention", "o", "gate_up", "silu", "down")


def linear_fns(k: CpuKernels) -> dict[int, Callable[..., object]]:
    """`decode_layers`' weight kinds -> the raw kernel it calls (kernels/cpu_bf16.c, `linear_any`)."""
    return {0: k._linear, 1: k._linear_q4_1, 2: k._linear_q4_1_i8, 3: k._linear_q8_0_i8,
            4: k._linear_q4_1_i8x2, 5: k._linear_q8_0_i8x2}


class LayerTimer:
    """The decoder layers of one arm's model, kernel by kernel, on a fixed batch of decode rows."""

    def __init__(self, runner: ModelRunner, rows: int, context: int) -> None:
        model = runner.model
        assert model.fused_decode is not None and runner.kv_cache is not None
        self.k = model.kernels
        assert self.k is not None
        self.lin = linear_fns(self.k)
        self.dl = model.fused_decode
        a, t = model.arch, rows
        self.t, self.e, self.h, self.kvh, self.d, self.f = t, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, \
            a.intermediate_size
        self.width = (self.h + 2 * self.kvh) * self.d
        gen = torch.Generator().manual_seed(rows)
        self.x = torch.randn(t, self.e, generator=gen).to(torch.bfloat16)
        self.hid = torch.empty(t, self.e, dtype=torch.bfloat16)
        self.delta = torch.randn(t, self.e, generator=gen).to(torch.bfloat16) * 0.01
        self.qkv = torch.empty(t, self.width, dtype=torch.bfloat16)
        self.attn = torch.empty(t, self.h * self.d, dtype=torch.bfloat16)
        self.gu = torch.empty(t, 2 * self.f, dtype=torch.bfloat16)
        self.act = torch.empty(t, self.f, dtype=torch.bfloat16)
        self.cache = runner.kv_cache.kv  # [layers, 2, KVH, blocks, bs, D (+4)]
        self.kv8 = self.cache.dtype == torch.int8
        per_row = -(-(context + 1) // BLOCK)
        self.tables = torch.arange(t * per_row, dtype=torch.int64).view(t, per_row).contiguous()
        self.lens = torch.full((t,), context + 1, dtype=torch.int64)
        self.pos = torch.full((t,), context, dtype=torch.int64)
        self.slots = self.tables[:, context // BLOCK] * BLOCK + context % BLOCK
        self.threads = torch.get_num_threads()

    def run(self, out: dict[str, float]) -> None:
        """Every layer, each kernel timed; adds ns per phase to `out`."""
        k, dl, t, e, thr = self.k, self.dl, self.t, self.e, self.threads
        ptr = dl.pointers.tolist()
        kinds = dl.kinds.tolist()
        now = time.perf_counter_ns
        bs, nblocks = self.cache.shape[4], self.cache.shape[3]
        for i in range(dl.num_layers):
            p, kind = ptr[i], kinds[i]
            layer_cache = self.cache[i]
            t0 = now()
            k._add_rms_norm(self.x.data_ptr(), self.delta.data_ptr(), p[0], self.hid.data_ptr(), t, e, dl.eps, thr)
            t1 = now()
            self.lin[kind[0]](self.hid.data_ptr(), p[2], p[3] or None, self.qkv.data_ptr(), t, self.width, e, thr)
            t2 = now()
            k._rope(self.qkv.data_ptr(), self.pos.data_ptr(), dl.cos.data_ptr(), dl.sin.data_ptr(), t,
                    self.h + 2 * self.kvh, self.h + self.kvh, self.d, thr)
            t3 = now()
            self._store(layer_cache)
            t4 = now()
            fn = k._decode_attention_kv8 if self.kv8 else k._decode_attention
            fn(self.qkv.data_ptr(), self.width, layer_cache.data_ptr(), self.tables.data_ptr(), self.tables.shape[1],
               self.lens.data_ptr(), self.attn.data_ptr(), t, self.h, self.kvh, self.d, bs, nblocks, self.d**-0.5,
               int(self.lens.sum()), thr)
            t5 = now()
            self.lin[kind[1]](self.attn.data_ptr(), p[4], None, self.delta.data_ptr(), t, e, self.h * self.d, thr)
            t6 = now()
            k._add_rms_norm(self.x.data_ptr(), self.delta.data_ptr(), p[1], self.hid.data_ptr(), t, e, dl.eps, thr)
            t7 = now()
            self.lin[kind[2]](self.hid.data_ptr(), p[5], None, self.gu.data_ptr(), t, 2 * self.f, e, thr)
            t8 = now()
            k._silu_mul(self.gu.data_ptr(), self.act.data_ptr(), t, self.f, thr)
            t9 = now()
            self.lin[kind[3]](self.act.data_ptr(), p[6], None, self.delta.data_ptr(), t, e, self.f, thr)
            t10 = now()
            self.delta.mul_(0.01)  # keeps the residual stream from growing over the layers (untimed)
            for name, ns in zip(PHASES, (t1 - t0 + t7 - t6, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t8 - t7,
                                         t9 - t8, t10 - t9), strict=True):
                out[name] += ns

    def _store(self, layer_cache: torch.Tensor) -> None:
        """This step's K and V rows into their slots (`store_kv_rows` in the C) as the layer-by-layer
        path writes them: one torch copy, or the 8-bit cache's `store_kv8`."""
        kv = self.qkv.view(self.t, -1, self.d)[:, self.h:].unflatten(1, (2, self.kvh))  # [T, 2, KVH, D]
        if self.kv8:
            self.k.store_kv8(kv, self.slots, layer_cache)
        else:
            layer_cache.flatten(2, 3).index_copy_(2, self.slots, kv.permute(1, 2, 0, 3))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter_ns()
    fn()
    return float(time.perf_counter_ns() - t)


def arm_round(name: str, runner: ModelRunner, streams: CadenceStreams, layers: LayerTimer, steps: int,
              out: dict[str, dict[str, list[float]]]) -> None:
    """One round of one arm: `steps` of each measurement, ms per step into out[phase][name]."""
    model = runner.model
    step_ns = timed(lambda: streams.decode(steps))
    parts: dict[str, float] = defaultdict(float)
    fused = 0.0
    for _ in range(steps):
        layers.run(parts)
        x = layers.x.clone()
        fused += timed(lambda x=x: model.kernels.decode_layers(  # type: ignore[union-attr]
            x, model.fused_decode, runner.kv_cache.kv, layers.slots, layers.pos, layers.tables, layers.lens,
            int(layers.lens.sum())))
    hidden = layers.x.clone()
    logits_ns = sum(timed(lambda: model.logits(hidden)) for _ in range(steps))
    logits = model.logits(hidden)
    greedy = torch.zeros(logits.shape[0])
    u = torch.rand(logits.shape[0])
    sample_ns = sum(timed(lambda: model.kernels.sample(logits, greedy + 1.0, u)) for _ in range(steps))  # type: ignore[union-attr]
    rec = {"step": step_ns, "layers (fused call)": fused, "output layer": logits_ns, "sample": sample_ns,
           **parts, "layers (sum of parts)": sum(parts.values())}
    for phase, ns in rec.items():
        out[phase][name].append(ns / steps / 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=4, help="steps per measurement per round")
    ap.add_argument("--arms", default="bf16,act8", help=f"of {', '.join(ARMS)}; ratios against the first")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if cpu_kernels() is None:
        sys.exit("needs cadence's CPU kernels (AVX512-BF16 and a C compiler)")
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = args.arms.split(",")
    ckpt = load_checkpoint(default_model_path(), torch.float32)
    rows_list = [int(r) for r in args.rows.split(",")]
    per_stream = -(-(args.context + (args.rounds + 2) * args.steps + 16) // BLOCK)
    runners = {}
    for name in arms:
        act, kv, two = ARMS[name]
        r = ModelRunner(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, q4_1=ckpt.q4_1, q8_0=ckpt.q8_0,
                        q4_0=ckpt.q4_0, activation_dtype=act, kv_cache_dtype=kv,
                        **({} if two is None else {"int8_two_terms": two}))
        r.initialize_kv_cache(num_blocks=per_stream * max(rows_list) + 1, block_size=BLOCK)
        runners[name] = r
    print(f"{torch.get_num_threads()} threads, context {args.context}, {args.rounds} rounds x {args.steps} steps; "
          f"ms per step (median), ratio {arms[0]} / arm (median of rounds)")
    rng = random.Random(0)
    result: dict[str, object] = {}
    for rows in rows_list:
        prompts = [[rng.randrange(ckpt.arch.vocab_size) for _ in range(args.context)] for _ in range(rows)]
        streams = {n: CadenceStreams(r, prompts, (args.rounds + 2) * args.steps, 0) for n, r in runners.items()}
        layers = {n: LayerTimer(r, rows, args.context) for n, r in runners.items()}
        out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for n in arms:  # warm-up
            arm_round(n, runners[n], streams[n], layers[n], 1, defaultdict(lambda: defaultdict(list)))
        for rnd in range(args.rounds):
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            for n in order:
                arm_round(n, runners[n], streams[n], layers[n], args.steps, out)
        print(f"\n{rows} rows:")
        print(f"  {'phase':<22}" + "".join(f"{n:>9}" for n in arms) + "".join(f"{'x ' + n:>10}" for n in arms[1:]))
        for phase, by_arm in out.items():
            meds = [statistics.median(by_arm[n]) for n in arms]
            ratios = [statistics.median(a / b for a, b in zip(by_arm[arms[0]], by_arm[n], strict=True))
                      for n in arms[1:]]
            print(f"  {phase:<22}" + "".join(f"{m:9.3f}" for m in meds) + "".join(f"{r:10.2f}" for r in ratios))
        result[str(rows)] = {p: dict(v) for p, v in out.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"context": args.context, "arms": arms, "ms": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
