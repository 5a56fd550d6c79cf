"""--record-steps: every executed step's shape and duration, one JSON line each, as the cost model reads shapes."""

from __future__ import annotations

from cadence.config import EngineConfig
from cadence.engine.builder import build_engine
from cadence.executor.cost_model import StepFeatures
from cadence.executor.step_log import read_step_log
from cadence.request import Request, SamplingParams


def test_a_served_engine_records_each_step_it_ran(tmp_path):
    path = tmp_path / "steps.jsonl"
    cfg = EngineConfig.from_options(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                                    record_steps=str(path))
    core = build_engine(cfg, tiny=True).core
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    core.add_request(Request("a", list(range(100, 140)), params))  # 40 tokens: three chunks of at most 16
    core.add_request(Request("b", list(range(200, 205)), params))
    while core.has_unfinished_requests():
        core.step()
    core.step_observer.close()
    rows = read_step_log(path)
    assert len(rows) == core.scheduler.step_count
    shapes = [f for f, _ in rows]
    assert all(isinstance(f, StepFeatures) and d > 0 for f, d in rows)
    # Every prompt token is computed once, in chunks within the budget; every output but the
    # first (sampled by the last chunk) comes from a decode row.
    assert sum(f.prefill_tokens for f in shapes) == 45
    assert max(f.prefill_tokens + f.decode_seqs for f in shapes) <= 16
    assert sum(f.decode_seqs for f in shapes) == 2 * 3
    assert sum(f.sampled for f in shapes) == 2 * 4


def test_each_step_says_when_it_ended(tmp_path):
    # `end` lines steps up with a client's records (unix time) and shows the engine's time between
    # steps: each step ends after the one before it ended plus its own duration.
    import json
    import time

    path = tmp_path / "steps.jsonl"
    cfg = EngineConfig.from_options(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                                    record_steps=str(path))
    core = build_engine(cfg, tiny=True).core
    core.add_request(Request("a", list(range(100, 140)), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)))
    before = time.time()
    while core.has_unfinished_requests():
        core.step()
    after = time.time()
    core.step_observer.close()
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert len(lines) == core.scheduler.step_count >= 4
    assert before <= lines[0]["end"] - lines[0]["duration"] + 1e-3 and lines[-1]["end"] <= after
    for prev, cur in zip(lines, lines[1:]):
        assert cur["end"] - cur["duration"] >= prev["end"] - 1e-3
    assert len(read_step_log(path)) == len(lines)  # the reader takes the shape and duration, not `end`
