"""Speculative decoding served: `--speculative-config`, the per-request `speculative` field, the
same text with and without drafts (whole and streamed), and the counters on /metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from test_metrics import samples

from cadence.cli import build_parser, serve_configs
from cadence.config import SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
BODY = {"prompt": "apple banana cherry apple banana cherry apple banana", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}


def test_the_serve_flag_takes_vllm_json() -> None:
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    assert serve_configs(args)[0].speculative_config == SpeculativeConfig("ngram", 4, 1, 3)
    bad = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens: required"):
        serve_configs(bad)


@pytest.fixture(scope="module")
def spec_server(server_factory):
    return server_factory({"speculative_config": SPEC})


def _drafts(url: str) -> tuple[float, float]:
    s = samples(httpx.get(url + "/metrics").text)
    return (s.get(("cadence:spec_decode_num_draft_tokens_total", ()), 0.0),
            s.get(("cadence:spec_decode_num_accepted_tokens_total", ()), 0.0))


def test_same_text_with_drafts_without_and_streamed(spec_server) -> None:
    url = spec_server.url
    before = _drafts(url)
    with_drafts = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()
    middle = _drafts(url)
    assert middle[1] > before[1], "no draft was accepted: the test would not exercise verification"
    opted_out = httpx.post(url + "/v1/completions", json={**BODY, "speculative": False}, timeout=60).json()
    assert _drafts(url) == middle  # the opted-out request verified no draft
    assert with_drafts["choices"][0]["text"] == opted_out["choices"][0]["text"]
    assert with_drafts["usage"]["completion_tokens"] == opted_out["usage"]["completion_tokens"] == 40
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == with_drafts["choices"][0]["text"]


def test_a_speculative_field_that_is_not_a_boolean_is_refused(spec_server) -> None:
    r = httpx.post(spec_server.url + "/v1/completions", json={**BODY, "speculative": "no"}, timeout=60)
    assert r.status_code == 400
    assert "speculative" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def draft_server(server_factory, tmp_path_factory):
    """The tiny served model with its own first layer as the draft model."""
    from cadence.engine.builder import random_weights, tiny_arch
    from cadence.model.make_draft import write_draft
    from cadence.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(None)
    arch = tiny_arch(tokenizer.vocab_size)
    draft = write_draft(arch, random_weights(arch, seed=0), 1, tmp_path_factory.mktemp("draft") / "d", tokenizer)
    return server_factory({"speculative_config": {"method": "draft_model", "model": str(draft),
                                                  "num_speculative_tokens": 4, "adaptive": False}})


def test_a_draft_model_served_same_text_counted_and_opted_out(draft_server) -> None:
    url = draft_server.url
    before = _drafts(url)
    with_drafts = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()
    middle = _drafts(url)
    assert middle[0] > middle[1] > before[1], "drafts were verified, some accepted, some not"
    opted_out = httpx.post(url + "/v1/completions", json={**BODY, "speculative": False}, timeout=60).json()
    assert _drafts(url) == middle  # the opted-out request verified no draft
    assert with_drafts["choices"][0]["text"] == opted_out["choices"][0]["text"]
    assert with_drafts["usage"]["completion_tokens"] == opted_out["usage"]["completion_tokens"] == 40
