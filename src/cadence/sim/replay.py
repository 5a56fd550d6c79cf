"""Record a real run's steps and replay them through the simulator.

The simulator's loop decides only from arrival times and the clock reading after each step. Drive
it once with the real model runner (wrapped in `RecordingExecutor`) on the wall clock
(`WallClock`), and the run leaves behind every step's scheduling decision, sampled tokens, and
end time. Replaying those tokens and end times (`ReplayExecutor` on a `VirtualClock` that starts
where the wall clock did) must reproduce every decision: same batches, same admissions, same
preemptions, same block tables. The fidelity test does exactly that on the tiny model.

Caveat, stated where it applies: inside a step the real scheduler reads the clock a few
microseconds after the previous step ended; the replay reads the end time itself. Policies that
look at `now` (deadlines) could differ at a boundary that fine; FCFS and priority cannot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cadence.boundary import ModelOutput, SchedulerOutput
from cadence.executor.cost_model import RecordedStep


class WallClock:
    """Monotonic wall time whose `advance_to` waits: the simulator loop then runs in real time."""

    def now(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def advance_to(self, t: float) -> None:
        self.advance(t - time.monotonic())


@dataclass(frozen=True)
class StepDecision:
    """What the scheduler decided in one step, in scheduling order."""

    step: int
    scheduled: tuple[tuple[str, int, int, bool, tuple[int, ...]], ...]  # (id, start_pos, tokens, sample, blocks)
    preempted: tuple[str, ...]
    finished: tuple[str, ...]

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepDecision:
        rows = tuple((r.request_id, r.start_pos, r.num_tokens, r.sample, tuple(r.block_table)) for r in out.scheduled)
        return cls(out.step, rows, tuple(out.preempted_ids), tuple(out.finished_ids))


class RecordingExecutor:
    """Wraps any executor; logs each step's decision, sampled tokens, duration and end time."""

    def __init__(self, inner: Any, clock: Any) -> None:
        self.inner = inner
        self.clock = clock
        self.decisions: list[StepDecision] = []
        self.tokens: list[dict[str, int]] = []
        self.durations: list[float] = []
        self.end_times: list[float] = []
        self.last_step_cost = 0.0

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.inner.kv_bytes_per_block(block_size)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.inner.initialize_kv_cache(num_blocks, block_size)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        t0 = self.clock.now()
        result = self.inner.execute(scheduler_output)
        dur = self.clock.now() - t0
        self.decisions.append(StepDecision.of(scheduler_output))
        self.tokens.append(dict(result.sampled_token_ids))
        self.durations.append(dur)
        self.last_step_cost = max(dur, 1e-12)  # a real step always took some time
        return result

    def on_step(self, end_time: float) -> None:
        """Called by the simulator after each loop step; empty steps executed nothing."""
        if len(self.end_times) < len(self.tokens):
            self.end_times.append(end_time)

    def recorded_steps(self) -> list[RecordedStep]:
        return [RecordedStep(tok, dur, end) for tok, dur, end in
                zip(self.tokens, self.durations, self.end_times, strict=True)]
