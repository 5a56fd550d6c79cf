"""Structured output: constrained decoding by grammar (JSON schema, JSON object, regex, choice, grammar).

For the server (and any caller that must refuse a bad constraint before the request enters the
engine), one call, cached by spec:

    from cadence.structured import validate, validate_async
    validate(params.structured_outputs, engine.core.structured)             # blocking
    await validate_async(params.structured_outputs, engine.core.structured) # from the event loop

Both compile the spec (or take it from the cache) and raise `ValueError("structured_outputs.json:
...")`, naming the field, when the grammar library refuses it, when it is longer than the
compiler's `max_spec_chars` (100,000 characters) or when it does not compile within
`timeout_s` (10 s). A spec validated so is a cache hit when its request is admitted. The
`AsyncEngine` compiles every constrained request this way before handing it to the engine thread,
so a slow compile never holds a step.

Pieces: `compiler.GrammarCompiler` (thread pool, LRU cache of compiled grammars), and
`manager.StructuredOutputs` (the engine core's: a matcher per request, the step's bitmask, the
matchers advanced with accepted tokens). The grammar syntax is Lark (llguidance's); a grammar
containing `::=` is read as GBNF and converted.
"""

from __future__ import annotations

from cadence.request import StructuredOutputsParams
from cadence.structured.manager import GrammarEnd, StructuredOutputs

__all__ = ["GrammarEnd", "StructuredOutputs", "validate", "validate_async"]


def validate(spec: StructuredOutputsParams, structured: StructuredOutputs) -> None:
    """Compile `spec` (or find it cached); ValueError naming the field if it is refused."""
    structured.validate(spec)


async def validate_async(spec: StructuredOutputsParams, structured: StructuredOutputs) -> None:
    """`validate` from the event loop: the compile runs in the compiler's threads."""
    await structured.validate_async(spec)
