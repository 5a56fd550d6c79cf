"""The shape of a Llama-family model, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # llama | mistral | qwen2 (SmolLM/SmolLM2 are llama)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: biases on q/k/v projections
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: {self.architecture!r} is not supported (supported: {ARCHITECTURES})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
