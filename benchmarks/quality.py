"""Quality of cadence's reduced-precision configurations against the float32 model, on a fixed text.

    .venv/bin/python benchmarks/quality.py [--configs bf16,kv8,act8,act8+kv8,act8-1] [--tokens 20480]
        [--window 2048] [--chunk 512] [--threads 1] [--model PATH] [--json out.json]

The text is the string contents of CPython's `pydoc_data/topics.py` (the help topics that ship
with the interpreter: prose and code), joined in sorted topic order and tokenized without special
tokens; its first `--tokens` tokens are cut into windows of `--window`, each fed to the model from
position 0 in prefill chunks of `--chunk`, so later positions attend over long contexts read from
the KV cache. Every position but a window's last predicts the next token. For each configuration:

  perplexity    exp(mean negative log-likelihood of the text's next tokens)
  vs bf16       its perplexity relative to the bf16 configuration's (when that one is run)
  top-1 agree   the share of positions whose most likely token is the float32 model's

Configurations (`CONFIGS`; a new one is a line there):

  f32        the reference: the float32 model on torch ops, float32 KV cache (always run)
  bf16       the model as served by default: bfloat16 activations and KV cache (cadence's CPU
             kernels where the CPU has AVX512-BF16, GGUF Q4_1 layers on their four-bit values)
  kv8        bf16 with the 8-bit KV cache (--kv-cache-dtype int8)
  act8       bf16 with int8 activations (--activation-dtype int8; needs AVX512-VNNI): the
             gate-up and output layers' inputs in two int8 terms, the others in one
  act8+kv8   both: int8 activations and the 8-bit KV cache
  act8-1     int8 activations with every layer's input in one int8 term (llama.cpp's scheme)

`--int8-two-terms KINDS` (comma-separated of qkv, o, gate_up, down, output, or "none") sets the
kinds in two int8 terms for the act8 configurations: how much each kind's rounding costs.

`--emulate NAME=SPEC` (repeatable) adds a configuration NAME that asks what another quantization of
the activations would cost before a kernel is written for it: the bf16 model with the kinds SPEC
names computed in float32 on their dequantised weights, from inputs rounded as an int8 kernel would
see them (`fake_quantize`: per row and block of k, to the nearest of 255 steps of the block's
max|x|, or 32513 in two terms). SPEC is `KIND:BLOCK[x2],...` of the kinds above or `*` (every kind;
later entries override), e.g. `*:32,gate_up:16,output:16`; kinds it leaves out stay bfloat16. On the
default model `*:32` lands within a few tokens in 4,096 of act8-1, the kernels' own one-term figure.

The default model's weights are the same in all (the GGUF's, dequantised exactly for float32).
The window is 2,048 tokens by default so that most positions attend over contexts of hundreds to
thousands of cached tokens, where the 8-bit cache's error accumulates; the figures depend on the
text and so on the Python version: it is printed.
"""

from __future__ import annotations

import cadence  # noqa: F401  (first: it sets cadence's OpenMP default, read when torch loads)

# isort: split
import argparse
import json
import math
import platform
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cadence.executor.model_runner import ModelRunner
from cadence.model.attention import AttentionMetadata, SeqSpan
from cadence.model.llama import INT8_TWO_TERMS, LINEAR_KINDS
from cadence.model.loader import Checkpoint, default_model_path, load_checkpoint
from cadence.model.tokenizer import Tokenizer

BLOCK = 16
REFERENCE = "f32"


@dataclass(frozen=True)
class Config:
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    activation_dtype: str = "auto"
    int8_two_terms: frozenset[str] = INT8_TWO_TERMS  # with int8 activations: the kinds in two int8 terms
    about: str = ""
    emulate: tuple[tuple[str, int, int], ...] = ()  # (kind, block, terms): fake-quantized inputs (--emulate)


