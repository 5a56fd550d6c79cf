"""OpenTelemetry traces: spans decoded from the wire by a real OTLP receiver the test runs.

In-process servers (create_app over the tiny model) export over OTLP/HTTP to `HttpReceiver`
(tests/security/test_trace_context.py runs `cadence serve` over gRPC). The batch processor's
delay is shortened through its standard variable (OTEL_BSP_SCHEDULE_DELAY) so spans arrive quickly.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from otlp_receiver import HttpReceiver, SilentListener

NO_EOS = {"ignore_eos": True}
SPAN_KIND_SERVER = 2
STATUS_ERROR = 2
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver() -> Iterator[HttpReceiver]:
    r = HttpReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced(receiver: HttpReceiver, server_factory: Any) -> Iterator[Any]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    mp.setenv("OTEL_SERVICE_NAME", "cadence-test")
    try:
        live = server_factory(otlp_traces_endpoint=receiver.url)
    finally:
        mp.undo()
    yield live
    live.app.state.tracer.shutdown()


def _dropped(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'cadence:dropped_trace_spans_total\{reason="(\w+)"\} (\S+)', text)}


def test_a_request_becomes_one_span_with_vllm_and_cadence_attributes(traced, receiver):
    body = {"prompt": "hello there", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "priority": 3,
            "deadline": 30.0, **NO_EOS}
    r = httpx.post(traced.url + "/v1/completions", json=body, headers={"X-Tenant": "acme"}, timeout=30)
    assert r.status_code == 200
    out = r.json()
    span = receiver.sink.wait(out["id"])
    a = span.attributes
    assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER
    assert span.resource["service.name"] == "cadence-test"
    assert a["gen_ai.response.model"] == out["model"]
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (5, 0.5, 0.9)
    assert a["gen_ai.request.n"] == 1
    assert a["gen_ai.usage.prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == out["usage"]["completion_tokens"] == 5
    assert (a["cadence.tenant"], a["cadence.priority"], a["cadence.deadline_s"]) == ("acme", 3, 30.0)
    assert a["cadence.prefix_cache_hit_tokens"] == out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert a["cadence.num_preemptions"] == 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    queue, ttft, e2e = (a[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e"))
    assert 0 <= queue <= ttft <= e2e < (span.end_ns - span.start_ns) / 1e9 + 1e-6
    assert a["gen_ai.latency.time_in_model_prefill"] + queue == pytest.approx(ttft, abs=1e-6)
    names = [e[0] for e in span.events]
    assert names == ["queued", "scheduled", "prefill_chunk", "first_token", "finished"]
    times = [e[1] for e in span.events]
    assert span.start_ns <= times[0] <= times[1] <= times[2] <= times[3] <= times[4] <= span.end_ns
    chunk = span.events[2][2]
    assert chunk["cadence.tokens"] == out["usage"]["prompt_tokens"] and chunk["cadence.start"] == 0
    assert chunk["cadence.last_chunk"] is True and chunk["cadence.step"] >= 1
    assert span.events[4][2]["finish_reason"] == "length"
    assert span.parent_span_id == "" and span.trace_id != TRACE_ID


def test_a_preempted_request_has_its_preemption_resume_and_chunks_in_its_span(receiver, server_factory):
    """A KV cache of 8 blocks of 16 tokens holds one of these requests at its longest, not two: one
    of two running together is preempted, then recomputes."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    try:
        live = server_factory({"num_kv_blocks": 8, "block_size": 16, "max_num_batched_tokens": 32},
                              otlp_traces_endpoint=receiver.url)
    finally:
        mp.undo()
    with ThreadPoolExecutor(2) as pool:
        bodies = [{"prompt": [100 + i + j for j in range(40)], "max_tokens": 70, **NO_EOS} for i in range(2)]
        responses = list(pool.map(lambda b: httpx.post(live.url + "/v1/completions", json=b, timeout=120), bodies))
    assert [r.status_code for r in responses] == [200, 200]
    spans = [receiver.sink.wait(r.json()["id"]) for r in responses]
    hit = [s for s in spans if s.attributes["cadence.num_preemptions"] > 0]
    assert hit, "neither request was preempted"
    span = hit[0]
    names = [e[0] for e in span.events]
    i = names.index("preempted")
    preempted = span.events[i][2]
    assert preempted["cadence.reason"] == "kv_blocks" and preempted["cadence.tokens_lost"] > 0
    assert span.attributes["cadence.preempted_tokens"] == sum(
        e[2]["cadence.tokens_lost"] for e in span.events if e[0] == "preempted")
    # Between losing its blocks and getting them back it waited, for the KV blocks the other held.
    j = names.index("resumed", i)
    assert names[i + 1:j] and set(names[i + 1:j]) == {"waiting"} and names[j + 1] == "prefill_chunk"
    assert span.events[i + 1][2]["cadence.wait_reason"] in ("kv_blocks", "behind")
    times = [e[1] for e in span.events]
    assert times == sorted(times), names  # the span's events in the order they happened
    # The recompute starts over, from what the prefix cache still holds of its blocks, and computes
    # again at least what was lost.
    restart = span.events[j + 1][2]["cadence.start"]
    again = [e[2] for e in span.events[j + 1:] if e[0] == "prefill_chunk"]
    assert restart % 16 == 0 and restart + sum(c["cadence.tokens"] for c in again) >= preempted["cadence.tokens_lost"]
    chunks = [e[2] for e in span.events if e[0] == "prefill_chunk"]
    assert all(c["cadence.tokens"] <= 32 for c in chunks)  # the step's token budget
    assert [c["cadence.step"] for c in chunks] == sorted(c["cadence.step"] for c in chunks)
    live.app.state.tracer.shutdown()


