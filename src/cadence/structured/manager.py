"""The engine's side of structured output: one matcher per constrained request, a batched token
bitmask per step for the rows that sample under a grammar, and the matchers advanced with the
tokens the scheduler accepted.

A matcher moves only with accepted tokens (a request's `RequestDelta.new_token_ids`), never with
what the model is fed: a request preempted and recomputed, or prefilled in chunks, feeds tokens the
matcher has already seen (or the prompt, which it never sees), and samples only at the end.
"""

from __future__ import annotations

import asyncio
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


@dataclass(frozen=True)
class GrammarEnd:
    """A constrained request to end after a step: its grammar is complete (`error` None), or the
    matcher refused a token or ran out of its limits (`error` says so)."""

    request_id: str
    error: str | None = None


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

    # -- the step -----------------------------------------------------------------------------------

    def with_bitmask(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step's plan with one bitmask row per constrained request that samples (none else)."""
        rows = [sr.request_id for sr in out.scheduled if sr.sample and sr.request_id in self._matchers]
        if not rows:
            return out
        import llguidance.torch as llt

        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        bitmask = llt.allocate_token_bitmask(len(rows), self.vocab_size)
        llt.fill_next_token_bitmask_par(self._executor, [(self._matchers[rid], i) for i, rid in enumerate(rows)],
                                        bitmask)
        return replace(out, grammar=GrammarMask(tuple(rows), bitmask))

    def advance(self, deltas: Sequence[RequestDelta]) -> list[GrammarEnd]:
        """Feed each constrained request its accepted tokens; forget the finished. Returns the requests
        still running whose grammar has ended (complete, or in error), and those that ended in this
        step while their grammar failed."""
        ends: list[GrammarEnd] = []
        for d in deltas:
            m = self._matchers.get(d.request_id)
            if m is None:
                continue
            if d.new_token_ids and not m.is_error():
                m.consume_tokens(list(d.new_token_ids))
            if d.finished:
                del self._matchers[d.request_id]
            if m.is_error() and d.finish_reason not in ("error", "abort"):
                # A request that ends in the step its matcher fails (end-of-sequence being all a failed
                # matcher's mask allows, or the budget spent) ends in error too: its output does not
                # follow the constraint.
                ends.append(GrammarEnd(d.request_id, f"structured output: {m.get_error()[:200]}"))
            elif m.is_stopped() and not d.finished:
                ends.append(GrammarEnd(d.request_id))
        return ends
