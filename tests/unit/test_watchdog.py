"""The engine watchdog's arithmetic and its thread, without an engine."""

from __future__ import annotations

import threading
import time

import pytest

from cadence.engine.watchdog import STALL_FACTOR, StepPace, Watchdog


def test_the_expected_longest_step_follows_the_largest_step_seen() -> None:
    pace = StepPace(max_step_tokens=512)
    assert pace.expected_longest() == 0.0
    pace.observe(0.010, 1)  # a decode step: its fixed cost says nothing of a full step
    pace.observe(0.015, 8)
    assert pace.expected_longest() == pytest.approx(0.015)  # the longest step only
    pace.observe(0.2, 64)  # a sixteenth of a full step or more: extrapolated to 512 tokens
    assert pace.expected_longest() == pytest.approx(1.6)
    pace.observe(0.05, 32)  # smaller than the largest: the estimate stays
    assert pace.expected_longest() == pytest.approx(1.6)
    pace.observe(3.0, 16)  # a step longer than the estimate, whatever its size, raises it
    assert pace.expected_longest() == pytest.approx(3.0)


def test_the_limit_is_the_floor_or_a_multiple_of_the_expected_longest_step() -> None:
    pace = StepPace(max_step_tokens=512)
    dog = Watchdog(60.0, pace, lambda: True, lambda *_: None)
    assert dog.limit() == 60.0
    pace.observe(4.0, 512)
    assert dog.limit() == 60.0
    pace.observe(20.0, 512)
    assert dog.limit() == pytest.approx(STALL_FACTOR * 20.0)


def test_a_stall_needs_work_waiting_or_running() -> None:
    work = {"any": False}
    dog = Watchdog(1.0, StepPace(512), lambda: work["any"], lambda *_: None)
    dog.beat = 100.0
    assert dog.stalled(100.5) is None
    assert dog.stalled(102.0) is None  # a long idle turn: nobody waits
    work["any"] = True
    assert dog.stalled(100.9) is None
    assert dog.stalled(102.0) == (pytest.approx(2.0), 1.0)


def test_the_thread_reports_a_stall_once_and_a_beating_loop_never() -> None:
    calls: list[tuple[float, float]] = []
    tripped = threading.Event()

    def on_stall(running: float, limit: float) -> None:
        calls.append((running, limit))
        tripped.set()

    alive = Watchdog(0.2, StepPace(512), lambda: True, on_stall)
    alive.start()
    end = time.monotonic() + 0.8
    while time.monotonic() < end:  # an engine loop turning every 10 ms
        alive.beat = time.monotonic()
        time.sleep(0.01)
    alive.stop()
    assert not calls
    stuck = Watchdog(0.2, StepPace(512), lambda: True, on_stall)
    stuck.start()
    assert tripped.wait(10)
    time.sleep(0.3)
    stuck.stop()
    assert len(calls) == 1 and calls[0][0] > 0.2 and calls[0][1] == 0.2


def test_a_zero_floor_turns_the_watchdog_off() -> None:
    dog = Watchdog(0.0, StepPace(512), lambda: True, lambda *_: None)
    dog.start()
    assert not dog.enabled and not dog._thread.is_alive()