def test_a_wait_behind_a_request_with_several_choices_names_that_request(receiver, server_factory):
    """One seat: `first`'s choice 0 runs, its choice 1 waits for the seat, and `second` waits behind
    that choice: its span names `first`'s id, the one a client can look up, not the engine's id
    of the choice."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    try:
        live = server_factory({"max_num_seqs": 1}, otlp_traces_endpoint=receiver.url)
    finally:
        mp.undo()
    body = {"prompt": "first", "max_tokens": 200, "n": 2, "stream": True,
            "stream_options": {"include_queue_status": True}, **NO_EOS}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as first:
        lines = first.iter_lines()
        assert next(lines).startswith(": queued")  # admitted: `second` comes after it
        second = httpx.post(live.url + "/v1/completions", json={"prompt": "second", "max_tokens": 1}, timeout=120)
        for _ in lines:
            pass
    first_id = first.headers["x-request-id"]
    span = receiver.sink.wait(second.json()["id"])
    behind = [e[2].get("cadence.waiting_behind") for e in span.events if e[0] == "waiting"]
    assert first_id in behind and not [b for b in behind if b and b.startswith(first_id + "-")], behind
    status = httpx.get(f"{live.url}/v1/requests/{first_id}", timeout=30)
    assert status.status_code == 200
    live.app.state.tracer.shutdown()


def test_a_client_traceparent_is_continued_streaming_too(traced, receiver):
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=abc"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, **NO_EOS}
    with httpx.stream("POST", traced.url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    request_id = json.loads(lines[0][6:])["id"]
    span = receiver.sink.wait(request_id)
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert span.trace_state == "vendor=abc"
    assert span.attributes["gen_ai.usage.completion_tokens"] == 3


def test_an_unsampled_caller_trace_is_not_exported(traced, receiver):
    """W3C: the caller decided not to sample (flags 00); the server's default sampler follows it."""
    headers = {"traceparent": f"00-{'1' * 32}-{PARENT_ID}-00"}
    off = httpx.post(traced.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers)
    on = httpx.post(traced.url + "/v1/completions", json={"prompt": "b", "max_tokens": 1})
    receiver.sink.wait(on.json()["id"])  # exported after `off` ended: `off` had its chance
    assert not [s for s in receiver.sink.spans if s.attributes["gen_ai.request.id"] == off.json()["id"]]


