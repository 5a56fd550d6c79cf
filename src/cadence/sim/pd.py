"""A P/D fleet's shape and the KV transfer's cost: the options of `cadence sim --prefill-replicas P
--decode-replicas D` (the simulator itself is sim/disagg.py). Standard library only: the CLI reads
the defaults when it builds its parser."""

from __future__ import annotations

import math
from dataclasses import dataclass

# A 200 Gb/s link (a 2x100 GbE or an InfiniBand HDR port) moves 25 GB/s.
DEFAULT_KV_TRANSFER_BANDWIDTH = 25.0  # GB/s (10^9 bytes per second)
DEFAULT_KV_TRANSFER_LATENCY_MS = 1.0  # per transfer: the request's hand-off and the connection's round trips


@dataclass(frozen=True)
class PDOptions:
    """The two pools and the link between them."""

    prefill_replicas: int = 1
    decode_replicas: int = 1
    kv_transfer_bandwidth: float = DEFAULT_KV_TRANSFER_BANDWIDTH  # GB/s
    kv_transfer_latency_ms: float = DEFAULT_KV_TRANSFER_LATENCY_MS

    def validate(self) -> PDOptions:
        if self.prefill_replicas < 1:
            raise ValueError(f"prefill_replicas: must be >= 1, got {self.prefill_replicas}")
        if self.decode_replicas < 1:
            raise ValueError(f"decode_replicas: must be >= 1, got {self.decode_replicas}")
        if not (math.isfinite(self.kv_transfer_bandwidth) and self.kv_transfer_bandwidth > 0):
            raise ValueError(f"kv_transfer_bandwidth: must be > 0 GB/s, got {self.kv_transfer_bandwidth:g}")
        if not (math.isfinite(self.kv_transfer_latency_ms) and self.kv_transfer_latency_ms >= 0):
            raise ValueError(f"kv_transfer_latency: must be >= 0 ms, got {self.kv_transfer_latency_ms:g}")
        return self

    @property
    def label(self) -> str:
        return f"{self.prefill_replicas}P{self.decode_replicas}D"


def transfer_bytes(prompt_tokens: int, resident_blocks: int, block_size: int, kv_bytes_per_token: int) -> int:
    """Bytes of a prompt's KV that move to a decode replica holding its first `resident_blocks`
    blocks already: the others, whole blocks (a partial last block travels whole)."""
    blocks = max(0, -(-prompt_tokens // block_size) - resident_blocks)
    return blocks * block_size * kv_bytes_per_token


def transfer_seconds(nbytes: int, bandwidth_gbps: float, latency_ms: float) -> float:
    """The time `nbytes` take on a free link: bytes / bandwidth + latency."""
    return nbytes / (bandwidth_gbps * 1e9) + latency_ms / 1e3
