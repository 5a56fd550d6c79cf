"""A grammar matcher that fails inside the engine ends its own request with an error that names
the failure (a 500 with that message, or a stream's error event then [DONE]); the other requests
of the step run on, no KV block is left behind, and the engine serves on.

The grammar library's own failures put a matcher in its error state (covered in
tests/unit/test_structured_output.py); a matcher that raises stands in here for a failure the
library does not catch (a bug, a Rust panic), injected through the engine's grammar manager."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cadence.boundary import RequestDelta
from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.engine.core import EngineCore
from cadence.request import Request, SamplingParams
from cadence.request import StructuredOutputsParams as SO
from cadence.server.app import create_app

TINY = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64, "enable_prefix_caching": False}
FAILING = SO(regex="[0-9]{12}")  # the spec whose requests get a matcher that raises
FAILS_AFTER = 3  # tokens the failing matcher takes before it raises


class RaisingMatcher:
    """A real matcher that raises once it has taken `after` tokens: when computing its next mask
    (`where="mask"`) or when taking the token that reaches `after` (`where="consume"`)."""

    def __init__(self, real: Any, after: int, where: str) -> None:
        self.real, self.after, self.where, self.consumed = real, after, where, 0

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:  # what llguidance.torch's fill calls
        if self.where == "mask" and self.consumed >= self.after:
            raise RuntimeError("matcher exploded")
        self.real.unsafe_compute_mask_ptr(ptr, size)

    def consume_tokens(self, tokens: list[int]) -> bool:
        self.consumed += len(tokens)
        if self.where == "consume" and self.consumed >= self.after:
            raise RuntimeError("matcher exploded")
        return self.real.consume_tokens(tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def inject_failing_matchers(core: EngineCore, where: str) -> None:
    """Requests with `FAILING` get a RaisingMatcher; every other spec its real one."""
    structured = core.structured
    real_validate = structured.validate

    class Failing:
        def __init__(self, grammar: Any) -> None:
            self.grammar = grammar

        def matcher(self) -> RaisingMatcher:
            return RaisingMatcher(self.grammar.matcher(), FAILS_AFTER, where)

    def validate(spec: SO) -> Any:
        grammar = real_validate(spec)
        return Failing(grammar) if spec == FAILING else grammar

    structured.validate = validate


def _run(core: EngineCore, requests: list[Request]) -> tuple[dict[str, RequestDelta], dict[str, list[int]],
                                                             list[list[RequestDelta]]]:
    core.add_requests(requests)
    finals: dict[str, RequestDelta] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    steps: list[list[RequestDelta]] = []
    while core.has_unfinished_requests():
        deltas = core.step()
        steps.append(deltas)
        for d in deltas:
            tokens[d.request_id] += d.new_token_ids
            if d.finished:
                finals[d.request_id] = d
    return finals, tokens, steps


@pytest.mark.parametrize("where", ["mask", "consume"])
def test_a_matcher_that_raises_ends_only_its_request_and_the_step_goes_on(where):
    engine = build_engine(EngineConfig.from_options(**TINY), tiny=True)
    core = engine.core
    inject_failing_matchers(core, where)
    plain = Request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    good = Request("good", [1, 2, 3], SamplingParams(temperature=1, seed=1, max_tokens=16,
                                                     structured_outputs=SO(regex="[a-z]{6}")))
    bad = Request("bad", [4, 5, 6], SamplingParams(temperature=1, seed=2, max_tokens=16, structured_outputs=FAILING))
    finals, tokens, steps = _run(core, [plain, good, bad])

    end = finals["bad"]
    assert end.finish_reason == "error", end
    assert "grammar matcher failed" in end.error and "matcher exploded" in end.error, end.error
    assert len(tokens["bad"]) <= FAILS_AFTER + 1  # ended in the step it failed (or the next, for a mask)
    if where == "mask":  # the failed row could sample nothing but end-of-sequence
        assert len(tokens["bad"]) == FAILS_AFTER + 1 and tokens["bad"][-1] in engine.tokenizer.eos_token_ids
    (failed_step,) = [s for s in steps if any(d.request_id == "bad" and d.finished for d in s)]
    assert {d.request_id for d in failed_step if not d.finished} >= {"plain"}  # others in that step went on
    assert finals["plain"].finish_reason == "length" and len(tokens["plain"]) == 16
    assert finals["good"].finish_reason == "stop"
    assert re.fullmatch("[a-z]{6}", engine.tokenizer.decode(tokens["good"]))
    assert core.kv.num_free_blocks == core.kv.num_blocks
    core.scheduler.check_integrity()
    assert not core.structured.active and not core.structured._failed

    # The engine serves on, constrained requests included.
    again = Request("again", [7, 8], SamplingParams(temperature=1, seed=4, max_tokens=16,
                                                    structured_outputs=SO(regex="[a-z]{5}")))
    finals, tokens, _ = _run(core, [again])
    assert finals["again"].finish_reason == "stop"
    assert re.fullmatch("[a-z]{5}", engine.tokenizer.decode(tokens["again"]))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, AsyncEngine]]:
    engine = AsyncEngine(build_engine(EngineConfig.from_options(**TINY), tiny=True))
    inject_failing_matchers(engine.core, "mask")
    try:
        with TestClient(create_app(engine, ServerConfig()), raise_server_exceptions=False) as c:
            yield c, engine
    finally:
        engine.shutdown(timeout=10)


BODY = {"prompt": "Count:", "max_tokens": 16, "temperature": 1, "guided_regex": FAILING.regex}


def test_the_failure_is_an_error_response_that_names_it(served):
    client, engine = served
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "grammar matcher failed" in message and "matcher exploded" in message, message
    _serves_on(client, engine)


def test_streamed_the_failure_is_an_error_event_then_done(served):
    client, engine = served
    r = client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert "grammar matcher failed" in error["message"] and "matcher exploded" in error["message"], error
    _serves_on(client, engine)


def _serves_on(client: TestClient, engine: AsyncEngine) -> None:
    ok = client.post("/v1/completions", json={**BODY, "guided_regex": "[a-z]{4}"})
    assert ok.status_code == 200 and re.fullmatch("[a-z]{4}", ok.json()["choices"][0]["text"]), ok.text
    assert client.get("/health").status_code == 200
    core = engine.core  # owned by the engine thread: read there, between steps
    state = asyncio.run(engine.run_in_engine(lambda: (core.kv.num_free_blocks, core.structured.active)))
    assert state == (core.kv.num_blocks, False)
