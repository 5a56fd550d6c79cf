"""vLLM's request fields mean what they mean there: `add_special_tokens` adds a Llama tokenizer's
BOS to a raw prompt (on by default on /v1/completions and offline, off on chat, as in vLLM), checked
against transformers on the same tokenizer; a vLLM field cadence does not implement is refused when
it asks for anything but its default, never silently ignored."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cadence import LLM, SamplingParams
from cadence.config import EngineConfig, ServerConfig
from cadence.engine.async_engine import AsyncEngine
from cadence.engine.builder import build_engine
from cadence.server.app import create_app
from cadence.server.protocol import UNSUPPORTED_VLLM_FIELDS

TINY = {"num_kv_blocks": 64, "max_model_len": 64, "max_num_seqs": 4, "device": "cpu", "dtype": "float32"}
TEXT = "the cat sat on the mat"
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-style tokenizer (a BPE whose post-processor puts <s> before every text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 20, "user assistant system: hello world"], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder = tmp_path_factory.mktemp("bos-model")
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def hf(bos_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bos_model_dir)


@pytest.fixture(scope="module")
def client(bos_model_dir: Path) -> Iterator[TestClient]:
    engine = AsyncEngine(build_engine(EngineConfig.from_options(model=str(bos_model_dir), **TINY), tiny=True))
    try:
        with TestClient(create_app(engine, ServerConfig()), raise_server_exceptions=False) as c:
            yield c
    finally:
        engine.shutdown(timeout=10)


def _prompt_tokens(client: TestClient, path: str, body: dict[str, Any]) -> int:
    r = client.post(path, json={"max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def test_completion_prompt_gets_the_bos_by_default(client: TestClient, hf: Any) -> None:
    with_bos, without = hf(TEXT)["input_ids"], hf(TEXT, add_special_tokens=False)["input_ids"]
    assert with_bos == [0, *without]  # the reference: transformers adds the BOS
    assert _prompt_tokens(client, "/v1/completions", {"prompt": TEXT}) == len(with_bos)
    assert _prompt_tokens(client, "/v1/completions", {"prompt": TEXT, "add_special_tokens": False}) == len(without)
    assert client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"] == with_bos
    r = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False})
    assert r.json()["tokens"] == without
    # Token ids are the caller's: nothing is added to them.
    assert _prompt_tokens(client, "/v1/completions", {"prompt": without}) == len(without)


def test_chat_leaves_the_bos_to_the_template(client: TestClient, hf: Any) -> None:
    messages = [{"role": "user", "content": "hello"}]
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    want = list(want["input_ids"] if isinstance(want, Mapping) else want)
    assert want[0] == 0 and want.count(0) == 1  # the template wrote the one BOS
    assert client.post("/tokenize", json={"messages": messages}).json()["tokens"] == want
    assert _prompt_tokens(client, "/v1/chat/completions", {"messages": messages}) == len(want)
    # Asked for, the tokenizer's BOS comes on top of the template's (what vLLM does too).
    body = {"messages": messages, "add_special_tokens": True}
    assert _prompt_tokens(client, "/v1/chat/completions", body) == len(want) + 1
    assert client.post("/tokenize", json=body).json()["tokens"] == [0, *want]


def test_offline_generate_adds_the_bos_as_vllm_does(bos_model_dir: Path, hf: Any) -> None:
    llm = LLM(model=str(bos_model_dir), tiny=True, **TINY)
    p = SamplingParams(temperature=0, max_tokens=1)
    out = llm.generate(TEXT, p, use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == hf(TEXT)["input_ids"]
    out = llm.generate(TEXT, p, use_tqdm=False, add_special_tokens=False)[0]
    assert list(out.prompt_token_ids) == hf(TEXT, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(("field", "value"), [
    ("use_beam_search", True),
    ("prompt_logprobs", 1),
    ("truncate_prompt_tokens", 8),
    ("cache_salt", "tenant-a"),
    ("length_penalty", 0.5),
    ("spaces_between_special_tokens", False),
    ("continue_final_message", True),
    ("return_tokens_as_token_ids", 1),  # not False, though it equals it
])
def test_unimplemented_vllm_fields_are_refused(client: TestClient, field: str, value: Any) -> None:
    for path, body in (("/v1/completions", {"prompt": TEXT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={**body, "max_tokens": 1, field: value})
        assert r.status_code == 400, (path, r.text)
        assert field in r.json()["error"]["message"] and "not supported" in r.json()["error"]["message"]


def test_vllm_fields_at_their_defaults_pass(client: TestClient) -> None:
    # A client that sends every field with its default value (as some SDK wrappers do) is served.
    defaults = {name: values[-1] for name, values in UNSUPPORTED_VLLM_FIELDS.items()}
    r = client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1, **defaults})
    assert r.status_code == 200, r.text
