"""Compiling a `StructuredOutputsParams` into a grammar matcher, off the engine thread, cached by spec.

The grammar library is llguidance (see docs/structured_output.md, "Engine", for why). A compiled
grammar is a prototype `LLMatcher` in its start state; each request gets a `deep_copy` of it, so
equal specs (n > 1 choices, repeated schemas) compile once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cadence.request import StructuredOutputsParams
from cadence.structured.repetition import check_forced_repeat

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

    from cadence.model.tokenizer import Tokenizer

# Defaults of the compiler's limits (documented in docs/structured_output.md and docs/server.md).
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (least recently used goes first)
DEFAULT_COMPILE_TIMEOUT_S = 10.0  # a grammar not compiled by then is refused
DEFAULT_MAX_SPEC_CHARS = 100_000  # characters of a schema, regex, grammar or all choices together
DEFAULT_COMPILE_THREADS = 2
_MAX_ERROR_CHARS = 400


def field_name(spec: StructuredOutputsParams) -> str:
    """The field an error about this spec names, e.g. `structured_outputs.json`."""
    return f"structured_outputs.{spec.kind}"


def spec_chars(spec: StructuredOutputsParams) -> int:
    if spec.choice is not None:
        return sum(len(c) for c in spec.choice)
    return len(spec.json or spec.regex or spec.grammar or "")


def _literal_regex(text: str) -> str:
    """A regex matching exactly `text`: every character but letters and digits as a `\\x{...}` escape,
    which the library's regex syntax reads the same whatever the character."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec; ValueError naming the field for a malformed one.

    JSON is compact (no whitespace between tokens: a small model given the choice loops on
    newlines), so the output is what `json.dumps(..., separators=(",", ":"))` would print."""
    import llguidance

    from_json = llguidance.LLMatcher.grammar_from_json_schema
    options: JsonCompileOptions = {"whitespace_flexible": False}
    try:
        if spec.json is not None:
            schema = json.loads(spec.json)
            if not isinstance(schema, dict):
                raise ValueError("must be a JSON object")
            return from_json(schema, defaults=options)
        if spec.json_object:
            return from_json({"type": "object"}, defaults=options)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_regex("|".join(_literal_regex(c) for c in spec.choice))
        assert spec.grammar is not None
        text = spec.grammar
        if "::=" in text:  # GBNF / EBNF (llama.cpp's and xgrammar's syntax): convert to Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        return llguidance.LLMatcher.grammar_from_lark(text)
    except Exception as e:  # noqa: BLE001 - whatever the library raises about a spec, it is the sender's error
        raise ValueError(f"{field_name(spec)}: {_short(e)}") from None


def _check_first_mask(spec: StructuredOutputsParams, matcher: llguidance.LLMatcher) -> None:
    """Refuse a grammar that fails on its first mask: one that admits no output at all (a rule
    defined only by itself, a `$ref` cycle) errs there, and would otherwise end its request at once
    with an empty text that does not follow it."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        error = probe.get_error()
        reason = "it admits no output" if "NoExtensionBias" in error else _short(error)
        raise ValueError(f"{field_name(spec)}: {reason}")


def _short(e: object) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled against one tokenizer. `matcher()` gives a fresh matcher in the start state."""

    spec: StructuredOutputsParams
    prototype: llguidance.LLMatcher
    compile_seconds: float

    def matcher(self) -> llguidance.LLMatcher:
        return self.prototype.deep_copy()


class GrammarCompiler:
    """Compiles specs in a small thread pool (llguidance drops the GIL while it builds), keeps the
    last `cache_size` results, and joins concurrent compiles of one spec. Thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_spec_chars: int = DEFAULT_MAX_SPEC_CHARS,
        threads: int = DEFAULT_COMPILE_THREADS,
    ) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.max_spec_chars = max_spec_chars
        eos = sorted(tokenizer.eos_token_ids)
        # The tokenizer's own JSON: llguidance walks the same byte-level vocabulary the model samples from.
        self.lltokenizer = llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size,
                                                  eos_token=eos if eos else None)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputsParams, CompiledGrammar] = OrderedDict()
        self._pending: dict[StructuredOutputsParams, Future[CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cadence-grammar")

    # -- asking for a grammar -----------------------------------------------------------------------

    def cached(self, spec: StructuredOutputsParams) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            return hit

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of the compiled spec: done at once on a cache hit, shared with a compile in progress."""
        self._check_size(spec)
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                done: Future[CompiledGrammar] = Future()
                done.set_result(hit)
                return done
            fut = self._pending.get(spec)
            if fut is not None:
                return fut
            fut = self._pool.submit(self._build, spec)
            self._pending[spec] = fut
        # Outside the lock: a compile already done runs the callback here, and it takes the lock.
        fut.add_done_callback(functools.partial(self._done, spec))
        return fut

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking: the compiled spec, or ValueError naming the field (bad spec, or over the time cap)."""
        try:
            return self.submit(spec).result(timeout=self.timeout_s)
        except TimeoutError:
            raise self._timeout_error(spec) from None

    async def compile_async(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """`compile` without blocking the event loop."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.submit(spec)), self.timeout_s)
        except TimeoutError:
            raise self._timeout_error(spec) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ----------------------------------------------------------------------------------

    def _check_size(self, spec: StructuredOutputsParams) -> None:
        n = spec_chars(spec)
        if n > self.max_spec_chars:
            raise ValueError(f"{field_name(spec)}: {n} characters, more than the limit of {self.max_spec_chars}")

    def _timeout_error(self, spec: StructuredOutputsParams) -> ValueError:
        return ValueError(f"{field_name(spec)}: not compiled within {self.timeout_s:g} s; simplify it")

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        start = time.perf_counter()
        check_forced_repeat(spec, field_name(spec))
        grammar = grammar_text(spec)
        try:
            matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self._limits)
        except Exception as e:  # noqa: BLE001 - as in grammar_text
            raise ValueError(f"{field_name(spec)}: {_short(e)}") from None
        if matcher.is_error():
            raise ValueError(f"{field_name(spec)}: {_short(matcher.get_error())}")
        _check_first_mask(spec, matcher)
        return CompiledGrammar(spec, matcher, time.perf_counter() - start)

    def _done(self, spec: StructuredOutputsParams, fut: Future[Any]) -> None:
        with self._lock:
            self._pending.pop(spec, None)
            if fut.cancelled() or fut.exception() is not None:
                return  # errors are not cached: a bad spec costs its sender a compile each time
            self._cache[spec] = fut.result()
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
