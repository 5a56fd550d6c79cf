"""Chat templates: render a model's Jinja template in a sandbox and say which text came from messages.

Templates come from model files and, through the API, from users: they run in jinja2's immutable
sandbox, where touching an unsafe attribute (`''.__class__`) raises instead of printing nothing,
under a work budget (template_limits.py): every loop iteration and call is counted and the clock
read as they go, and the output and every string or list the template builds are capped, so a
template that loops for ever, recurses without end or writes gigabytes fails with
`ChatTemplateLimitError` instead of holding its thread. The tokenizer must turn the template's own
markers (`<|im_start|>`) into control tokens but never the same text typed by a user, so
`render_chat` also returns where each message's content lies in the rendered text. It renders
twice: once with unique placeholders for the contents (to find their spans) and once with the real
contents (the truth). When the two agree after substitution, the spans are exact; when a template
rewrites contents (trims or splits them), the contents are located by search instead and any that
cannot be found are reported.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes, pass_context
from jinja2.exceptions import SecurityError
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from cadence.model.template_limits import (
    ChatTemplateLimitError,
    RenderBudget,
    RenderLimits,
    current_budget,
    render_budget,
)


@dataclass(frozen=True)
class RenderedChat:
    text: str
    content_spans: tuple[tuple[int, int], ...]  # [start, end) of message contents in `text`
    unlocated: tuple[str, ...] = ()  # contents a rewriting template changed beyond finding


# Format strings with a six-digit width or precision ('{:>99999999}', '%99999999d') allocate at will.
_BIG_NUMBER = re.compile(r"\d{6,}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _BIG_NUMBER.search(fmt):
        raise SecurityError("format strings with widths or precisions of six digits or more are refused")


def _sized(budget: RenderBudget, value: Any) -> Any:
    if isinstance(value, (str, list, tuple)):
        budget.check_size(len(value))
    return value


def _replaced_size(s: str, old: str, new: str, count: Any = None) -> int:
    hits = len(s) + 1 if old == "" else s.count(old)
    if _is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _joined_size(sep: str, items: Any) -> int:
    if not isinstance(items, (list, tuple)):
        return 0
    return sum(len(x) for x in items if isinstance(x, str)) + len(sep) * max(0, len(items) - 1)


# Size checks made before a str method runs, where the result can be far larger than its inputs.
def _check_str_method(budget: RenderBudget, method: Any, args: tuple[Any, ...]) -> None:
    owner = getattr(method, "__self__", None)
    if not isinstance(owner, str) or not args:
        return
    name, first = getattr(method, "__name__", ""), args[0]
    if name in ("center", "ljust", "rjust", "zfill") and _is_int(first):
        budget.check_size(first)
    elif name == "expandtabs" and _is_int(first):
        budget.check_size(len(owner) * max(first, 1))
    elif name == "replace" and len(args) >= 2 and isinstance(first, str) and isinstance(args[1], str):
        budget.check_size(_replaced_size(owner, first, args[1], args[2] if len(args) > 2 else None))
    elif name == "join":
        budget.check_size(_joined_size(owner, first))


# The same for the built-in filters that multiply their input (signatures as jinja2's, less the
# evaluation context some of them take first).
def _pre_replace(b: RenderBudget, s: Any, old: Any, new: Any, count: Any = None) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        b.check_size(_replaced_size(s, old, new, count))


def _pre_indent(b: RenderBudget, s: Any, width: Any = 4, first: Any = False, blank: Any = False) -> None:
    w = width if _is_int(width) else len(width) if isinstance(width, str) else 0
    if isinstance(s, str):
        b.check_size(len(s) + (s.count("\n") + 1) * max(w, 0))


def _pre_center(b: RenderBudget, value: Any, width: Any = 80) -> None:
    if _is_int(width):
        b.check_size(width)


def _pre_join(b: RenderBudget, value: Any, d: Any = "", attribute: Any = None) -> None:
    if isinstance(d, str):
        b.check_size(_joined_size(d, value))


def _pre_batch(b: RenderBudget, value: Any, linecount: Any, fill_with: Any = None) -> None:
    if _is_int(linecount):
        b.check_size(linecount)


_FILTER_CHECKS = {"replace": _pre_replace, "indent": _pre_indent, "center": _pre_center, "join": _pre_join,
                  "batch": _pre_batch}  # fmt: skip


def _metered_filter(fn: Any, check: Any) -> Any:
    """`fn` counted as a call, checked first by `check` (if any), its result's size checked after."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)  # keeps `jinja_pass_arg`, so jinja passes the same context first
    def metered(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.step()
        if check is not None:
            check(budget, *args[skip:], **kwargs)
        return _sized(budget, fn(*args, **kwargs))

    return metered


# Both take the context so that jinja never folds them into constants at compile time.
@pass_context
def _metered_loop(_context: Any, iterable: Any) -> Any:
    budget = current_budget()
    for item in iterable:
        budget.step()
        yield item


@pass_context
def _sized_concat(_context: Any, value: Any) -> Any:
    return _sized(current_budget(), value)


_LOOP, _CONCAT = "_cadence_metered_loop", "_cadence_sized_concat"


class _Meter(NodeTransformer):
    """Rewrites a parsed template so that every `for` loop iterates through `_metered_loop` and
    every `~` concatenation goes through `_sized_concat`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, _CONCAT, [], [], None, None, lineno=node.lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus: unsafe attribute access fails loudly instead of rendering '',
    the operators and format calls that can allocate without bound ('a' * 10**10) are checked
    first, and every loop iteration and call counts against the render's budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        # jinja's one hook between parsing and code generation (private, stable across 3.x).
        tree = super()._parse(source, name, filename)
        _Meter().visit(tree)
        return tree

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        if operator == "**" and _is_int(left) and _is_int(right) and left.bit_length() * right > 1 << 16:
            raise SecurityError("integer powers beyond 65536 bits are refused")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and _is_int(n):
                    budget.check_size(len(seq) * n)
        if operator == "%":
            _check_format(left)
        return _sized(budget, super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = current_budget()
        budget.step()
        _check_str_method(budget, __obj, args)
        return _sized(budget, super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        _check_format(getattr(value, "__self__", None))
        return super().wrap_str_format(value)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    """Jinja's `format` filter (printf-style), with the same width check as the `%` operator."""
    _check_format(value)
    return str(value) % (kwargs or args)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Templates expect non-ASCII kept as is (Jinja's own tojson escapes it and HTML-quotes '<').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False)
    # lipsum(n) builds its text in one uncounted call (10**8 paragraphs: gigabytes); no chat
    # template has a use for it.
    del env.globals["lipsum"]
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    env.filters["format"] = _format
    for name, fn in list(env.filters.items()):
        env.filters[name] = _metered_filter(fn, _FILTER_CHECKS.get(name))
    env.filters[_LOOP] = _metered_loop
    env.filters[_CONCAT] = _sized_concat
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    try:
        return _environment().from_string(source)
    except TemplateError as e:
        line = getattr(e, "lineno", None)
        raise ValueError(f"chat_template: cannot compile{f' (line {line})' if line else ''}: {e}") from None


def validate_template(source: str) -> None:
    """Raise ValueError unless `source` compiles as a chat template."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("chat_template: must be a non-empty string")
    _compile(source)


def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}]: only {{'type': 'text', 'text': str}} parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content: must be a string or a list of text parts")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts with string contents (text parts joined by newlines); ValueError otherwise."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages: must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role: must be a non-empty string")
        if "content" not in m:
            raise ValueError(f"messages[{i}].content: missing")
        out.append({**m, "role": role, "content": _content_text(i, m["content"])})
    return out


def _run(template: Any, variables: dict[str, Any], budget: RenderBudget) -> str:
    chunks: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**variables):
            chunks.append(chunk)
            size += len(chunk)
            budget.check_size(size)
            budget.tick()
    except TemplateError as e:
        raise ValueError(f"chat template: {e}") from None
    except RecursionError:
        raise ChatTemplateLimitError("recursed deeper than Python allows (a macro or a recursive loop without end?)",
                                     None) from None
    except (TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None
    return "".join(chunks)


# A content's placeholder in the first pass: the render's nonce (secrets.token_hex(8)) and the
# message's index. One pattern for any nonce, compiled once: a pattern per nonce would be compiled
# at every render (about 75 us, most of the substitution's time) and churn `re`'s pattern cache.
_MARK = re.compile("\ue000([0-9a-f]{16}):(\\d+)\ue001")


def render_chat(
    source: str,
    messages: Any,
    add_generation_prompt: bool,
    variables: Mapping[str, Any] | None = None,
    limits: RenderLimits | None = None,
) -> RenderedChat:
    """Render `messages` with the template `source` under `limits` (compiling and both passes
    together); see the module docstring for the two passes."""
    msgs = validate_messages(messages)
    limits = limits or RenderLimits()
    chars = sum(len(m["content"]) for m in msgs)
    if chars > limits.max_chars:  # the conversation alone is over the cap: the caller's doing, not the template's
        raise ValueError(f"messages: the conversation has {chars} characters, more than a chat may render "
                         f"(chat_template_max_chars {limits.max_chars})")
    extra = dict(variables or {})
    contents = [m["content"] for m in msgs]
    nonce = secrets.token_hex(8)
    marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(msgs))]
    with render_budget(limits) as budget:
        validate_template(source)
        template = _compile(source)
        shaped = _run(template, {**extra, "messages": [dict(m, content=k) for m, k in zip(msgs, marks, strict=True)],
                                 "add_generation_prompt": add_generation_prompt}, budget)
        real = _run(template, {**extra, "messages": msgs, "add_generation_prompt": add_generation_prompt}, budget)
    text, spans = _substitute(shaped, nonce, contents)
    if text == real:
        return RenderedChat(text, tuple(spans))
    return _locate(real, contents)


def _substitute(shaped: str, nonce: str, contents: list[str]) -> tuple[str, list[tuple[int, int]]]:
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    length = pos = 0
    for m in _MARK.finditer(shaped):
        if m.group(1) != nonce:  # marker-like text from a message or the template: text like any other
            continue
        head = shaped[pos : m.start()]
        out.append(head)
        length += len(head)
        content = contents[int(m.group(2))]
        out.append(content)
        if content:
            spans.append((length, length + len(content)))
        length += len(content)
        pos = m.end()
    out.append(shaped[pos:])
    return "".join(out), spans


def _locate(text: str, contents: list[str]) -> RenderedChat:
    """Find each content (or its stripped form) in order; a template that rewrote it may hide it."""
    spans: list[tuple[int, int]] = []
    unlocated: list[str] = []
    pos = 0
    for content in contents:
        for candidate in (content, content.strip()):
            at = text.find(candidate, pos) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                pos = at + len(candidate)
                break
        else:
            if content.strip():
                unlocated.append(content)
    return RenderedChat(text, tuple(spans), tuple(unlocated))
