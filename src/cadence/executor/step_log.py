"""`--record-steps FILE`: each step's shape and duration, as JSON lines, for calibration and fidelity.

The simulator charges a step what the cost model predicts from its shape (`StepFeatures`). A
served engine's steps can cost more than the same shapes timed alone (other threads and processes
share the cores and the memory bus), and which shapes a real run makes depends on its traffic.
Recording the steps a served run really made, with their measured durations, lets
`benchmarks/serving_breakdown.py` compare each one with its prediction, by kind of step and by load.

One line per step: `{"step": N, "pid": P, "end": unix time, "duration": seconds, "prefill_tokens": ...}`
(`end`: when the step ended, to line steps up with a client's records and to see the engine's time
between steps; `pid`: the process that ran it, since a fleet's replicas, each a process of its own
numbering its steps from 1, append to one file; the fields of
`StepFeatures`, `decode_context_shared` included, so that a refit on served traffic whose rows
share a prompt prefix can learn what re-reading shared blocks costs). Lines are written as steps
end (line-buffered), so the file is complete up to the last step even if the server is killed; a
last line cut short by a kill mid-write is left out when the file is read. Lines are appended: a
file given again gathers the steps of every run that wrote to it.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TextIO

from cadence.boundary import SchedulerOutput
from cadence.executor.cost_model import StepFeatures


class StepLog:
    """Appends one JSON line per executed step to `path` (see the module docstring)."""

    def __init__(self, path: str | Path, block_size: int = 0) -> None:
        self.path = Path(path)
        self.block_size = block_size  # of the tables' blocks: counts shared decode keys (0: none counted)
        self._file: TextIO | None = self.path.open("a", buffering=1, encoding="utf-8")

    def __call__(self, out: SchedulerOutput, duration: float) -> None:
        if self._file is None:
            return
        f = StepFeatures.from_output(out, self.block_size)
        row = {"step": out.step, "pid": os.getpid(), "end": round(time.time(), 6), "duration": round(duration, 7),
               **f.to_dict()}
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_step_log(path: str | Path) -> list[tuple[StepFeatures, float]]:
    """The (shape, duration) pairs of a step log."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(_step(json.loads(line)))
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):  # cut short by a kill mid-write: not a step
                break
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{path}:{n}: not a step record ({type(e).__name__}: {e})") from None
    return out


def _step(d: dict) -> tuple[StepFeatures, float]:
    if not isinstance(d, dict):
        raise ValueError(f"expected an object of step fields, got {type(d).__name__}")
    duration = d.pop("duration")
    for key in ("step", "pid", "end"):
        d.pop(key, None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in d.values()):
        raise ValueError(f"step shape counts must be whole numbers >= 0, got {d}")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not (math.isfinite(duration)
                                                                                     and duration >= 0):
        raise ValueError(f"duration: expected seconds >= 0, got {duration!r}")
    return StepFeatures(**d), float(duration)
