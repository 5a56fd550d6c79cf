"""Make a draft model for speculative decoding by truncating a Llama-family checkpoint.

    python -m cadence.model.make_draft --num-layers 4 --out drafts/smollm2-4l

keeps the embedding, the first N decoder layers, the final norm and the output layer of the
model (default: the shipped SmolLM2-135M-Instruct) and writes them as a Hugging Face directory
(config.json, model.safetensors, tokenizer.json) that `--speculative-config '{"method":
"draft_model", "model": DIR, ...}'` loads. The draft shares the model's tokenizer by construction;
it predicts what the full model would from the early layers' view of the context, untrained.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cadence.model.arch import ModelArchConfig
from cadence.model.loader import default_model_path, load_checkpoint
from cadence.model.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def truncated_weights(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The tensors of the first `num_layers` decoder layers and every tensor outside the layers."""
    kept = {}
    for name, t in weights.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= num_layers:
            continue
        kept[name] = t
    return kept


def hf_config(arch: ModelArchConfig, num_layers: int) -> dict[str, object]:
    """config.json of the truncated model, as cadence's loader (and transformers) read it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": arch.architecture,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rope_theta": arch.rope_theta,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
    }


def write_draft(arch: ModelArchConfig, weights: dict[str, torch.Tensor], num_layers: int, out: Path,
                tokenizer: Tokenizer | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the first `num_layers` layers of a model as a Hugging Face directory; returns it."""
    from safetensors.torch import save_file

    if not 1 <= num_layers <= arch.num_layers:
        raise ValueError(f"num_layers: must be in [1, {arch.num_layers}] (the model's layers), got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    kept = {k: v.to(dtype).contiguous() for k, v in truncated_weights(weights, num_layers).items()}
    if arch.tie_word_embeddings:
        kept.pop("lm_head.weight", None)
    save_file(kept, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(arch, num_layers), indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save_json(out / "tokenizer.json")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cadence.model.make_draft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-layers", type=int, default=4, help="decoder layers the draft keeps (default: 4)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="weights as written (default: bfloat16)")
    ap.add_argument("--out", required=True, type=Path, help="directory to write")
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else default_model_path()
    ckpt = load_checkpoint(path, torch.float32)
    try:
        write_draft(ckpt.arch, ckpt.weights, args.num_layers, args.out, Tokenizer.from_model_path(path), DTYPES[args.dtype])
    except ValueError as e:
        ap.error(str(e))
    print(f"wrote {args.out}: {args.num_layers} of {ckpt.arch.num_layers} layers of {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
