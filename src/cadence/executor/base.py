"""The executor seam: the real model runner and the simulator's cost model both implement it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cadence.boundary import ModelOutput, SchedulerOutput


class Executor(Protocol):
    """Turns one step's `SchedulerOutput` into sampled tokens.

    `kv_bytes_per_block` lets the engine size the KV cache from a memory budget before any
    blocks exist; `initialize_kv_cache` is then called once with the resulting block count.

    An executor that is also a `DecodeBatchExecutor` gets the step's plain decodes as one
    `SchedulerOutput.decodes` batch of columns rather than in `scheduled`; any other gets every
    request as a `ScheduledRequest`.
    """

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...


@runtime_checkable
class DecodeBatchExecutor(Executor, Protocol):
    """An executor that takes a step's plain decodes as one `DecodeBatch` of columns (the
    simulator's: a simulation's steps are mostly plain decodes, and a record per decode was most
    of its cost). It declares so with `accepts_decode_batch` true; the engine core checks once."""

    accepts_decode_batch: bool
