"""Synthetic cost profiles from roofline arithmetic, for devices this project cannot calibrate on.

A step's time is modelled as the sum of what it must read from memory and what it must compute,
each at a stated fraction of the device's peak:

- every step reads the weights once: weight bytes / (HBM bandwidth x memory efficiency) (`const`);
- every token through the linear layers costs 2 x parameters FLOPs at the prefill efficiency
  (`prefill_tokens` for a prompt chunk's tokens, `decode_seqs` for a decode row's one token);
- a decode row reads its context's KV: KV bytes per token / (HBM bandwidth x memory efficiency)
  per key (`decode_context`);
- a prompt chunk's attention costs 4 x layers x (query heads x head dim) FLOPs per (query, key)
  pair (Q.K and the weighted sum of V, 2 FLOPs per multiply-add) at the prefill efficiency
  (`prefill_attention`);
- the engine adds a fixed time per step and per running request (scheduling, launches).

Summing memory and compute time overstates a step where they overlap (a real step takes about
the larger of the two); the error is largest for mid-sized decode batches. The profile is marked
`synthetic`: it is arithmetic, not a measurement. `python -m cadence.sim.roofline --out FILE`
writes the shipped one (sim/profiles/gpu_like_8b.json); docs/simulator.md writes the arithmetic out.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cadence.executor.cost_model import PROFILE_FORMAT


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: int
    layers: int
    query_dim: int  # query heads x head dim
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bfloat16
    max_model_len: int = 8192

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, the KV heads only (grouped-query attention), bfloat16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense peak
    memory_efficiency: float  # share of the HBM bandwidth a decode step's reads get
    compute_efficiency: float  # share of peak FLOPs a prompt chunk's matmuls get (model FLOPs utilisation)
    step_overhead_s: float  # scheduling and kernel launches per step
    seq_overhead_s: float  # per running request per step


# Llama 3 8B: 32 layers, hidden 4096 (32 query heads of 128), 8 KV heads, 8,030,261,248 parameters.
LLAMA3_8B = ModelShape("Llama-3-8B", params=8_030_261_248, layers=32, query_dim=4096, kv_heads=8, head_dim=128)
# An H100 SXM: 3.35 TB/s HBM3, 989 dense bfloat16 TFLOP/s.
H100_CLASS = Device("H100-class GPU", hbm_bytes_per_s=3.35e12, bf16_flops=989e12, memory_efficiency=0.8,
                    compute_efficiency=0.5, step_overhead_s=0.5e-3, seq_overhead_s=10e-6)


def coefficients(model: ModelShape, device: Device) -> dict[str, float]:
    """The cost model's weights (feature set "phases"), in seconds per unit of each feature."""
    mem = device.hbm_bytes_per_s * device.memory_efficiency
    flops = device.bf16_flops * device.compute_efficiency
    per_token = 2 * model.params / flops
    return {"const": model.weight_bytes / mem, "prefill_tokens": per_token, "decode_seqs": per_token,
            "sampled": 0.0,  # the LM head is among the parameters each token already pays for
            "decode_context": model.kv_bytes_per_token / mem,
            "prefill_attention": 4 * model.layers * model.query_dim / flops}


def roofline_profile(model: ModelShape = LLAMA3_8B, device: Device = H100_CLASS, block_size: int = 16) -> dict[str, Any]:
    """A profile (the JSON `cadence calibrate` writes) from the arithmetic above."""
    return {"cadence_profile": PROFILE_FORMAT, "model": f"{model.name} (synthetic)", "dtype": "bfloat16",
            "device": f"{device.name} (synthetic)", "synthetic": True,
            "synthetic_note": "roofline arithmetic, not a measurement: no step of this model was timed "
                              "(python -m cadence.sim.roofline; docs/simulator.md)",
            "machine": {"cpu": "none (synthetic)"},
            "kv_bytes_per_token": model.kv_bytes_per_token, "block_size": block_size,
            "max_model_len": model.max_model_len,
            "roofline": {"model": asdict(model), "device": asdict(device), "weight_bytes": model.weight_bytes},
            "suggested_engine_options": {"kv_cache_memory": "40GiB", "max_num_seqs": 256,
                                         "max_num_batched_tokens": 2048},
            "overhead_source": "assumed",
            "cost_model": {"feature_set": "phases", "coefficients": coefficients(model, device),
                           "overhead": {"per_step": device.step_overhead_s, "per_seq": device.seq_overhead_s},
                           "min_cost": 1e-6, "unit": "seconds"},
            "fit": {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the synthetic GPU-like profile (Llama 3 8B on an H100-class GPU)")
    p.add_argument("--out", required=True, help="profile to write")
    args = p.parse_args(argv)
    Path(args.out).write_text(json.dumps(roofline_profile(), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
