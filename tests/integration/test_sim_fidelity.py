"""Replaying a real run's step times through the simulator gives the same scheduling decisions.

The recorded run is the real `EngineCore`, `Scheduler`, `KVCacheManager` and `ModelRunner` (the
tiny random-weight model) on the wall clock, fed by the simulator's arrival loop. The KV cache is
small enough that requests are preempted, and some prompts share a prefix so the prefix cache
hits. The replay swaps in `ReplayExecutor` (recorded tokens and step end times) and a
`VirtualClock` started where the wall clock was; every step's batch, block tables, preemptions and
finishes must match, and so must every request's timings.
"""

from __future__ import annotations

import pytest

from cadence.clock import VirtualClock
from cadence.config import EngineConfig
from cadence.engine.builder import build_engine
from cadence.executor.cost_model import ReplayExecutor
from cadence.sim.replay import RecordingExecutor, WallClock
from cadence.sim.simulator import SimOptions, SimResult, Simulator
from cadence.workload import Workload, WorkloadRequest, arrival_times

BLOCK = 16


def _workload(n: int = 20) -> Workload:
    """Mixed prompts (a third share two prefix blocks), arriving faster than the tiny model drains them."""
    times = arrival_times(n, "poisson", rate=400.0, seed=3)
    reqs = []
    for i, t in enumerate(times):
        group = (7, 8) if i % 3 == 0 else ()
        reqs.append(WorkloadRequest(arrival_time=t, prompt_tokens=20 + (i * 37) % 90 + (2 * BLOCK if group else 0),
                                    output_tokens=6 + (i * 11) % 30, prefix_group=group, priority=i % 2))
    return Workload("fidelity", tuple(reqs), prefix_block_tokens=BLOCK)


def _run(config: EngineConfig, inner_factory, clock_factory) -> tuple[SimResult, RecordingExecutor, list[float]]:
    """One simulator run whose executor is wrapped in a recorder; also the `now` of each schedule."""
    recorders: list[RecordingExecutor] = []
    schedule_times: list[float] = []

    def factory(clock):
        recorders.append(RecordingExecutor(inner_factory(clock), clock))
        return recorders[-1]

    def on_step(i, core, end_time):
        recorders[i].on_step(end_time)
        schedule_times.append(core.last_stats.now)

    sim = Simulator(config, None, SimOptions(max_model_len=512), executor_factory=factory,
                    clock_factory=clock_factory, on_step=on_step)
    return sim.run(_workload()), recorders[0], schedule_times


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_replayed_step_times_reproduce_every_decision(policy: str) -> None:
    config = EngineConfig.from_options(dtype="float32", device="cpu", num_kv_blocks=24, block_size=BLOCK,
                                       max_num_seqs=6, max_num_batched_tokens=96, policy=policy)
    runner = build_engine(config, tiny=True).core.executor
    real, recorded, real_sched = _run(config, lambda clock: runner, WallClock)

    # The scenario must exercise what it claims to: preemptions and prefix-cache hits happened.
    stats = real.replicas[0]
    assert stats.preemptions > 0, "the KV cache was not small enough to force a preemption"
    assert stats.prefix_cache_hits > 0, "no prefix-cache hit: the shared prefixes did not share tokens"
    assert any(d.preempted for d in recorded.decisions)
    assert all(r.ok for r in real.records), [r.error for r in real.records if not r.ok]

    steps = recorded.recorded_steps()
    replay, replayed, replay_sched = _run(
        config, lambda clock: ReplayExecutor(steps, kv_bytes_per_block=1, clock=clock),
        lambda: VirtualClock(start=real.t0))

    assert len(replayed.decisions) == len(recorded.decisions)
    for k, (a, b) in enumerate(zip(recorded.decisions, replayed.decisions, strict=True)):
        assert a == b, f"step {k} differs:\nreal   {a}\nreplay {b}"
    # Each replayed step was scheduled at the end of the one before: virtual time ran the real run's course.
    assert len(replay_sched) == len(real_sched)
    assert all(r >= p for r, p in zip(real_sched, replay_sched, strict=True))
    # Same decisions on the same step end times: every token reaches its client at the same time.
    # (Queue time is stamped at schedule time, which the replay reads microseconds early.)
    for a, b in zip(real.records, replay.records, strict=True):
        assert (a.send_time, a.first_token_time, a.end_time, a.token_times) == \
               (b.send_time, b.first_token_time, b.end_time, b.token_times)
        assert b.queue_time <= a.queue_time < b.queue_time + 0.05
