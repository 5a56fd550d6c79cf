"""cadence: an LLM serving engine whose heart is the scheduler.

`from cadence import LLM, SamplingParams`. `LLM` is imported lazily so that the pure parts
(scheduler, workloads, the benchmark client) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