CONFIGS: dict[str, Config] = {
    "f32": Config(torch.float32, about="float32 model, float32 KV cache (the reference)"),
    "bf16": Config(torch.bfloat16, about="bfloat16 activations and KV cache (the default)"),
    "kv8": Config(torch.bfloat16, kv_cache_dtype="int8", about="bfloat16 activations, 8-bit KV cache"),
    "act8": Config(torch.bfloat16, activation_dtype="int8", about="int8 activations, bfloat16 KV cache"),
    "act8+kv8": Config(torch.bfloat16, kv_cache_dtype="int8", activation_dtype="int8",
                       about="int8 activations, 8-bit KV cache"),
    "act8-1": Config(torch.bfloat16, activation_dtype="int8", int8_two_terms=frozenset(),
                     about="int8 activations, every layer in one int8 term"),
}


@dataclass
class Score:
    """Running sums over the text's predicted positions."""

    nll: float = 0.0
    positions: int = 0
    agree: int = 0
    top1: list[torch.Tensor] | None = None  # the most likely token at each position, in order

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.positions)


def topic_text() -> str:
    """CPython's pydoc_data/topics.py, its strings joined in sorted topic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def text_tokens(tokenizer: Tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(topic_text(), add_special_tokens=False)
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


def make_runner(ckpt: Checkpoint, config: Config, window: int) -> ModelRunner:
    runner = ModelRunner(ckpt.arch, ckpt.weights, dtype=config.dtype, q4_1=ckpt.q4_1, q8_0=ckpt.q8_0,
                         q4_0=ckpt.q4_0, kv_cache_dtype=config.kv_cache_dtype,
                         activation_dtype=config.activation_dtype, int8_two_terms=config.int8_two_terms)
    runner.initialize_kv_cache(-(-window // BLOCK), BLOCK)
    if config.emulate:
        emulate(runner, ckpt, config.emulate)
    return runner


# ------------------------------------------------------------------------------------ --emulate
LEVELS = {1: 127, 2: 16256}  # int8 steps either side of 0: one term, and two (a 15-bit integer)


def fake_quantize(x: torch.Tensor, block: int, terms: int = 1) -> torch.Tensor:
    """`x` [.., k] in float32, each row's blocks of `block` k rounded as an int8 kernel quantizes
    them: q = x / s to the nearest integer (ties to even), s = max|x| / 127 of the block (16256 in two
    terms), and returned as q * s."""
    if x.shape[-1] % block:
        raise ValueError(f"block {block} does not divide k = {x.shape[-1]}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / LEVELS[terms], torch.ones_like(amax))
    return (torch.round(xb / scale) * scale).reshape(x.shape)


def parse_emulation(spec: str) -> tuple[tuple[str, int, int], ...]:
    """`KIND:BLOCK[x2],...` (KIND of LINEAR_KINDS or `*`) -> ((kind, block, terms), ...) in
    LINEAR_KINDS order."""
    chosen: dict[str, tuple[int, int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, size = part.partition(":")
        terms = 2 if size.endswith("x2") else 1
        size = size.removesuffix("x2")
        if kind != "*" and kind not in LINEAR_KINDS:
            raise ValueError(f"{part!r}: {kind!r} is not * or one of {', '.join(LINEAR_KINDS)}")
        if not size.isdigit() or int(size) not in (8, 16, 32):
            raise ValueError(f"{part!r}: expected KIND:BLOCK with BLOCK 8, 16 or 32, optionally x2 (two terms)")
        for k in LINEAR_KINDS if kind == "*" else (kind,):
            chosen[k] = (int(size), terms)
    if not chosen:
        raise ValueError("expected KIND:BLOCK[x2],... (e.g. *:32,gate_up:16)")
    return tuple((k, *chosen[k]) for k in LINEAR_KINDS if k in chosen)


# A decoder layer's linear kinds as the checkpoint's matrices, concatenated in this order (as the model fuses them).
LAYER_MATRICES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                  "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def emulate(runner: ModelRunner, ckpt: Checkpoint, spec: tuple[tuple[str, int, int], ...]) -> None:
    """Replace the named linear layers of `runner`'s model by float32 products of their dequantised
    weights (the checkpoint's, as loaded in float32) with `fake_quantize`d inputs."""
    model, w = runner.model, ckpt.weights
    model.fused_decode = None  # (the scored steps are prefill chunks; no step may bypass the layers)

    def install(layer: Any, weight: torch.Tensor, block: int, terms: int) -> None:
        wt = weight.float().t().contiguous()
        layer._float32 = lambda x: fake_quantize(x, block, terms) @ wt
        layer._forward = lambda x: layer._float32(x).to(x.dtype)

    for kind, block, terms in spec:
        if kind == "output":
            install(model.lm_head, w.get("lm_head.weight", w["model.embed_tokens.weight"]), block, terms)
            continue
        for i, layer in enumerate(model.layers):
            weights = [w[f"model.layers.{i}.{name}.weight"] for name in LAYER_MATRICES[kind]]
            install(getattr(layer, kind), torch.cat(weights), block, terms)


def chunk_logits(runner: ModelRunner, ids: list[int], chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """One window fed from position 0 in prefill chunks of `chunk`: (start, logits) per chunk, the
    logits of its positions that predict a token of the window (all but the window's last). [rows, V]"""
    model, cpu = runner.model, torch.device("cpu")
    assert runner.kv_cache is not None
    table = list(range(-(-len(ids) // BLOCK)))
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        rows = min(len(piece), len(ids) - 1 - start)
        if rows <= 0:  # only the window's last token: it predicts nothing, and nothing reads its K/V
            continue
        meta = AttentionMetadata.build([SeqSpan(start, len(piece), table)], BLOCK, cpu, model.arch.num_kv_heads,
                                       model.decode_kernels)
        with torch.inference_mode():
            yield start, model(torch.tensor(piece), meta, runner.kv_cache, torch.arange(rows))


def window_logits(runner: ModelRunner, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """The logits of every position of `ids` but the last, fed from position 0 in chunks of `chunk`
    (None: one prefill). [len(ids) - 1, V] float32"""
    return torch.cat([logits for _, logits in chunk_logits(runner, ids, chunk or len(ids))])


def score_config(runner: ModelRunner, tokens: list[int], window: int, chunk: int,
                 reference: Score | None) -> Score:
    """Feed the text window by window (each from position 0, in prefill chunks) and score every
    position's prediction of the next token; top-1 agreement against `reference` (None: keep the
    top-1 tokens, this is the reference)."""
    score = Score(top1=[] if reference is None else None)
    ref_top1 = torch.cat(reference.top1) if reference is not None and reference.top1 is not None else None
    for w0 in range(0, len(tokens) - 1, window):
        ids = tokens[w0 : w0 + window]
        for start, logits in chunk_logits(runner, ids, chunk):
            rows = logits.shape[0]
            targets = torch.tensor(ids[start + 1 : start + 1 + rows])
            logp = torch.log_softmax(logits.double(), dim=-1)
            score.nll -= float(logp.gather(1, targets[:, None]).sum())
            top1 = logits.argmax(dim=-1)
            if ref_top1 is not None:
                score.agree += int((top1 == ref_top1[score.positions : score.positions + rows]).sum())
            elif score.top1 is not None:
                score.top1.append(top1)
            score.positions += rows
    if reference is None:
        score.agree = score.positions
    return score


def evaluate(names: list[str], tokens: list[int], window: int, chunk: int, ckpt: Checkpoint,
             progress: bool = False) -> dict[str, dict[str, float]]:
    """{config: {perplexity, agreement (0..1), positions, seconds}}, the reference first."""
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    out: dict[str, dict[str, float]] = {}
    reference: Score | None = None
    for name in [REFERENCE, *(n for n in names if n != REFERENCE)]:
        t0 = time.perf_counter()
        runner = make_runner(ckpt, CONFIGS[name], window)
        score = score_config(runner, tokens, window, chunk, reference)
        if name == REFERENCE:
            reference = score
        out[name] = {"perplexity": score.perplexity, "agreement": score.agree / score.positions,
                     "positions": score.positions, "seconds": time.perf_counter() - t0}
        if progress:
            print(f"  {name}: perplexity {score.perplexity:.4f} ({out[name]['seconds']:.0f} s)", file=sys.stderr,
                  flush=True)
        del runner
    return out


def report(results: dict[str, dict[str, float]]) -> str:
    base = results.get("bf16")
    lines = [f"{'config':<10}{'perplexity':>12}{'vs bf16':>10}{'top-1 agree':>13}   what"]
    for name, r in results.items():
        rel = f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}%" if base else "-"
        lines.append(f"{name:<10}{r['perplexity']:>12.4f}{rel:>10}{100 * r['agreement']:>12.2f}%   {CONFIGS[name].about}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="bf16,kv8,act8,act8+kv8,act8-1",
                    help=f"comma-separated, of {', '.join(CONFIGS)} (f32 always runs)")
    ap.add_argument("--tokens", type=int, default=20480, help="tokens of the text to score")
    ap.add_argument("--window", type=int, default=2048, help="context of each window (positions from 0)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="", help="GGUF file or Hugging Face directory (default: the default model)")
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    ap.add_argument("--int8-two-terms", default="",
                    help="act8, act8+kv8: these layer kinds in two int8 terms (comma-separated, or none; "
                         f"default {','.join(sorted(INT8_TWO_TERMS))})")
    ap.add_argument("--emulate", action="append", default=[], metavar="NAME=SPEC",
                    help="add configuration NAME: SPEC's kinds on fake-quantized inputs (KIND:BLOCK[x2],...; "
                         "see above)")
    args = ap.parse_args()
    builtin = list(CONFIGS)
    for item in args.emulate:
        name, _, spec = item.partition("=")
        if name in CONFIGS and name not in builtin:
            ap.error(f"--emulate {item!r}: NAME {name!r} is given twice")
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name) or name in builtin:
            ap.error(f"--emulate {item!r}: expected NAME=SPEC with a NAME of letters, digits and _.+- "
                     f"not of {', '.join(builtin)}")
        try:
            CONFIGS[name] = Config(torch.bfloat16, emulate=parse_emulation(spec), about=f"emulated: {spec}")
        except ValueError as e:
            ap.error(f"--emulate {item!r}: {e}")
    if min(args.tokens, args.window, args.chunk) < 2:
        ap.error("--tokens, --window and --chunk must be >= 2")
    if args.int8_two_terms:
        kinds = frozenset(k for k in args.int8_two_terms.split(",") if k.strip() not in ("", "none"))
        if unknown := kinds - set(LINEAR_KINDS):
            ap.error(f"--int8-two-terms: {sorted(unknown)} are not of {', '.join(LINEAR_KINDS)}")
        for name in ("act8", "act8+kv8"):
            CONFIGS[name] = replace(CONFIGS[name], int8_two_terms=kinds)
    names = list(dict.fromkeys(n.strip() for n in args.configs.split(",") if n.strip()))  # (each once)
    names += [e.partition("=")[0] for e in args.emulate if e.partition("=")[0] not in names]
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path()
    ckpt = load_checkpoint(path, torch.float32)
    tokens = text_tokens(Tokenizer.from_model_path(path), args.tokens)
    print(f"{path.name}: {len(tokens)} tokens of pydoc_data/topics.py (Python {platform.python_version()}) in "
          f"windows of {args.window}, chunks of {args.chunk}; torch {torch.__version__}, {args.threads} threads",
          flush=True)
    results = evaluate(names, tokens, args.window, args.chunk, ckpt, progress=True)
    print(report(results))
    if args.json:
        meta = {"model": path.name, "tokens": len(tokens), "window": args.window, "chunk": args.chunk,
                "threads": args.threads,
                "python": platform.python_version(), "text": "pydoc_data/topics.py"}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
