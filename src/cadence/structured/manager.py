"""The engine's side of structured output: one matcher per constrained request, a batched token
bitmask per step for the rows that sample under a grammar, and the matchers advanced with the
tokens the scheduler accepted.

A matcher moves only with accepted tokens (a request's `RequestDelta.new_token_ids`), never with
what the model is fed: a request preempted and recomputed, or prefilled in chunks, feeds tokens the
matcher has already seen (or the prompt, which it never sees), and samples only at the end.

A matcher that fails, whether the library puts it in its error state (a refused token, its
per-step limits) or raises, ends its own request with an error after the step; the other
requests of the step, constrained or not, go on as if nothing happened.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cadence.boundary import GrammarMask, RequestDelta, SchedulerOutput
from cadence.request import Request, StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from cadence.model.tokenizer import Tokenizer
    from cadence.structured.compiler import CompiledGrammar, GrammarCompiler


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarEnd:
    """A constrained request to end after a step: its grammar is complete (`error` None), or the
    matcher refused a token or ran out of its limits (`error` says so)."""

    request_id: str
    error: str | None = None
    # The library itself stopped the matcher: the request's fault, unlike a matcher that raised.
    # Every sampled token is one the library's mask allowed, so a matcher in its error state was given
    # a constraint it cannot follow (its parser past its limits; text that spells a control token).
    beyond_limits: bool = False


class StructuredOutputs:
    """Owned by the engine core, used from its thread only (the compiler is thread-safe). The
    compiler, and with it the grammar library, is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, **compiler_options: Any) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._options = compiler_options
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # Requests whose matcher raised: the reason, reported by the next `advance`.
        self._failed: dict[str, str] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                from cadence.structured.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, **self._options)
            return self._compiler

    def validate(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile (or fetch from the cache): ValueError naming the field when the spec is refused."""
        return self.compiler.compile(spec)

    async def validate_async(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """`validate` without blocking the event loop (the compiler itself is built in a thread too)."""
        compiler = self._compiler if self._compiler is not None else await asyncio.to_thread(lambda: self.compiler)
        return await compiler.compile_async(spec)

    def validate_all(self, specs: Sequence[StructuredOutputsParams]) -> None:
        """`validate` each spec, compiling them all at once in the compiler's threads."""
        for spec in specs:
            self.compiler.submit(spec)
        for spec in specs:
            self.validate(spec)  # the compile submitted above: waits for it, within the time cap

    # -- requests -----------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def attach(self, requests: Sequence[Request]) -> None:
        """Give each constrained request its matcher (all or none; ValueError names the field). A
        spec compiled beforehand (`validate_async`) is a cache hit; any other compiles here."""
        new: dict[str, llguidance.LLMatcher] = {}
        for r in requests:
            spec = r.sampling_params.structured_outputs
            if spec is not None:
                m = self.validate(spec).matcher()
                if r.output_token_ids:  # a request that arrives with tokens already generated for it
                    m.consume_tokens(list(r.output_token_ids))
                new[r.request_id] = m
        self._matchers.update(new)

    def detach(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
            self._failed.pop(rid, None)

    # -- the step -----------------------------------------------------------------------------------

    def with_bitmask(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step's plan with one bitmask row per constrained request that samples (none else)."""
        rows = [sr.request_id for sr in out.scheduled
                if sr.sample and sr.request_id in self._matchers and sr.request_id not in self._failed]
        if not rows:
            return out
        import llguidance.torch as llt

        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        bitmask = llt.allocate_token_bitmask(len(rows), self.vocab_size)
        try:
            llt.fill_next_token_bitmask_par(self._executor, [(self._matchers[rid], i) for i, rid in enumerate(rows)],
                                            bitmask)
        except BaseException as e:
            if not _matcher_failure(e):
                raise
            # One matcher's failure must not cost the others their step: fill row by row, and
            # end only the requests whose matcher raises.
            self._fill_rows(rows, bitmask)
        return replace(out, grammar=GrammarMask(tuple(rows), bitmask))

    def _fill_rows(self, rows: Sequence[str], bitmask: Any) -> None:
        import llguidance.torch as llt

        for i, rid in enumerate(rows):
            try:
                llt.fill_next_token_bitmask(self._matchers[rid], bitmask, i)
            except BaseException as e:
                if not _matcher_failure(e):
                    raise
                self._fail(rid, "computing the token mask", e)
                self._eos_only(bitmask[i])

    def _eos_only(self, row: Any) -> None:
        """A failed row samples end-of-sequence, as the library's own errored matchers do: the
        request ends after this step, and nothing its grammar might refuse is sampled meanwhile."""
        eos = [t for t in self._tokenizer.eos_token_ids if 0 <= t < self.vocab_size]
        if not eos:
            row.fill_(-1)  # no end token to offer: whatever it samples, the request ends with its error
            return
        row.zero_()
        for t in eos:
            word, bit = divmod(t, 32)
            row[word] |= _bit(bit)

    def _fail(self, request_id: str, doing: str, error: BaseException) -> None:
        logger.error("structured output: the grammar matcher of %s failed %s: %s: %s", request_id, doing,
                     type(error).__name__, error)
        self._failed.setdefault(request_id, f"structured output: the grammar matcher failed {doing} "
                                            f"({type(error).__name__}: {str(error)[:200]})")

    def advance(self, deltas: Sequence[RequestDelta]) -> list[GrammarEnd]:
        """Feed each constrained request its accepted tokens; forget the finished. Returns the requests
        still running whose grammar has ended (complete, or in error), and those that ended in this
        step while their grammar failed."""
        ends: list[GrammarEnd] = []
        for d in deltas:
            m = self._matchers.get(d.request_id)
            if m is None:
                continue
            error, stopped = self._consume(d.request_id, m, d.new_token_ids)
            beyond_limits = error is not None and d.request_id not in self._failed
            if d.finished:
                del self._matchers[d.request_id]
                self._failed.pop(d.request_id, None)
            if error is not None and d.finish_reason not in ("error", "abort"):
                # A request that ends in the step its matcher fails (end-of-sequence being all a failed
                # matcher's mask allows, or the budget spent) ends in error too: its output does not
                # follow the constraint.
                ends.append(GrammarEnd(d.request_id, error, beyond_limits))
            elif stopped and not d.finished:
                ends.append(GrammarEnd(d.request_id))
        return ends

    def _consume(self, request_id: str, m: llguidance.LLMatcher, tokens: Sequence[int]) -> tuple[str | None, bool]:
        """Advance one matcher: (its failure, or None; whether its grammar is complete)."""
        if request_id not in self._failed:
            try:
                if tokens and not m.is_error():
                    m.consume_tokens(list(tokens))
                if not m.is_error():
                    return None, m.is_stopped()
                return f"structured output: {m.get_error()[:200]}", False
            except BaseException as e:
                if not _matcher_failure(e):
                    raise
                self._fail(request_id, "consuming the sampled tokens", e)
        return self._failed[request_id], False


def _bit(i: int) -> int:
    """Bit `i` of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def _matcher_failure(e: BaseException) -> bool:
    """Whether `e`, raised by a matcher, is its failure (to end its request with) rather than the
    process's (KeyboardInterrupt, SystemExit). The library's Rust panics reach Python as pyo3's
    PanicException, which derives from BaseException, not Exception."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"
