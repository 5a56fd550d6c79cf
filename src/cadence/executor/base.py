"""The executor seam: the real model runner and the simulator's cost model both implement it."""

from __future__ import annotations

from typing import Protocol

from cadence.boundary import ModelOutput, SchedulerOutput


class Executor(Protocol):
    """Turns one step's `SchedulerOutput` into sampled tokens.

    `kv_bytes_per_block` lets the engine size the KV cache from a memory budget before any
    blocks exist; `initialize_kv_cache` is then called once with the resulting block count.
    """

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...

