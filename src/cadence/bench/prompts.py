"""Real-text prompts of an exact size in tokens, as the served model's tokenizer counts them.

A benchmark that sends "hello hello hello" measures a different model than the one users run:
repeated tokens compress, attention patterns differ, and sizes drift. So prompts are made of real
English sentences (the corpus below, written for cadence), drawn in a seeded order, and cut to
exactly N tokens with a tokenizer: the server's own (/tokenize and /detokenize, cadence, vLLM or
llama.cpp shapes), a local `tokenizers` file (--tokenizer PATH), or, for servers with neither, an
estimate of 4 characters per token (reported, because sizes are then approximate).

Requests with equal leading `prefix_group` ids get equal leading text: the text of block i of a
chain depends only on the seed and the ids of blocks 0..i, so a Mooncake trace's shared prefixes
stay shared. With a tokenizer the shared text is token-exact at block boundaries: the first i+1
blocks (special tokens such as BOS counted, since a cached block covers positions from 0) come to
at least (i+1) * block_tokens tokens with as few words as that needs, and every block ends at a
word boundary, which byte-level BPE does not merge across, so a cache that holds whole blocks
holds every block the workload shares (a block of only about the right size loses the last one
whenever the text falls a token short). Nothing
else is shared: each request's own text opens with three corpus words that spell its index (a
different opening for every request), since two prompts that began with the same corpus sentence
would share their first KV blocks, and a server with a prefix cache would skip work that the
workload never meant to repeat (with 120 chat requests, 12% of the prompt tokens were such hits).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from cadence.bench.report import error_detail
from cadence.workload import Workload, WorkloadRequest

CORPUS = """\
The river town woke slowly in winter. Before dawn the baker lit his ovens, and the smell of warm bread drifted down to the quay where the ferrymen checked their ropes. Nobody hurried. The ferry left when it was full, and on cold mornings that could take an hour, because people preferred to wait indoors with a cup of tea and the news from upstream.
Every spring the river rose and covered the lower meadows. The farmers had learned long ago not to fight it. They planted late, after the water had gone back and left a thin layer of dark silt behind, and their barley grew thicker than anywhere else in the valley. Old records kept in the church tower describe floods that reached the market square, and a line cut into the stone of the bridge still marks the highest of them.
A lighthouse keeper once wrote that the hardest part of the job was not the storms but the calm nights. In a storm there was always something to do: a lamp to trim, a shutter to fasten, a log to fill in. On a calm night the sea was so quiet that he could hear the clock in the room below, and the hours seemed to stretch until morning. He filled them by reading, and over thirty years he read every book that the supply boat would carry.
Learning to cook is mostly learning to pay attention. A recipe tells you to fry onions for ten minutes, but the onions do not know about the recipe. They are ready when they turn soft and golden and smell sweet, which may take eight minutes on one stove and fifteen on another. Good cooks taste as they go, adjust the heat, and trust their noses more than the clock.
The first public libraries were built on a simple idea: that a town is richer when its books are shared. A single reader could never afford a thousand volumes, but a thousand readers together could afford a great many. The idea spread slowly at first, then quickly, and within a few decades most towns of any size had a reading room where anyone could sit by the window and open a book for free.
Mountain weather changes faster than most visitors expect. A clear blue morning can turn to fog and sleet by noon, and the path that was easy to follow on the way up disappears under cloud on the way down. Experienced walkers carry a map, a compass, warm clothes and more food than they think they will need, and they are never embarrassed to turn back before the summit.
Bees do not sleep the way people do, but they rest. On warm evenings the foragers return to the hive and grow still, their antennae drooping, and a bee that has been kept awake all night will dance less accurately the next day. The other bees then have a harder time finding the flowers she found, so the whole colony pays for one tired worker.
Trains changed how people thought about time. Before the railways, every town kept its own hour by the sun, and noon in one village might be several minutes later than noon in the next. A timetable cannot work that way. So the railway companies agreed on a common clock, the towns followed, and within a generation the whole country was setting its watches by the same time.
A well-kept garden looks effortless, which is exactly why it is not. Someone pulled the weeds before they flowered, moved the roses to where the light was better, and cut back the hedges in late winter so that they would grow thick in spring. The work is small on any single day, but it never stops, and the garden remembers every week it was left alone.
Children learn to count long before they understand what numbers are. They recite one, two, three the way they sing a song, and only later discover that the last word they say tells them how many apples are on the table. Teachers who watch for that moment say it is one of the best parts of the job, because the child's face changes when the idea finally arrives.
The old clockmaker kept a notebook for every clock he repaired. In it he wrote the owner's name, the fault, the parts he replaced and the date he returned it. Some clocks came back to him three or four times over forty years, and reading the notes was like reading a short biography of a family, with weddings and moves and new grandchildren appearing between the lines about worn gears.
Maps are always out of date, and good mapmakers know it. A road is widened, a forest is cleared, a river shifts its bed after a flood, and the paper in your hand no longer matches the ground under your feet. The best a map can do is to be honest about when it was drawn and to show the things that change slowly, like hills and coastlines, with more confidence than the things that change fast.
"""

SENTENCES: tuple[str, ...] = tuple(
    s.strip() + "." for s in CORPUS.replace("\n", " ").split(".") if s.strip()
)
_WORDS: tuple[str, ...] = tuple(sorted({w.strip(".,:;").lower() for w in CORPUS.split()} - {""}))


def _opening(index: int) -> list[str]:
    """Three corpus words spelling `index` in base len(_WORDS): distinct for every request."""
    n = len(_WORDS)
    return [_WORDS[index % n].capitalize(), _WORDS[index // n % n], _WORDS[index // (n * n) % n]]


class Tokenizer(Protocol):
    """What the prompt builder needs: encode text to ids (special tokens included) and back."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ServerTokenizer:
    """The served model's tokenizer through the server's /tokenize and /detokenize.

    Understands cadence and vLLM ({"prompt"} -> {"tokens"}; {"tokens"} -> {"prompt"}) and
    llama.cpp ({"content"} -> {"tokens"}; {"tokens"} -> {"content"}).
    """

    def __init__(self, base_url: str, model: str | None = None, headers: dict[str, str] | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.name = f"server {base_url.rstrip('/')}/tokenize"
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers or {}, timeout=30.0,
                                    transport=transport)
        self._model = model
        self._llama_cpp = False

    def encode(self, text: str) -> list[int]:
        body: dict = {"content": text} if self._llama_cpp else {"prompt": text}
        if self._model and not self._llama_cpp:
            body["model"] = self._model
        r = self._client.post("/tokenize", json=body)
        if r.status_code in (400, 422) and not self._llama_cpp:
            self._llama_cpp = True
            return self.encode(text)
        r.raise_for_status()
        return [int(t) if not isinstance(t, dict) else int(t["id"]) for t in r.json()["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        body: dict = {"tokens": list(ids)}
        if self._model and not self._llama_cpp:
            body["model"] = self._model
        r = self._client.post("/detokenize", json=body)
        r.raise_for_status()
        d = r.json()
        return d["prompt"] if "prompt" in d else d["content"]

    def close(self) -> None:
        self._client.close()

    @classmethod
    def probe(cls, base_url: str, model: str | None = None, headers: dict[str, str] | None = None,
              transport: httpx.BaseTransport | None = None) -> ServerTokenizer | None:
        """The server's tokenizer if it has working /tokenize and /detokenize, else None."""
        return cls.probe_explained(base_url, model, headers, transport)[0]

    @classmethod
    def probe_explained(cls, base_url: str, model: str | None = None, headers: dict[str, str] | None = None,
                        transport: httpx.BaseTransport | None = None) -> tuple[ServerTokenizer | None, str | None]:
        """`probe`, and why it found no working tokenizer: None when the server simply has no
        /tokenize route (the usual case for servers without one), else its status and message (a
        wrong model name, a refused API key, ...)."""
        tok = cls(base_url, model, headers, transport)
        why: str | None
        try:
            if tok.decode(tok.encode("The river town woke slowly.")).strip():
                return tok, None
            why = "/detokenize gave back no text"
        except httpx.HTTPStatusError as e:
            detail = error_detail(e.response.content)
            missing = e.response.status_code in (404, 405) and detail in _NO_ROUTE
            why = None if missing else f"HTTP {e.response.status_code} from {e.request.url.path}: {detail}"
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"[:200]
        tok.close()
        return None, why


_ANCHOR = "The"  # the word a word's tokens are counted after (see PromptBuilder._word_count)
_NO_ROUTE = ("Not Found", "Method Not Allowed")  # a framework's answer for a route it does not have


class LocalTokenizer:
    """A Hugging Face `tokenizers` file (tokenizer.json, or a directory that holds one)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer  # only needed with --tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ValueError(f"tokenizer: no tokenizer.json at {path}")
        self.name = f"local {p}"
        self._tok = HFTokenizer.from_file(str(p))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _words(key: str, n: int) -> list[str]:
    """n words of corpus sentences in an order fixed by `key` (the same key, the same words)."""
    rng = random.Random(key)
    out: list[str] = []
    while len(out) < n:
        out.extend(rng.choice(SENTENCES).split())
    return out[:n]


@dataclass
class PromptBuilder:
    """Makes the text of each request: shared blocks for its prefix ids, then its own sentences.

    With a tokenizer the text is exactly `prompt_tokens` tokens by that tokenizer's count,
    special tokens it adds (BOS) included; the rare miss (a cut that re-tokenizes differently
    after a few corrections) is counted in `inexact`.
    """

    tokenizer: Tokenizer | None = None
    seed: int = 0
    chars_per_token: float = 4.0
    tokenizer_refused: str | None = None  # why the server's /tokenize was not used
    inexact: list[tuple[int, int]] = field(default_factory=list)  # (wanted, got)
    _specials: list[int] | None = None
    _words_per_token: float | None = None
    _additive: bool = True  # tokens of "a b" == tokens of "a" + tokens of " b" (set by _calibrate)
    _word_tokens: dict[str, int] = field(default_factory=dict)  # " word" (or a text's first "word") -> tokens
    _anchor_tokens: int = 0  # tokens of _ANCHOR, special tokens included
    _chains: _ChainCache = field(default_factory=lambda: _ChainCache())

    @property
    def method(self) -> str:
        if self.tokenizer is None:
            why = f"the server's /tokenize refused: {self.tokenizer_refused}" if self.tokenizer_refused \
                else "no tokenizer"
            return f"estimate: {self.chars_per_token:g} characters per token ({why}: prompt sizes are approximate)"
        return f"exact token counts by the {self.tokenizer.name} tokenizer"

    def _calibrate(self) -> None:
        assert self.tokenizer is not None
        a, b = self.tokenizer.encode("Hello there."), self.tokenizer.encode("Goodbye now.")
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        self._specials = a[:n]  # what the tokenizer puts before any text (BOS)
        sample = " ".join(SENTENCES)
        content = len(self.tokenizer.encode(sample)) - n
        self._words_per_token = len(sample.split()) / max(1, content)
        # Byte-level BPE and SentencePiece never merge across a space, so a text's tokens are the
        # sum of its words' and blocks can be sized from per-word counts; a tokenizer where that
        # fails on the corpus is sized by encoding each chain's whole text.
        self._anchor_tokens = len(self.tokenizer.encode(_ANCHOR))
        words = sample.split()
        self._additive = content == self._word_count(words[0], True) + sum(self._word_count(w) for w in words[1:])

    def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` without the special tokens the tokenizer adds; None without one."""
        if self.tokenizer is None:
            return None
        if self._specials is None:
            self._calibrate()
        return len(self.tokenizer.encode(text)) - len(self._specials or ())

    def text_for(self, req: WorkloadRequest, index: int, block_tokens: int) -> str:
        if req.prompt is not None:
            return req.prompt
        if self.tokenizer is None:
            return self._estimate(req, index, block_tokens)
        if self._specials is None:
            self._calibrate()
        return self._exact(req, index, block_tokens)

    def _draft(self, req: WorkloadRequest, index: int, block_words: int | list[int], tail_words: int) -> str:
        """The shared blocks' words (`block_words` each, or the i-th count for block i), then the request's own."""
        words: list[str] = []
        for i, block_id in enumerate(req.prefix_group):
            n = block_words if isinstance(block_words, int) else block_words[i]
            words += _words(f"block:{self.seed}:{block_id}", n)
        words += (_opening(index) + _words(f"request:{self.seed}:{index}", tail_words))[:tail_words]
        return " ".join(words)

    def _word_count(self, word: str, first: bool = False) -> int:
        """Tokens `word` adds after a word and a space (or opening the text, `first`). Counted after a
        word rather than alone: SentencePiece reads a text's leading space as one more "▁"."""
        key = word if first else " " + word
        n = self._word_tokens.get(key)
        if n is None:
            assert self.tokenizer is not None and self._specials is not None
            n = len(self.tokenizer.encode(word)) - len(self._specials) if first \
                else len(self.tokenizer.encode(_ANCHOR + key)) - self._anchor_tokens
            self._word_tokens[key] = n
        return n

    def _block_word_counts(self, prefix_group: Sequence[int], block_tokens: int) -> list[int]:
        """Words of each shared block, so that blocks 0..i come to at least (i+1) * block_tokens
        tokens (special tokens included) with as few words as that needs: each block's count
        depends on the ids before it, and is worked out once per distinct chain prefix."""
        assert self._specials is not None
        counts: list[int] = []
        node, tokens = _ChainCache.ROOT, len(self._specials)
        before: list[str] = []
        for i, block_id in enumerate(prefix_group):
            stream_key = f"block:{self.seed}:{block_id}"
            found = self._chains.get(node, block_id)
            if found is None:
                if self._additive:
                    n, total = self._size_block(stream_key, tokens, (i + 1) * block_tokens, not any(counts))
                else:
                    n, total = self._size_block_whole(before, stream_key, (i + 1) * block_tokens)
                found = self._chains.add(node, block_id, n, total)
            node, n, tokens = found
            counts.append(n)
            if not self._additive:  # whole-prefix counting needs the text so far
                before += _words(stream_key, n)
        return counts

    def _size_block(self, stream_key: str, tokens: int, target: int, opens_text: bool) -> tuple[int, int]:
        """(words, tokens of the chain with them) for the block whose words `stream_key` draws, the
        chain so far being `tokens` long, from per-word counts (`opens_text`: no space before the first)."""
        assert self._words_per_token is not None
        n = 0
        while tokens < target:  # every word adds at least one token: the loop ends
            chunk = _words(stream_key, n + max(8, math.ceil((target - tokens) * self._words_per_token)))
            for w in chunk[n:]:
                tokens += self._word_count(w, opens_text and n == 0)
                n += 1
                if tokens >= target:
                    break
        return n, tokens

    def _size_block_whole(self, before: list[str], stream_key: str, target: int) -> tuple[int, int]:
        """`_size_block` by encoding the whole prefix: for tokenizers whose counts do not add up by word."""
        tok = self.tokenizer
        assert tok is not None and self._words_per_token is not None

        def count(n: int) -> int:
            words = before + _words(stream_key, n)
            return len(tok.encode(" ".join(words))) if words else len(self._specials or ())

        lo, hi = 0, max(1, math.ceil(target * self._words_per_token / 8))  # count(lo) < target <= count(hi)
        if count(lo) >= target:
            return 0, count(0)
        while count(hi) < target:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if count(mid) >= target else (mid, hi)
        return hi, count(hi)

    def _estimate(self, req: WorkloadRequest, index: int, block_tokens: int) -> str:
        tokens_per_word = 5.5 / self.chars_per_token  # an English word and its space: ~5.5 characters
        block_words = max(1, round(block_tokens / tokens_per_word))
        text = self._draft(req, index, block_words, math.ceil(req.prompt_tokens / tokens_per_word) + 4)
        cut = text[: max(1, round(req.prompt_tokens * self.chars_per_token))]
        return cut.rsplit(" ", 1)[0] if " " in cut else cut

    def _exact(self, req: WorkloadRequest, index: int, block_tokens: int) -> str:
        tok, specials, wpt = self.tokenizer, self._specials, self._words_per_token
        assert tok is not None and specials is not None and wpt is not None
        want = max(1, req.prompt_tokens - len(specials))
        block_words = self._block_word_counts(req.prefix_group, block_tokens)
        tail = math.ceil(want * wpt * 1.3) + 8
        while True:
            ids = tok.encode(self._draft(req, index, block_words, tail))[len(specials):]
            if len(ids) >= want:
                break
            tail *= 2
        target, best = want, ("", -1)
        for _ in range(4):  # decode-then-encode can merge tokens at the cut: correct a few times
            text = tok.decode(ids[:target])
            got = len(tok.encode(text))
            if best[1] < 0 or abs(got - req.prompt_tokens) < abs(best[1] - req.prompt_tokens):
                best = (text, got)
            if got == req.prompt_tokens:
                return text
            target = max(1, min(len(ids), target + req.prompt_tokens - got))
        self.inexact.append((req.prompt_tokens, best[1]))
        return best[0]

    def build_all(self, workload: Workload) -> list[str | None]:
        """Text for every request (None where the request brings its own chat messages)."""
        return [None if r.messages is not None else self.text_for(r, i, workload.prefix_block_tokens)
                for i, r in enumerate(workload.requests)]


class _ChainCache:
    """Sized shared blocks as a trie of prefix chains: (node of ids 0..i-1, id i) -> node of ids 0..i,
    holding block i's word count and the tokens of blocks 0..i. Requests sharing leading ids share
    nodes, so each distinct chain prefix is sized once however many requests carry it."""

    ROOT = 0

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}
        self._words: list[int] = [0]
        self._tokens: list[int] = [0]

    def get(self, node: int, block_id: int) -> tuple[int, int, int] | None:
        """(child node, block words, chain tokens) of `block_id` after `node`, if sized."""
        child = self._nodes.get((node, block_id))
        return None if child is None else (child, self._words[child], self._tokens[child])

    def add(self, node: int, block_id: int, words: int, tokens: int) -> tuple[int, int, int]:
        child = len(self._words)
        self._nodes[(node, block_id)] = child
        self._words.append(words)
        self._tokens.append(tokens)
        return child, words, tokens
