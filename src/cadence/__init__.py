"""cadence: an LLM serving engine whose heart is the scheduler.

`from cadence import LLM, SamplingParams, StructuredOutputsParams`. `LLM` is imported lazily so that the pure parts
(scheduler, workloads, the benchmark client) load without torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# How torch's OpenMP threads wait between parallel ops decides the speed of a decode step, which is
# ~1000 small ops. Waiting passively (sleeping) costs a wake-up per op: a bfloat16 single-stream
# step measured 42 ms. Spinning forever makes every op fight for the CPU with anything beside the
# engine (the HTTP loop, a benchmark client): measured up to 50x slower on a busy 2-core machine.
# A short spin (GOMP_SPINCOUNT=1000, then sleep) keeps threads awake across the back-to-back ops of
# a step and yields the CPU between steps: measured 1.2x the served throughput of passive waiting
# at 8 streams (docs/performance.md). Set OMP_WAIT_POLICY or GOMP_SPINCOUNT to override; it only
# takes effect before torch is first imported, hence here.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"

from cadence.request import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from cadence.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from cadence.llm import LLM

        return LLM
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
