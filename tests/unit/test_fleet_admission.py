"""The ingress's admission with retries (`admission_anywhere`) over fake replica streams."""

from __future__ import annotations

import asyncio

import pytest

from cadence.errors import AdmissionError, CadenceError, ErrorKind
from cadence.fleet.client import admission_anywhere
from cadence.fleet.protocol import Admitted, GenerateCall, Refused
from cadence.request import SamplingParams


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


def _admit(send: object, replicas: list[str]) -> tuple[object, Admitted]:
    call = GenerateCall(([1, 2, 3],), SamplingParams(max_tokens=1), "req-1")
    return asyncio.run(admission_anywhere(send, call, "replica", replicas))  # type: ignore[arg-type]


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
