"""The offline API on the tiny random model (real tokenizer, random weights): shape, errors, options."""

from __future__ import annotations

import json

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
