"""Prompt text of an exact token size, shared prefixes, and the server-tokenizer shapes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from cadence.bench.prompts import CORPUS, LocalTokenizer, PromptBuilder, ServerTokenizer
from cadence.workload import Workload, WorkloadRequest


@pytest.fixture(scope="module")
def local_tokenizer(tmp_path_factory) -> LocalTokenizer:
    """A small byte-level BPE trained on the corpus, adding a BOS like Llama tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return LocalTokenizer(path.parent)


def test_exact_sizes_with_a_local_tokenizer(local_tokenizer: LocalTokenizer) -> None:
    sizes = [2, 3, 17, 64, 255, 1000]
    w = Workload("t", tuple(WorkloadRequest(prompt_tokens=n, output_tokens=1) for n in sizes))
    builder = PromptBuilder(local_tokenizer, seed=5)
    texts = builder.build_all(w)
    assert [len(local_tokenizer.encode(t)) for t in texts] == sizes  # BOS included in the count
    assert builder.inexact == []
    assert "exact token counts" in builder.method
    assert len(set(texts)) == len(texts)
    assert all(t.split()[0].lower() in CORPUS.lower() for t in texts)  # real corpus words, not filler
    assert builder.count_tokens(texts[2]) == 16  # without the BOS


def test_shared_prefix_ids_share_text(local_tokenizer: LocalTokenizer) -> None:
    reqs = (
        WorkloadRequest(prompt_tokens=120, output_tokens=1, prefix_group=(7, 8, 9)),
        WorkloadRequest(prompt_tokens=140, output_tokens=1, prefix_group=(7, 8, 4)),
        WorkloadRequest(prompt_tokens=120, output_tokens=1, prefix_group=(1, 2, 3)),
    )
    texts = PromptBuilder(local_tokenizer, seed=0).build_all(Workload("t", reqs, prefix_block_tokens=32))
    ids = [local_tokenizer.encode(t) for t in texts]

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    # Two shared blocks of ~32 tokens (+ BOS); at most a token lost where the texts diverge.
    assert 55 <= common(ids[0], ids[1]) < 100
    assert common(ids[0], ids[2]) <= 2  # BOS, maybe a common first word
    again = PromptBuilder(local_tokenizer, seed=0).build_all(Workload("t", reqs, prefix_block_tokens=32))
    assert again == texts
    other_seed = PromptBuilder(local_tokenizer, seed=1).build_all(Workload("t", reqs, prefix_block_tokens=32))
    assert other_seed != texts


def test_requests_without_prefix_ids_share_no_leading_block(local_tokenizer: LocalTokenizer) -> None:
    """Own text opens differently for every request: no accidental prefix-cache hits."""
    w = Workload("t", tuple(WorkloadRequest(prompt_tokens=40, output_tokens=1) for _ in range(300)))
    texts = PromptBuilder(local_tokenizer, seed=3).build_all(w)
    heads = {tuple(local_tokenizer.encode(t)[:9]) for t in texts}  # BOS + 8 tokens
    assert len(heads) == 300
    assert all(len(local_tokenizer.encode(t)) == 40 for t in texts)


def test_estimate_without_a_tokenizer_says_so() -> None:
    w = Workload("t", (WorkloadRequest(prompt_tokens=100, output_tokens=1),
                       WorkloadRequest(prompt_tokens=5, output_tokens=1, prompt="given text")))
    builder = PromptBuilder(None)
    text, given = builder.build_all(w)
    assert 360 <= len(text) <= 400  # cut at a word boundary below 100 * 4 characters
    assert given == "given text"
    assert "estimate" in builder.method and "approximate" in builder.method
    assert builder.count_tokens("anything") is None


def test_messages_requests_get_no_generated_text() -> None:
    w = Workload("t", (WorkloadRequest(prompt_tokens=3, output_tokens=1, messages=(("user", "hi"),)),))
    assert PromptBuilder(None).build_all(w) == [None]


def _llama_cpp_transport(seen: list[dict]) -> httpx.MockTransport:
    """llama.cpp's shapes: {"content"} in and out; a cadence-shaped body is refused."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/tokenize":
            if "content" not in body:
                return httpx.Response(422, json={"error": "content required"})
            return httpx.Response(200, json={"tokens": [ord(c) for c in body["content"]]})
        return httpx.Response(200, json={"content": "".join(chr(t) for t in body["tokens"])})

    return httpx.MockTransport(handler)


def test_server_tokenizer_falls_back_to_llama_cpp_shape() -> None:
    seen: list[dict] = []
    tok = ServerTokenizer.probe("http://fake", transport=_llama_cpp_transport(seen))
    assert tok is not None
    assert tok.encode("abc") == [97, 98, 99] and tok.decode([104, 105]) == "hi"
    assert {"prompt"} <= set(seen[0]) and "content" in seen[1]


def test_probe_returns_none_without_endpoints() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(404, json={"detail": "Not Found"}))
    assert ServerTokenizer.probe("http://fake", transport=transport) is None


def test_local_tokenizer_needs_a_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        LocalTokenizer(tmp_path)
