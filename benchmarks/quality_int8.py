"""int8 activations against bfloat16 ones: perplexity and top-1 agreement with float32, on a fixed text.

    .venv/bin/python benchmarks/quality_int8.py [--tokens 20480] [--window 1024] [--threads 1] [--json FILE]

The text is one every install has: the Python documentation topics the standard library ships
(`pydoc_data.topics`, in sorted order; the figures are for the Python the run names), its first
--tokens tokens under the model's tokenizer, cut into windows of --window tokens. Each window is
one prefill from position 0, and each of its positions but the last predicts the next token.

Three configurations of the same checkpoint (the default model unless --model):
  float32   the reference: torch ops on the dequantised weights, float32 activations
  bfloat16  the default path: cadence's kernels, Q4_1 layers on their blocks, bfloat16 activations
  int8      --activation-dtype int8: Q4_1 / Q4_0 / Q8_0 layers and a Q8_0 output layer on int8 activations
For each: perplexity, its ratio to bfloat16's, and top-1 agreement with float32 (the share of
positions where both predict the same next token).
"""

from __future__ import annotations

import cadence  # noqa: F401  (first: it sets cadence's OpenMP default, read when torch loads)

# isort: split
import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cadence.executor.model_runner import ModelRunner
from cadence.model.attention import AttentionMetadata, SeqSpan
from cadence.model.loader import Checkpoint, default_model_path, load_checkpoint
from cadence.model.tokenizer import Tokenizer

BLOCK = 16
CONFIGS = ("float32", "bfloat16", "int8")


def fixed_text() -> str:
    """Python's documentation topics, as the standard library ships them, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def text_windows(tokenizer: Tokenizer, tokens: int, window: int) -> list[list[int]]:
    """The fixed text's first `tokens` tokens in windows of `window` (the last may be shorter)."""
    ids = tokenizer.encode(fixed_text())
    if len(ids) < tokens:
        raise ValueError(f"--tokens: the text has {len(ids)} tokens under this tokenizer, fewer than {tokens}")
    ids = ids[:tokens]
    return [ids[i : i + window] for i in range(0, tokens, window) if len(ids[i : i + window]) > 1]


def make_runner(ckpt: Checkpoint, config: str, window: int) -> ModelRunner:
    dtype = torch.float32 if config == "float32" else torch.bfloat16
    runner = ModelRunner(ckpt.arch, ckpt.weights, dtype=dtype, q4_1=ckpt.q4_1, q8_0=ckpt.q8_0, q4_0=ckpt.q4_0,
                         activation_dtype="int8" if config == "int8" else "auto")
    runner.initialize_kv_cache(num_blocks=-(-window // BLOCK), block_size=BLOCK)
    return runner


def window_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill of `tokens` from position 0. [L, V] float32"""
    model, n = runner.model, len(tokens)
    meta = AttentionMetadata.build([SeqSpan(0, n, list(range(-(-n // BLOCK))))], BLOCK, torch.device("cpu"),
                                   model.arch.num_kv_heads, model.decode_kernels)
    assert runner.kv_cache is not None
    with torch.inference_mode():
        return model(torch.tensor(tokens), meta, runner.kv_cache, torch.arange(n))


@dataclass
class Score:
    perplexity: float
    top1_agreement: float  # with float32's predictions
    positions: int
    seconds: float


def measure(ckpt: Checkpoint, windows: list[list[int]], configs: tuple[str, ...] = CONFIGS) -> dict[str, Score]:
    """Each configuration's perplexity and agreement with float32 (which is always run) on `windows`."""
    order = ("float32", *[c for c in configs if c != "float32"])
    width = max(len(w) for w in windows)
    reference: list[torch.Tensor] = []
    out: dict[str, Score] = {}
    for config in order:
        runner = make_runner(ckpt, config, width)
        nll, agree, count, start = 0.0, 0, 0, time.perf_counter()
        for i, w in enumerate(windows):
            logits = window_logits(runner, w)[:-1].double()
            target = torch.tensor(w[1:])
            nll += float(-(logits.log_softmax(-1).gather(1, target[:, None])).sum())
            top1 = logits.argmax(-1)
            if config == "float32":
                reference.append(top1)
            agree += int((top1 == reference[i]).sum())
            count += len(target)
        out[config] = Score(math.exp(nll / count), agree / count, count, time.perf_counter() - start)
        del runner
    return {c: out[c] for c in configs if c in out} | {"float32": out["float32"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path()
    ckpt = load_checkpoint(path, torch.float32)
    windows = text_windows(Tokenizer.from_model_path(path), args.tokens, args.window)
    scores = measure(ckpt, windows)
    print(f"{path.name}, {args.tokens} tokens of Python {platform.python_version()}'s pydoc_data topics in windows "
          f"of {args.window}, {args.threads} thread(s)")
    base = scores["bfloat16"].perplexity
    for config in CONFIGS:
        s = scores[config]
        print(f"{config:>9}: perplexity {s.perplexity:8.4f} ({s.perplexity / base - 1:+.2%} vs bfloat16)  "
              f"top-1 agreement with float32 {s.top1_agreement:.2%}  ({s.positions} positions, {s.seconds:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": path.name, "python": platform.python_version(), "tokens": args.tokens, "window": args.window,
            "threads": args.threads, "scores": {c: asdict(s) for c, s in scores.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
