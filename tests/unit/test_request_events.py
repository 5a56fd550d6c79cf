"""The engine's per-request events for traces (engine/events.py), on the fake executor: prefill
chunks with their step and size, preemptions with their reason and the tokens lost, resumes; and
nothing at all unless asked for."""

from __future__ import annotations

from fakes import make_engine, make_request


def _names(events) -> list[str]:
    return [e.name for e in events]


def test_off_by_default_nothing_is_recorded() -> None:
    engine, _, _ = make_engine()
    assert engine.events is None and engine.scheduler.on_preempt is None
    engine.add_request(make_request(prompt_len=10, max_tokens=2))
    engine.step()
    assert engine.events is None


def test_chunks_a_forced_preemption_and_the_resume_are_recorded_in_order() -> None:
    engine, _, clock = make_engine(max_num_batched_tokens=8, block_size=4)
    events = engine.record_request_events()
    req = make_request(prompt_len=20, max_tokens=5)
    untracked = make_request(prompt_len=4, max_tokens=5)
    engine.add_request(req)
    engine.add_request(untracked)
    events.track(req.request_id)
    for _ in range(4):  # 20 prompt tokens, 8 a step: chunks of 8, 8, 4, then its first decode
        engine.step()
    assert req.first_token_time is not None
    lost = req.num_computed_tokens
    assert engine.scheduler.force_preempt(req.request_id)
    while not req.is_finished:
        engine.step()
    got = events.pop(req.request_id)
    assert _names(got)[:3] == ["prefill_chunk"] * 3
    assert [dict(e.attributes)["cadence.tokens"] for e in got[:3]] == [8, 8, 4]
    assert [dict(e.attributes)["cadence.start"] for e in got[:3]] == [0, 8, 16]
    assert [dict(e.attributes)["cadence.last_chunk"] for e in got[:3]] == [False, False, True]
    i = _names(got).index("preempted")
    assert dict(got[i].attributes) == {"cadence.reason": "forced", "cadence.tokens_lost": lost}
    assert _names(got)[i + 1:i + 3] == ["resumed", "prefill_chunk"]
    assert [e.time for e in got] == sorted(e.time for e in got)
    assert events.pop(untracked.request_id) == () and len(events) == 0


def _waits(events) -> list[dict]:
    return [dict(e.attributes) for e in events if e.name == "waiting"]


def test_why_a_request_waited_is_recorded_before_its_first_chunk() -> None:
    # One seat: `first` runs; `second` is the request the scheduler stops at (max_num_seqs); `third`
    # waits behind it, then stops the scheduler itself once `second` is in.
    engine, _, _ = make_engine(max_num_seqs=1)
    events = engine.record_request_events()
    first, second, third = (make_request(prompt_len=4, max_tokens=3) for _ in range(3))
    for r in (first, second, third):
        engine.add_request(r)
        events.track(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert _waits(events.pop(first.request_id)) == []
    got = events.pop(second.request_id)
    assert _names(got)[:2] == ["waiting", "prefill_chunk"]
    assert _waits(got) == [{"cadence.wait_reason": "max_num_seqs", "cadence.step": 1}]
    got = events.pop(third.request_id)
    assert _names(got)[:3] == ["waiting", "waiting", "prefill_chunk"]
    assert _waits(got) == [
        {"cadence.wait_reason": "behind", "cadence.waiting_behind": second.request_id,
         "cadence.behind_reason": "max_num_seqs", "cadence.step": 1},
        {"cadence.wait_reason": "max_num_seqs", "cadence.step": 4},
    ]
    assert [e.time for e in got] == sorted(e.time for e in got)


def test_a_preempted_request_records_why_it_waited_before_resuming() -> None:
    # One seat, the priority policy: an urgent arrival takes the seat; the preempted request then
    # waits for the seat (the scheduler stops at it) until the urgent one is done.
    engine, _, _ = make_engine(max_num_seqs=1, policy="priority")
    events = engine.record_request_events()
    req, urgent = make_request(prompt_len=4, max_tokens=4), make_request(prompt_len=4, max_tokens=3, priority=-1)
    engine.add_request(req)
    events.track(req.request_id)
    engine.step()
    engine.add_request(urgent)
    while engine.has_unfinished_requests():
        engine.step()
    got = events.pop(req.request_id)
    i = _names(got).index("preempted")
    assert dict(got[i].attributes)["cadence.reason"] == "max_num_seqs"
    assert _names(got)[i:i + 3] == ["preempted", "waiting", "resumed"]
    assert _waits(got) == [{"cadence.wait_reason": "max_num_seqs", "cadence.step": 2}]
    # Its prompt's block is in the prefix cache: the resume recomputes one token, still a resume.
    assert dict(got[i + 3].attributes)["cadence.tokens"] == 1 and got[i + 3].name == "prefill_chunk"
    assert [e.time for e in got] == sorted(e.time for e in got)


def test_a_wait_behind_a_moving_head_is_one_event_per_change_of_reason() -> None:
    # One seat and a line of eight: the last waits behind each in turn, all held by the seat. Its
    # trace says so once (naming the first it waited behind), not once per request ahead, which a
    # long queue would turn into more events than a request keeps.
    engine, _, _ = make_engine(max_num_seqs=1)
    events = engine.record_request_events()
    line = [make_request(prompt_len=4, max_tokens=2) for _ in range(8)]
    for r in line:
        engine.add_request(r)
        events.track(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert _waits(events.pop(line[-1].request_id)) == [
        {"cadence.wait_reason": "behind", "cadence.waiting_behind": line[1].request_id,
         "cadence.behind_reason": "max_num_seqs", "cadence.step": 1},
        {"cadence.wait_reason": "max_num_seqs", "cadence.step": 13},
    ]


def test_a_verification_row_beside_a_prefill_is_no_prefill_chunk() -> None:
    from cadence.request import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine, executor, _ = make_engine(max_num_batched_tokens=8, block_size=4, speculative_config=spec)
    events = engine.record_request_events()
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    req = make_request(prompt=[5, 6, 7, 5, 6, 7, 5, 6], params=greedy, rid="v")
    executor.script["v"] = [7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    engine.add_request(req)
    events.track("v")
    engine.step()  # its whole prompt
    engine.add_request(make_request(prompt_len=30, max_tokens=2))  # a long prefill shares the next steps
    while not req.is_finished:
        engine.step()
    rows = [sr for out in executor.outputs for sr in out.scheduled if sr.request_id == "v" and sr.num_draft_tokens]
    assert rows, "the request was meant to speculate beside the prefill"
    assert _names(events.pop("v")) == ["prefill_chunk"]


def test_a_request_that_ends_while_it_waits_records_why_it_waited() -> None:
    # One seat, held: `second` waits (max_num_seqs) until it is aborted, never admitted.
    engine, _, _ = make_engine(max_num_seqs=1)
    events = engine.record_request_events()
    first, second = make_request(prompt_len=4, max_tokens=10), make_request(prompt_len=4, max_tokens=3)
    for r in (first, second):
        engine.add_request(r)
        events.track(r.request_id)
    for _ in range(3):
        engine.step()
    engine.abort_requests([second.request_id])
    assert _waits(events.pop(second.request_id)) == [{"cadence.wait_reason": "max_num_seqs", "cadence.step": 1}]
    assert engine.scheduler.on_end_waiting == events.ended_waiting
