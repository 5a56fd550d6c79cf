"""A client request's priority, tenant, deadline and cache salt travel as one `RequestPolicy`, and
a `Request` equals only itself."""

from __future__ import annotations

import dataclasses

import pytest
from fakes import make_engine, make_request

from cadence.engine.async_engine import fan_out
from cadence.request import DEFAULT_POLICY, Request, RequestPolicy, SamplingParams


def test_a_policy_reaches_every_engine_request_of_a_client_request() -> None:
    policy = RequestPolicy(priority=2, tenant="acme", deadline=5.0, cache_salt="s1")
    reqs = fan_out([[1, 2], [3]], SamplingParams(n=2, seed=7), "r", 10.0, policy)
    assert [r.request_id for r in reqs] == ["r-0", "r-1", "r-2", "r-3"]
    assert {(r.priority, r.tenant, r.deadline, r.cache_salt, r.arrival_time) for r in reqs} == {(2, "acme", 15.0, "s1", 10.0)}
    assert [r.sampling_params.seed for r in reqs] == [7, 8, 7, 8]
    (alone,) = fan_out([[1]], SamplingParams(), "q", 3.0, DEFAULT_POLICY)
    assert (alone.request_id, alone.priority, alone.tenant, alone.deadline, alone.cache_salt) == ("q", 0, "default", None, None)


def test_a_policy_is_one_frozen_value() -> None:
    policy = RequestPolicy(tenant="t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.tenant = "u"  # type: ignore[misc]
    assert policy == RequestPolicy(0, "t", None, None) and hash(policy) == hash(RequestPolicy(tenant="t"))


def test_a_request_equals_only_itself() -> None:
    a, b = Request("x", [1, 2]), Request("x", [1, 2])
    assert a == a and a != b and len({a, b}) == 2
    running = [b, a]
    running.remove(a)  # what the scheduler does when a request leaves the running list
    assert running[0] is b


def test_the_scheduler_takes_the_leaving_request_itself_off_the_running_list() -> None:
    engine, _, _ = make_engine()
    reqs = [make_request(prompt_len=4, max_tokens=8) for _ in range(3)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    engine.abort_requests([reqs[1].request_id])
    assert engine.scheduler.running == [reqs[0], reqs[2]] and all(
        x is y for x, y in zip(engine.scheduler.running, (reqs[0], reqs[2]), strict=True))
