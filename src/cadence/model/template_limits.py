"""Work limits for rendering a chat template: time, output size, and loop iterations plus calls.

A Python thread cannot be stopped from outside, so a template that loops for ever has to be stopped
from inside: the sandbox (chat_template.py) counts every loop iteration and every call a template
makes against the `RenderBudget` of the render under way, reads the clock every few hundred of
them, checks the size of what it builds, and raises `ChatTemplateLimitError` once a limit is
passed. The budget lives in a context variable, so renders running at once in a thread pool each
have their own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

_CLOCK_EVERY = 256  # counted events between two readings of the clock (a power of two)


@dataclass(frozen=True)
class RenderLimits:
    """What one chat may cost to render (both passes of `render_chat` together)."""

    timeout: float = 5.0  # seconds
    max_chars: int = 4_000_000  # characters of output, and of any string or list the template builds
    max_iterations: int = 10_000_000  # loop iterations, calls (macros, filters, methods) and output pieces

    def validate(self) -> RenderLimits:
        if not self.timeout > 0:
            raise ValueError(f"chat_template_timeout: must be > 0 seconds, got {self.timeout!r}")
        if self.max_chars < 1024:
            raise ValueError(f"chat_template_max_chars: must be >= 1024, got {self.max_chars!r}")
        if self.max_iterations < 1000:
            raise ValueError(f"chat_template_max_iterations: must be >= 1000, got {self.max_iterations!r}")
        return self


class ChatTemplateLimitError(ValueError):
    """A chat template went over a render limit: it `what` ("ran longer than 5 s"). `option` names
    the engine option that sets the limit (None for the recursion limit, which is Python's)."""

    def __init__(self, what: str, option: str | None) -> None:
        self.what = what
        self.option = option
        super().__init__(f"the chat template {what}{self.hint()}")

    def hint(self) -> str:
        """' (the limit: option x_y, flag --x-y)', or '' for a limit without an option."""
        if self.option is None:
            return ""
        return f" (the limit: option {self.option}, flag --{self.option.replace('_', '-')})"


class RenderBudget:
    """The work left to one render; `step` is called for every loop iteration and call."""

    __slots__ = ("limits", "deadline", "iterations", "_ticks")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout
        self.iterations = 0
        self._ticks = 0

    def step(self) -> None:
        self.iterations += 1
        self.tick()

    def tick(self) -> None:
        """An event that costs time but is not an iteration (a piece of output): reads the clock
        and checks the iteration count every `_CLOCK_EVERY` events."""
        self._ticks += 1
        if self._ticks & (_CLOCK_EVERY - 1) == 0:
            self.check()

    def check(self) -> None:
        if self.iterations > self.limits.max_iterations:
            raise ChatTemplateLimitError(
                f"made more than {self.limits.max_iterations} loop iterations and calls",
                "chat_template_max_iterations",
            )
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(f"ran longer than {self.limits.timeout:g} s", "chat_template_timeout")

    def check_size(self, size: int) -> None:
        """Refuse a string, list or output of `size` items beyond the character limit."""
        if size > self.limits.max_chars:
            raise ChatTemplateLimitError(
                f"built more than {self.limits.max_chars} characters", "chat_template_max_chars"
            )


_BUDGET: ContextVar[RenderBudget | None] = ContextVar("cadence_render_budget", default=None)


def current_budget() -> RenderBudget:
    """The budget of the render under way; outside one (compiling a template, which may fold
    constant expressions), a fresh budget with the default limits."""
    budget = _BUDGET.get()
    return budget if budget is not None else RenderBudget(RenderLimits())


@contextmanager
def render_budget(limits: RenderLimits) -> Iterator[RenderBudget]:
    """Run the body under a fresh budget of `limits`."""
    budget = RenderBudget(limits)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)
