"""A client that leaves while its request is on its way to a replica (the ingress has sent it and
the replica has not answered its admission yet): the HTTP layer's abort for it must still reach
the replica that admits it, or the request runs to its last token for nobody, holding a seat and
KV blocks. The ingress is a `FleetClient` over a stand-in for the Serve handle whose admission
answers are held until the test releases them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray")  # (the fleet's extra: `make serve` / `make test` install it)

from fleet_stand_in import StandInHandle, fleet_client  # noqa: E402

from cadence.errors import CadenceError, ErrorKind  # noqa: E402
from cadence.fleet.client import FleetClient  # noqa: E402
from cadence.fleet.protocol import Admitted  # noqa: E402
from cadence.request import SamplingParams  # noqa: E402


class _HeldAdmission:
    """A `generate` call's answer: `Admitted` by replica r1 once `answer` is set, then its end."""

    def __init__(self, answer: asyncio.Event) -> None:
        self._answer = answer
        self._items: list[Any] = [Admitted("r1")]

    def __aiter__(self) -> _HeldAdmission:
        return self

    async def __anext__(self) -> Any:
        await self._answer.wait()
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self) -> None:
        self._items.clear()


class _Handle(StandInHandle):
    """The replicas' handle: held admissions, a subscription that stays open, recorded aborts."""

    def __init__(self) -> None:
        super().__init__(generate=self._generate, subscribe=self._subscribe, abort=self._abort)
        self.answer = asyncio.Event()
        self.sent = asyncio.Event()  # a generate call was sent
        self.aborted: list[str] = []
        self.abort_sent = asyncio.Event()
        self.closed = asyncio.Event()  # the subscriptions end

    def _generate(self, call: Any) -> _HeldAdmission:
        self.sent.set()
        return _HeldAdmission(self.answer)

    async def _subscribe(self, subscriber: str, target: Any) -> AsyncIterator[dict[str, list[Any]]]:
        yield {}
        await self.closed.wait()

    async def _abort(self, request_id: str, target: Any) -> None:
        self.aborted.append(request_id)
        self.abort_sent.set()


async def _abort_before_admission() -> tuple[_Handle, BaseException | None, FleetClient]:
    handle = _Handle()
    client = fleet_client(handle)
    submitted = asyncio.ensure_future(client.submit([[1, 2, 3]], SamplingParams(max_tokens=50), request_id="gone"))
    await handle.sent.wait()
    client.abort("gone")  # the client left (what the HTTP layer calls), before the replica answered
    handle.answer.set()
    stream = await submitted
    error: BaseException | None = None
    try:
        await asyncio.wait_for(stream.__anext__(), 5)
    except CadenceError as e:
        error = e
    await asyncio.wait_for(handle.abort_sent.wait(), 5)
    handle.closed.set()
    return handle, error, client


def test_a_request_aborted_on_its_way_is_aborted_on_the_replica_that_admits_it() -> None:
    handle, error, client = asyncio.run(_abort_before_admission())
    assert handle.aborted == ["gone"]
    assert isinstance(error, CadenceError) and error.kind is ErrorKind.UNAVAILABLE, error
    assert client.num_in_flight == 0 and client._in_admission == {}


async def _second_submit_while_first_in_admission() -> CadenceError:
    handle = _Handle()
    client = fleet_client(handle)
    first = asyncio.ensure_future(client.submit([[1, 2, 3]], SamplingParams(max_tokens=5), request_id="same"))
    await handle.sent.wait()
    try:  # (accepted, it would wait for its own admission, held like the first's)
        await asyncio.wait_for(client.submit([[1, 2, 3]], SamplingParams(max_tokens=5), request_id="same"), 5)
    except CadenceError as e:
        return e
    except TimeoutError:
        raise AssertionError("a second request with the id of one on its way was sent to the replicas") from None
    finally:
        handle.answer.set()
        await (await first).aclose()
        handle.closed.set()
    raise AssertionError("a second request with the id of one on its way was accepted")


def test_a_request_id_on_its_way_to_a_replica_is_in_use() -> None:
    error = asyncio.run(_second_submit_while_first_in_admission())
    assert error.kind is ErrorKind.INVALID_REQUEST and "in use" in str(error), error
