"""benchmarks/spec_replay.py replays recorded greedy outputs through the real engine: the replayed
tokens are the recording's in every mode, and a verification row keeps exactly the drafts that
match the recorded continuation (all of them where the output repeats its prompt, none where it
never does)."""

from __future__ import annotations

import argparse
import itertools

from benchmark_scripts import load_benchmark

from cadence.executor.cost_model import StepCostModel, default_profile_path

PERIOD = (11, 12, 13, 14, 15, 16, 17)
EOS = frozenset({2})


def _bench():
    return load_benchmark("spec_replay")


def _replay(output: tuple[int, ...], mode: str, k: int = 4):
    bench = _bench()
    rec = [bench.Recorded(PERIOD * 3, len(output), output)]
    args = argparse.Namespace(k=k, max_num_batched_tokens=None)
    return bench.replay(rec, 1, mode, args, StepCostModel.load(str(default_profile_path(2))), EOS)


def test_drafts_that_continue_the_recording_are_all_accepted() -> None:
    """The output repeats the prompt's period, then EOS: after the first token (from the prompt)
    each row of fixed k verifies 4 right drafts and adds the token after them, 5 tokens a row, the
    last row cut to what max_tokens leaves (its token after the drafts is the EOS)."""
    output = tuple(itertools.islice(itertools.cycle(PERIOD), 60)) + (2,)
    off, fixed = _replay(output, "off"), _replay(output, "fixed")
    assert off.tokens == fixed.tokens == len(output) and off.rows == 0
    assert (fixed.rows, fixed.draft_tokens, fixed.accepted) == (12, 48, 48)
    assert fixed.seconds < off.seconds / 2  # 13 steps of 5 decode rows instead of 61 of one


def test_drafts_that_leave_the_recording_are_rejected_there() -> None:
    """The output starts by repeating the prompt (11, 12, 13), then says what the prompt never did:
    the one row of drafts (12, 13, 14, 15 after the first 11) keeps two; no n-gram matches after."""
    output = PERIOD[:3] + tuple(range(20, 60))
    fixed = _replay(output, "fixed")
    assert fixed.tokens == len(output)
    assert (fixed.rows, fixed.draft_tokens, fixed.accepted) == (1, 4, 2)
