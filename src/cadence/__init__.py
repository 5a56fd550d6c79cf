"""cadence: an LLM serving engine whose heart is the scheduler.

`from cadence import LLM, SamplingParams`. `LLM` is imported lazily so that the pure parts
(scheduler, workloads, the benchmark client) load without torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin while waiting turn every parallel torch op into a fight for the CPU when
# anything else runs beside the engine (the HTTP loop, a tokenizer, another process): a bf16 decode
# step measured 35 ms with passive waiting and 1.6 s without on a shared 2-core machine. It only takes
# effect if set before torch is first imported, hence here; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from cadence.request import SamplingParams

if TYPE_CHECKING:
    from cadence.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from cadence.llm import LLM

        return LLM
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
