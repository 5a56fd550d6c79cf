"""The ingress's admission with retries (`admission_anywhere`) over fake replica streams."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.fleet.client import admission_anywhere
from cadence.fleet.protocol import Admitted, GenerateCall, Refused, policy_at_replica
from cadence.request import DEFAULT_POLICY, RequestPolicy, SamplingParams


class _Stream:
    def __init__(self, first: object) -> None:
        self.first = first

    async def __anext__(self) -> object:
        return self.first

    def cancel(self) -> None:
        pass


def _full(replica: str) -> Refused:
    return Refused(ErrorKind.QUEUE_FULL.value, "the waiting queue is full (1 requests)", None, 2.0, True, replica)


def _fleet(answers: dict[str, object], order: list[str]) -> tuple[list[tuple[str, ...]], object]:
    """`send` as a router would: the first replica of `order` the call does not avoid answers."""
    sent: list[tuple[str, ...]] = []

    def send(call: GenerateCall) -> _Stream:
        sent.append(call.avoid)
        return _Stream(answers[next(r for r in order if r not in call.avoid)])
    return sent, send


def _admit(send: object, replicas: list[str], hold: object = None,
           policy: RequestPolicy = DEFAULT_POLICY) -> tuple[object, Admitted]:
    call = GenerateCall(([1, 2, 3],), SamplingParams(max_tokens=1), "req-1", policy, sent_at=time.time())
    return asyncio.run(admission_anywhere(send, call, "replica", replicas, hold=hold))  # type: ignore[arg-type]


def test_a_full_queue_refusal_is_tried_on_the_other_replica() -> None:
    sent, send = _fleet({"a": _full("a"), "b": Admitted("b")}, ["a", "b"])
    _, first = _admit(send, ["a", "b"])
    assert first.replica == "b" and sent == [(), ("a",)]


def test_every_replica_full_is_a_429_after_one_try_each() -> None:
    sent, send = _fleet({"a": _full("a"), "b": _full("b")}, ["a", "b"])
    with pytest.raises(AdmissionError) as e:
        _admit(send, ["a", "b"])
    assert e.value.kind is ErrorKind.QUEUE_FULL and e.value.retry_after == 2.0
    assert sent == [(), ("a",)]


def test_other_refusals_are_not_retried() -> None:
    too_long = Refused(ErrorKind.INVALID_REQUEST.value, "too long", "max_tokens", None, True, "a")
    sent, send = _fleet({"a": too_long, "b": Admitted("b")}, ["a", "b"])
    with pytest.raises(CadenceError) as e:
        _admit(send, ["a", "b"])
    assert e.value.kind is ErrorKind.INVALID_REQUEST and sent == [()]


# -- held at the ingress ---------------------------------------------------------------------------


class _Queues:
    """Two replicas whose queues stay full for `full_rounds` rounds, then `b` has room."""

    def __init__(self, full_rounds: int) -> None:
        self.calls = 0
        self.full_rounds = full_rounds

    def send(self, call: GenerateCall) -> _Stream:
        self.calls += 1
        replica = "b" if "a" in call.avoid else "a"
        if self.calls > 2 * self.full_rounds and replica == "b":
            return _Stream(Admitted("b"))
        return _Stream(_full(replica))


def _held(full_rounds: int, policy: RequestPolicy = DEFAULT_POLICY) -> tuple[_Queues, list[float], Admitted]:
    """A request held while `full_rounds` rounds find every queue full; `hold` records its waits."""
    waits: list[float] = []

    async def hold(seconds: float) -> None:
        waits.append(seconds)

    queues = _Queues(full_rounds)
    _, first = _admit(queues.send, ["a", "b"], hold, policy)
    return queues, waits, first


def test_held_a_request_every_replica_refused_is_sent_again_until_one_has_room() -> None:
    from cadence.fleet import client

    queues, waits, first = _held(full_rounds=7)
    assert first.replica == "b" and queues.calls == 2 * 7 + 2
    # Each full round waits (until a seat frees, at most the pause), doubling up to the last pause.
    lo, hi = client.HOLD_PAUSE_S
    assert waits == [min(lo * 2**i, hi) for i in range(7)] and waits[-1] == hi


def test_held_no_longer_than_its_deadline_leaves() -> None:
    _, waits, _ = _held(full_rounds=7, policy=RequestPolicy(deadline=0.3))
    assert all(0 <= w <= 0.3 for w in waits) and max(waits) < 0.3 < 2.0


def test_held_a_refusal_other_than_a_full_queue_is_still_the_answer() -> None:
    late = Refused(ErrorKind.DEADLINE.value, "the request's deadline passed before it was queued", None, None,
                   True, "a")
    sent, send = _fleet({"a": late, "b": Admitted("b")}, ["a", "b"])

    async def hold(seconds: float) -> None:
        raise AssertionError("not held")

    with pytest.raises(CadenceError) as e:
        _admit(send, ["a", "b"], hold)
    assert e.value.kind is ErrorKind.DEADLINE and sent == [()]


def test_held_requests_wake_one_per_freed_seat_the_longest_held_first() -> None:
    from cadence.fleet.client import FleetClient

    ingress = object.__new__(FleetClient)  # (its hold alone, without Serve)
    ingress._seat_waiters = collections.deque()

    async def run() -> list[str]:
        woke: list[str] = []

        async def held(name: str, seconds: float) -> None:
            await ingress._wait_for_seat(seconds)
            woke.append(name)

        tasks = [asyncio.ensure_future(held(n, 30.0)) for n in ("first", "second", "third")]
        await asyncio.sleep(0.01)
        ingress._seat_freed()  # one stream closed: one held request goes
        await asyncio.sleep(0.01)
        assert woke == ["first"]
        tasks[1].cancel()  # the second's client left
        await asyncio.sleep(0.01)
        ingress._seat_freed()
        await asyncio.sleep(0.01)
        assert woke == ["first", "third"] and not ingress._seat_waiters
        await ingress._wait_for_seat(0.01)  # no seat frees: the pause ends the wait
        return woke

    assert asyncio.run(run()) == ["first", "third"]


def test_held_a_client_that_leaves_ends_the_hold() -> None:
    queues = _Queues(full_rounds=10**9)
    call = GenerateCall(([1, 2, 3],), SamplingParams(max_tokens=1), "req-1")

    async def leave() -> None:
        task = asyncio.ensure_future(admission_anywhere(queues.send, call, "replica", ["a", "b"], hold=asyncio.sleep))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave())
    assert queues.calls >= 4  # (it was held, trying again, until the client left)


def test_the_time_held_is_taken_off_the_deadline_at_the_replica() -> None:
    call = GenerateCall(([1],), SamplingParams(max_tokens=1), "r", RequestPolicy(deadline=5.0), sent_at=100.0)
    assert policy_at_replica(call, 102.5).deadline == pytest.approx(2.5)
    assert policy_at_replica(call, 106.0).deadline == pytest.approx(-1.0)  # passed: the engine refuses it
    assert policy_at_replica(call, 99.0).deadline == 5.0  # (a replica's clock behind the ingress's: nothing off)
    assert policy_at_replica(GenerateCall(([1],), SamplingParams(max_tokens=1), "r", sent_at=100.0), 200.0).deadline is None
    unsent = GenerateCall(([1],), SamplingParams(max_tokens=1), "r", RequestPolicy(deadline=5.0))
    assert policy_at_replica(unsent, 200.0).deadline == 5.0
