"""Prompt text of an exact token size, shared prefixes, and the server-tokenizer shapes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from cadence.bench.prompts import CORPUS, LocalTokenizer, PromptBuilder, ServerTokenizer
from cadence.workload import Workload, WorkloadRequest, builtin_workload


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


# ----- shared blocks token-exact at block boundaries -----

def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory) -> LocalTokenizer:
    """The default model's tokenizer (SmolLM2, from its GGUF), read the way `cadence bench --tokenizer` reads one."""
    from cadence.model.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("smollm2") / "tokenizer.json"
    Tokenizer.from_model_path(None).save_json(path)
    return LocalTokenizer(path)


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory) -> LocalTokenizer:
    """A Llama-2-style SentencePiece BPE with a BOS: "▁" before the text and for every space, so
    " word" alone is one token more than after another word."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    # The builder finds the BOS as what "Hello there." and "Goodbye now." open with: those words must
    # be in the vocabulary, or both would open with the same lone "▁" too.
    tok.train_from_iterator([CORPUS, "Hello there. Goodbye now."],
                            trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path_factory.mktemp("meta") / "tokenizer.json"
    tok.save(str(path))
    return LocalTokenizer(path)


@pytest.mark.parametrize("which", ["smollm2_tokenizer", "local_tokenizer"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 100])
def test_shared_prefix_workload_shares_every_block(which: str, seed: int, request: pytest.FixtureRequest) -> None:
    """Every request of the built-in shared-prefix workload holds the whole 16 x 64-token system
    prompt token for token (BOS counted), as the simulator assumes, and is still exactly sized."""
    tok: LocalTokenizer = request.getfixturevalue(which)
    w = builtin_workload("shared-prefix", 12, seed)
    builder = PromptBuilder(tok, seed)
    ids = [tok.encode(t) for t in builder.build_all(w)]
    shared = len(w.requests[0].prefix_group) * w.prefix_block_tokens
    assert shared == 1024 and all(r.prefix_group == w.requests[0].prefix_group for r in w.requests)
    assert min(_common(ids[0], x) for x in ids[1:]) >= shared
    assert [len(x) for x in ids] == [r.prompt_tokens for r in w.requests]
    assert builder.inexact == []


def _mooncake_requests(block: int) -> tuple[list[WorkloadRequest], list[list[int]]]:
    """Pairs of requests sharing exactly 1, 2 and 3 leading hash ids (then different ids), and
    which pairs share how many."""
    reqs = [
        WorkloadRequest(prompt_tokens=5 * block + 9, output_tokens=1, prefix_group=(11, 12, 13, 14, 15)),
        WorkloadRequest(prompt_tokens=4 * block + 30, output_tokens=1, prefix_group=(11, 22, 23, 24)),
        WorkloadRequest(prompt_tokens=4 * block + 1, output_tokens=1, prefix_group=(11, 12, 33, 34)),
        WorkloadRequest(prompt_tokens=5 * block, output_tokens=1, prefix_group=(11, 12, 13, 44, 45)),
        WorkloadRequest(prompt_tokens=3 * block + 7, output_tokens=1, prefix_group=(11, 12, 13)),
    ]
    shared = [[len(reqs[i].prefix_group)] * len(reqs) for i in range(len(reqs))]
    for i, a in enumerate(reqs):
        for j, b in enumerate(reqs):
            if i != j:
                shared[i][j] = _common(list(a.prefix_group), list(b.prefix_group))
    return reqs, shared


@pytest.mark.parametrize("whole", [False, True], ids=["by-word", "whole-text"])
@pytest.mark.parametrize("which", ["smollm2_tokenizer", "local_tokenizer", "metaspace_tokenizer"])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_trace_requests_share_exactly_their_common_blocks(which: str, block: int, whole: bool,
                                                           request: pytest.FixtureRequest) -> None:
    """Requests sharing k leading ids share at least k whole blocks of tokens, and not the next,
    with blocks sized from per-word counts or (a tokenizer whose counts do not add up) whole texts."""
    tok: LocalTokenizer = request.getfixturevalue(which)
    reqs, shared = _mooncake_requests(block)
    for seed in range(4):
        builder = PromptBuilder(tok, seed)
        builder.count_tokens("")  # calibrates: these tokenizers' counts add up word by word
        assert builder._additive
        builder._additive = not whole
        ids = [tok.encode(t) for t in builder.build_all(Workload("t", tuple(reqs), prefix_block_tokens=block))]
        assert [len(x) for x in ids] == [r.prompt_tokens for r in reqs]
        assert builder.inexact == []
        for i in range(len(reqs)):
            for j in range(i + 1, len(reqs)):
                k = shared[i][j]
                common = _common(ids[i], ids[j])
                assert k * block <= common < (k + 1) * block, (seed, i, j, k, common)


def test_block_text_ends_at_a_word_and_keeps_its_tokens(smollm2_tokenizer: LocalTokenizer) -> None:
    """The real tokenizer does not merge across a block's end: the tokens of the first blocks are a
    prefix of the tokens of any longer text that goes on from them."""
    block = 64
    builder = PromptBuilder(smollm2_tokenizer, 2)
    builder.count_tokens("")  # calibrate
    chain = tuple(range(16))
    counts = builder._block_word_counts(chain, block)
    text = builder._draft(WorkloadRequest(prompt_tokens=2000, output_tokens=1, prefix_group=chain), 0, counts, 50)
    full = smollm2_tokenizer.encode(text)
    for i in range(1, len(chain) + 1):
        head = " ".join(text.split()[: sum(counts[:i])])
        head_ids = smollm2_tokenizer.encode(head)
        assert full[: len(head_ids)] == head_ids
        assert i * block <= len(head_ids) < i * block + 8  # reached, with as few words as that needs
        fewer = smollm2_tokenizer.encode(" ".join(head.split()[:-1]))
        assert len(fewer) < i * block
