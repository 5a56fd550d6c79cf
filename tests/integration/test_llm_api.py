"""The offline API on the tiny random model (real tokenizer, random weights): shape, errors, options."""

from __future__ import annotations

import json
import time

import pytest

from cadence import LLM, SamplingParams
from cadence.cli import main as cli_main


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny=True, max_num_seqs=8, num_kv_blocks=256)


def test_generate_shape_and_metrics(llm: LLM) -> None:
    outs = llm.generate(["Hello there", "A longer prompt about the sea and ships"],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", "A longer prompt about the sea and ships"]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert o.finished


def test_token_id_prompts_and_greedy_determinism(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Determinism is a virtue")
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = llm.generate([ids], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate("Determinism is a virtue", p, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_n_and_seed(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7, ignore_eos=True)
    first = llm.generate("Sample me", p, use_tqdm=False)[0]
    again = llm.generate(["Sample me", "Another one in the batch"], [p, p], use_tqdm=False)[0]
    assert len(first.outputs) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # seeds differ per choice


def test_stop_string_truncates_text(llm: LLM) -> None:
    base = llm.generate("Stop test", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    assert len(text) >= 4
    stop = text[2:4]
    out = llm.generate("Stop test", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]


def test_chat_applies_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out[0].prompt_token_ids == expected


def test_bad_options_and_inputs() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny=True, max_num_seq=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(tiny=True, max_num_seqs=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


def test_bad_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("x", SamplingParams(max_tokens=llm.engine.max_model_len + 1), use_tqdm=False)
    # The engine is unharmed and holds nothing.
    assert not llm.engine.core.has_unfinished_requests()
    assert llm.generate("still fine", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_cli_generate_jsonl(tmp_path, capsys) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "one", "max_tokens": 3, "ignore_eos": True}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "two"}], "max_tokens": 2, "ignore_eos": True}) + "\n")
    dst = tmp_path / "out.jsonl"
    assert cli_main(["generate", "--tiny", "--input", str(src), "--output", str(dst), "--num-kv-blocks", "64"]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [3, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert cli_main(["generate", "--tiny", "--input", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("prompts", "error", "says"),
    [
        (None, TypeError, r"prompts: expected"),  # was "'NoneType' object is not iterable"
        (5, TypeError, r"prompts: expected"),
        (["fine", None], TypeError, r"prompts\[1\]: expected"),
        ([[1.5, 2]], TypeError, r"prompts\[0\]: expected"),  # floats were run as token ids
        ([["a", "b"]], TypeError, r"prompts\[0\]: expected"),
        ([[True, 5]], TypeError, r"prompt: token ids must be integers"),
        ([{"text": "hi"}], TypeError, r"prompts\[0\]: expected .*keys \['text'\]"),
        ([[5, -1]], ValueError, r"prompt: token id -1 is outside the vocabulary"),
        (["fine", "word " * 3000], ValueError, r"prompts\[1\]: .* exceed max_model_len"),
    ],
)
def test_bad_prompts_name_the_prompt(llm: LLM, prompts, error, says) -> None:
    with pytest.raises(error, match=says):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.core.has_unfinished_requests()


def test_bad_batch_arguments_and_vllm_prompt_dicts(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(TypeError, match=r"sampling_params\[0\]: expected SamplingParams, got dict"):
        llm.generate(["a"], [{"max_tokens": 3}], use_tqdm=False)  # was an AttributeError
    with pytest.raises(TypeError, match="sampling_params: expected SamplingParams"):
        llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(ValueError, match="priority: 1 given for 2 prompts"):
        llm.generate(["a", "b"], sp, priority=[1], use_tqdm=False)  # was an IndexError
    with pytest.raises(TypeError, match=r"tenant\[0\]: must be a non-empty string"):
        llm.generate(["a"], sp, tenant=[5], use_tqdm=False)
    for field in ("stop_token_ids", "logit_bias"):  # the server refuses these; the offline API ran them
        bad = SamplingParams(max_tokens=2, **{field: [10**9] if field == "stop_token_ids" else {10**9: 1.0}})
        with pytest.raises(ValueError, match=f"{field}: token id 1000000000 is outside the vocabulary"):
            llm.generate("a", bad, use_tqdm=False)
    # {"prompt": ...} was iterated as a dict: its key "prompt" was generated for.
    text, ids = llm.generate([{"prompt": "hi"}, {"prompt_token_ids": [5, 6]}], sp, use_tqdm=False)
    assert text.prompt == "hi" and ids.prompt_token_ids == [5, 6]
    assert len(llm.generate((p for p in ["a", "b"]), sp, use_tqdm=False)) == 2  # any iterable, as before
    assert not llm.engine.core.has_unfinished_requests()


def test_admission_limits_are_checked_before_any_work() -> None:
    # max_queue_len=1 feeds one request at a time: a refusal of the third used to come after the
    # first two had run, and their outputs were lost with the error.
    small = LLM(tiny=True, num_kv_blocks=4, block_size=16, max_queue_len=1, max_queued_tokens=8)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core, steps = small.engine.core, []
    step = core.step
    core.step = lambda *a, **k: steps.append(1) or step(*a, **k)
    with pytest.raises(ValueError, match=r"prompts\[2\]: .* exceeds the KV cache capacity \(64 tokens\)"):
        small.generate(["a", "b", "c"], [sp, sp, SamplingParams(max_tokens=70)], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]: 9 prompt tokens exceed max_queued_tokens \(8\)"):
        small.generate([[1, 2], list(range(1, 10))], sp, use_tqdm=False)  # was "the waiting queue is full"
    assert steps == []  # refused before any step ran
    assert not small.engine.core.has_unfinished_requests()
    assert [len(o.outputs[0].token_ids) for o in small.generate(["a", "b"], sp, use_tqdm=False)] == [4, 4]


@pytest.mark.parametrize(
    ("messages", "error", "says"),
    [
        ({"role": "user", "content": "hi"}, TypeError, "got a single dict"),  # was KeyError: 0
        ("hello", TypeError, "messages: expected"),
        ([{"content": "hi"}], ValueError, r"messages\[0\]\.role"),
        ([{"role": "wizard", "content": "hi"}], ValueError, r"messages\[0\]\.role: must be one of"),  # was accepted
        ([{"role": "user", "content": None}], ValueError, r"messages\[0\]\.content"),
        # the second conversation's error was reported as messages[0]
        ([[{"role": "user", "content": "hi"}], [{"role": "user"}]], ValueError, r"messages\[1\]\[0\]\.content: missing"),
    ],
)
def test_bad_chat_messages_name_the_message(llm: LLM, messages, error, says) -> None:
    with pytest.raises(error, match=says):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.core.has_unfinished_requests()


def test_cli_generate_answers_every_line_and_fails_on_bad_ones(tmp_path, capsys) -> None:
    good = json.dumps({"prompt": "one", "max_tokens": 2, "ignore_eos": True})
    lines = [
        good,
        "{not json",
        "",  # blank lines are skipped, but counted in line numbers
        json.dumps({"prompt": "x", "max_tokens": 0}),
        json.dumps({"max_tokens": 2}),
        json.dumps({"prompt": "x", "stop": 5}),
        json.dumps({"messages": [], "max_tokens": 2}),  # was a KeyError traceback
        json.dumps({"prompt": "x", "n": 2}),  # n-1 completions were dropped
        json.dumps({"prompt": "word " * 3000, "max_tokens": 2}),
        json.dumps({"id": "last", "messages": [{"role": "user", "content": "two"}], "max_tokens": 2, "ignore_eos": True}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    assert cli_main(["generate", "--tiny", "--input", str(src), "--output", str(dst), "--num-kv-blocks", "64"]) == 2
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7, "last"]  # one row per request, in order
    assert len(rows[0]["token_ids"]) == 2 and len(rows[-1]["token_ids"]) == 2  # good lines still run
    errors = {r["id"]: r["error"] for r in rows if "error" in r}
    assert errors[1].startswith(f"{src}:2: not JSON")
    assert errors[2] == f"{src}:4: max_tokens: must be an integer >= 1"
    assert errors[3] == f"{src}:5: give exactly one of 'prompt' or 'messages'"
    assert errors[4].startswith(f"{src}:6: stop: must be a string")
    assert errors[5].startswith(f"{src}:7: messages: must be a non-empty list")
    assert errors[6].startswith(f"{src}:8: n: ")
    assert errors[7].startswith(f"{src}:9: prompt: ") and "max_model_len" in errors[7]
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{src}:4: max_tokens" in err and "7 of 9 requests refused" in err


def test_cli_generate_runs_a_file_as_one_batch_with_the_outputs_of_each_alone(tmp_path, monkeypatch) -> None:
    """The accepted lines go to the engine together (continuous batching, not one request at a
    time), and each line's greedy output is what it gets alone."""
    prompts = ["one", "two three", "four five six", "seven"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 3 + i, "temperature": 0.0,
                                       "ignore_eos": True}) + "\n" for i, p in enumerate(prompts))
                   + json.dumps({"prompt": "x", "max_tokens": 0}) + "\n")
    calls: list[int] = []
    real = LLM.generate

    def counting(self, prompts, *args, **kw):
        calls.append(len(prompts))
        return real(self, prompts, *args, **kw)

    monkeypatch.setattr(LLM, "generate", counting)
    dst = tmp_path / "out.jsonl"
    assert cli_main(["generate", "--tiny", "--input", str(src), "--output", str(dst), "--num-kv-blocks", "64"]) == 2
    assert calls == [4]  # one batch of the four good lines; the bad one refused beside them
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3", 4] and "error" in rows[-1]
    monkeypatch.setattr(LLM, "generate", real)
    alone = LLM(tiny=True, num_kv_blocks=64)
    for i, p in enumerate(prompts):
        out = alone.generate(p, SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        assert rows[i]["token_ids"] == out.outputs[0].token_ids


def test_cli_generate_refuses_an_empty_or_missing_file(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert cli_main(["generate", "--tiny", "--input", str(empty)]) == 2  # was exit 0, no output
    assert "no requests" in capsys.readouterr().err
    assert cli_main(["generate", "--tiny", "--input", str(tmp_path / "nope.jsonl")]) == 2
    assert "--input" in capsys.readouterr().err
    assert cli_main(["generate", "--tiny", "--prompt", "hi", "--output", str(tmp_path / "no" / "dir.jsonl")]) == 2
    assert "its directory does not exist" in capsys.readouterr().err


def test_a_stop_string_finish_keeps_its_metrics(llm: LLM) -> None:
    """A stop string ends the request outside the core (in the detokenized text); its output still
    carries the request's metrics (they came only with the core's own final delta)."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    m = out.metrics
    assert m is not None and m.queue_time is not None and m.ttft is not None and m.e2e_latency is not None


def test_metrics_give_monotonic_and_unix_arrival_times(llm: LLM) -> None:
    wall0, mono0 = time.time(), time.monotonic()
    m = llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].metrics
    wall1, mono1 = time.time(), time.monotonic()
    assert mono0 <= m.arrival_time <= mono1  # the engine's monotonic clock
    assert m.arrival_unix_time is not None and wall0 - 0.01 <= m.arrival_unix_time <= wall1 + 0.01  # vLLM's reading
    assert m.unix_time(m.finished_time) - m.arrival_unix_time == pytest.approx(m.e2e_latency, abs=1e-5)
