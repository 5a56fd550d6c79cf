"""--record-steps: every executed step's shape and duration, one JSON line each, as the cost model reads shapes."""

from __future__ import annotations

import pytest

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
    for prev, cur in zip(lines, lines[1:], strict=False):
        assert cur["end"] - cur["duration"] >= prev["end"] - 1e-3
    assert len(read_step_log(path)) == len(lines)  # the reader takes the shape and duration, not `end`


def _lines(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


STEP = {"prefill_tokens": 0, "prefill_seqs": 0, "decode_seqs": 1, "sampled": 1, "decode_context": 10,
        "decode_padded": 10, "prefill_attention": 0, "decode_context_shared": 0}


def test_each_line_names_its_process_so_a_fleet_s_replicas_can_be_told_apart(tmp_path):
    # A fleet's replicas append to one file, each numbering its steps from 1.
    import json
    import os

    path = tmp_path / "steps.jsonl"
    cfg = EngineConfig.from_options(dtype="float32", num_kv_blocks=64, record_steps=str(path))
    core = build_engine(cfg, tiny=True).core
    core.add_request(Request("a", list(range(100, 110)), SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)))
    while core.has_unfinished_requests():
        core.step()
    core.step_observer.close()
    assert {json.loads(s)["pid"] for s in path.read_text().splitlines()} == {os.getpid()}


def test_a_last_line_cut_short_by_a_kill_is_left_out(tmp_path):
    path = _lines(tmp_path / "steps.jsonl", [{"step": 1, "duration": 0.01, **STEP}, {"step": 2, "duration": 0.02, **STEP}])
    path.write_text(path.read_text() + '{"step": 3, "end": 1, "dura')
    assert [d for _, d in read_step_log(path)] == [0.01, 0.02]
    # the same line inside the file is damage, not a kill: refused with its line number
    path.write_text('{"step": 3, "dura\n' + path.read_text())
    with pytest.raises(ValueError, match=r"steps.jsonl:1: not JSON"):
        read_step_log(path)


@pytest.mark.parametrize("duration", [float("inf"), float("nan"), -0.5, "1", True])
def test_a_duration_that_is_no_time_is_refused_with_its_line(tmp_path, duration):
    path = _lines(tmp_path / "steps.jsonl", [{"step": 1, "duration": 0.01, **STEP}, {"step": 2, "duration": duration, **STEP}])
    with pytest.raises(ValueError, match=r"steps.jsonl:2: not a step record .*duration: expected seconds >= 0"):
        read_step_log(path)


def test_a_line_that_is_not_an_object_is_refused_plainly(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"steps.jsonl:1: not a step record .*expected an object of step fields"):
        read_step_log(path)