def test_a_request_ended_by_its_deadline_is_a_span_with_an_error_status(traced, receiver):
    r = httpx.post(traced.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "deadline": 1e-6, **NO_EOS})
    assert r.status_code == 408
    later = httpx.post(traced.url + "/v1/completions", json={"prompt": "z", "max_tokens": 1}).json()["id"]
    receiver.sink.wait(later)  # the refused request's span was queued before this one's
    bad = [s for s in receiver.sink.spans if s.attributes.get("error.type") == "deadline"]
    assert bad and bad[0].status_code == STATUS_ERROR
    assert bad[0].attributes["gen_ai.request.max_tokens"] == 50


def test_sample_ratio_zero_exports_nothing(receiver, server_factory):
    live = server_factory(otlp_traces_endpoint=receiver.url, otlp_traces_sample_ratio=0.0)
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "q", "max_tokens": 1})
    assert r.status_code == 200
    live.app.state.tracer.shutdown(timeout=10)  # everything queued is sent by now
    assert not [s for s in receiver.sink.spans if s.attributes["gen_ai.request.id"] == r.json()["id"]]


# -- a collector that is down or hangs -----------------------------------------------------------


def test_a_hanging_collector_costs_spans_never_serving_time(monkeypatch, server_factory):
    """The export worker is stuck on the first span; the next waits; the rest are dropped and counted."""
    hang = SilentListener()
    for k, v in {"OTEL_BSP_SCHEDULE_DELAY": "10", "OTEL_BSP_MAX_QUEUE_SIZE": "1",
                 "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "30"}.items():
        monkeypatch.setenv(k, v)
    live = server_factory(otlp_traces_endpoint=hang.url)
    try:
        for i in range(5):
            t0 = time.monotonic()
            r = httpx.post(live.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200
            assert time.monotonic() - t0 < 5.0, "a request waited on the collector"
        assert _dropped(live.url).get("queue_full", 0) >= 3
    finally:
        t0 = time.monotonic()
        live.app.state.tracer.shutdown(timeout=1.0)
        assert time.monotonic() - t0 < 2.0
        hang.stop()


def test_a_refused_connection_counts_failed_exports(monkeypatch, server_factory):
    refused = SilentListener()
    url = refused.url
    refused.stop()  # nothing listens on that port any more
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    live = server_factory(otlp_traces_endpoint=url)
    try:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200
        live.app.state.tracer.provider.force_flush()  # the export, its retries and its failure, now
        assert _dropped(live.url).get("export_failed", 0) >= 1
    finally:
        live.app.state.tracer.shutdown(timeout=1.0)


def test_a_request_whose_deadline_passes_while_it_waits_has_its_wait_in_its_span(receiver, server_factory):
    """One seat, held: the second request waits for it until its deadline passes (HTTP 408). Its span
    tells why it waited and how it ended, from the engine's own record of the request."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    try:
        live = server_factory({"max_num_seqs": 1}, otlp_traces_endpoint=receiver.url)
    finally:
        mp.undo()
    trace_id = "5" * 32
    body = {"prompt": "hold", "max_tokens": 300, "stream": True, "stream_options": {"include_queue_status": True},
            **NO_EOS}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as holder:
        lines = holder.iter_lines()
        assert next(lines).startswith(": queued")  # admitted: the next one waits behind it
        late = httpx.post(live.url + "/v1/completions", json={"prompt": "late", "max_tokens": 5, "deadline": 0.3},
                          headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01"}, timeout=60)
        for _ in lines:
            pass
    assert late.status_code == 408, late.text
    with receiver.sink.cond:
        receiver.sink.cond.wait_for(lambda: any(s.trace_id == trace_id for s in receiver.sink.spans), 30)
        span = next(s for s in receiver.sink.spans if s.trace_id == trace_id)
    assert span.status_code == STATUS_ERROR and span.attributes["error.type"] == "deadline"
    assert span.attributes["gen_ai.response.finish_reasons"] == ["deadline"]
    waits = [e[2]["cadence.wait_reason"] for e in span.events if e[0] == "waiting"]
    assert "max_num_seqs" in waits, span.events
    finished = [e[2] for e in span.events if e[0] == "finished"]
    assert finished and finished[0]["finish_reason"] == "deadline"
    live.app.state.tracer.shutdown()


def _traced_server(server_factory: Any, receiver: HttpReceiver, **engine_options: Any) -> Any:
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    try:
        return server_factory(engine_options, otlp_traces_endpoint=receiver.url)
    finally:
        mp.undo()


def test_a_stream_whose_client_leaves_after_a_few_tokens_has_its_story_in_its_span(receiver, server_factory):
    """The client reads three tokens and closes the connection: the engine aborts the request, and
    its span still says how it ran (scheduled, its prefill, its first token) and that it was aborted,
    with the latencies it had. A client leaving is not a server error: the status stays unset."""
    live = _traced_server(server_factory, receiver)
    body = {"prompt": "tell me a long story", "max_tokens": 1000, "stream": True, **NO_EOS}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert len(data) >= 3 and all("[DONE]" not in line for line in data)
    span = receiver.sink.wait(request_id)
    assert span.attributes["gen_ai.response.finish_reasons"] == ["abort"], span.attributes
    names = [e[0] for e in span.events]
    for name in ("queued", "scheduled", "prefill_chunk", "first_token", "finished"):
        assert name in names, names
    finished = next(e[2] for e in span.events if e[0] == "finished")
    assert finished["finish_reason"] == "abort" and finished["cadence.num_preemptions"] == 0
    for latency in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_decode"):
        assert span.attributes[f"gen_ai.latency.{latency}"] >= 0, latency
    assert span.status_code != STATUS_ERROR and "error.type" not in span.attributes
    assert live.wait_idle()
    live.app.state.tracer.shutdown()


def test_a_stream_whose_client_leaves_while_queued_has_its_wait_in_its_span(receiver, server_factory):
    """One seat, held by a long request: the second waits for it, and its client leaves before it is
    admitted. Its span says why it waited, and that it ended aborted, never scheduled."""
    live = _traced_server(server_factory, receiver, max_num_seqs=1)
    queued = {"stream": True, "stream_options": {"include_queue_status": True}, **NO_EOS}
    hold = {"prompt": "hold", "max_tokens": 1000, **queued}
    with httpx.stream("POST", live.url + "/v1/completions", json=hold, timeout=60) as holder:
        held = holder.iter_lines()
        assert next(held).startswith(": queued")  # admitted: the next one waits behind it
        with httpx.stream("POST", live.url + "/v1/completions", json={"prompt": "late", "max_tokens": 5, **queued},
                          timeout=60) as late:
            request_id = late.headers["x-request-id"]
            lines = late.iter_lines()
            assert "state=waiting" in next(lines)
        span = receiver.sink.wait(request_id)
        assert live.engine.num_in_flight == 1  # the holder still runs: the seat never came free
        next(held)
    assert span.attributes["gen_ai.response.finish_reasons"] == ["abort"], span.attributes
    names = [e[0] for e in span.events]
    assert "scheduled" not in names and "first_token" not in names, names
    waits = [e[2]["cadence.wait_reason"] for e in span.events if e[0] == "waiting"]
    assert "max_num_seqs" in waits, span.events
    finished = next(e[2] for e in span.events if e[0] == "finished")
    assert finished["finish_reason"] == "abort"
    assert span.attributes["gen_ai.latency.e2e"] > 0
    assert span.status_code != STATUS_ERROR and "error.type" not in span.attributes
    assert live.wait_idle()
    live.app.state.tracer.shutdown()
