"""How many times a constraint's counted repetitions (`a{1000}`, `(ab){3,}`) force a piece to repeat.

The grammar library builds its lexer lazily: a regex that must repeat something hundreds of
thousands of times compiles, and then fails at the first token that walks into the repetition
("too many expressions constructed"), in the middle of generation. Counting the forced
repetitions up front lets such a constraint be refused before its request runs.

Only lower bounds count: `.{0,100000}` is cheap for the library, `a{300000}` is not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from cadence.request import StructuredOutputsParams

DEFAULT_MAX_FORCED_REPEAT = 100_000  # the most times nested counted repetitions may force a piece

_COUNT = re.compile(r"\{(\d+)(?:,\d*)?\}")
# `\x{41}`, `\u{41}`, `\p{Greek}`: braces that belong to an escape, not a repetition
_ESCAPE_BRACES = frozenset("xupPN")


def forced_repeat(regex: str) -> int:
    """The largest product of nested repetition lower bounds in `regex` (1 when there are none).

    A scan, not a parser: character classes and escapes are skipped, groups nest, and a
    repetition multiplies the atom it follows (a group's value is the largest inside it)."""
    groups = [1]  # the largest value seen so far in each open group
    last = 1  # the value of the atom just read, which a repetition multiplies
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            i = _skip_escape(regex, i)
            last = 1
            continue
        if c == "[":
            i = _skip_class(regex, i)
            last = 1
            continue
        if c == "(":
            groups.append(1)
            last = 1
        elif c == ")":
            last = groups.pop() if len(groups) > 1 else 1
        elif c == "{" and (m := _COUNT.match(regex, i)) is not None:
            last *= int(m.group(1))
            i = m.end()
            groups[-1] = max(groups[-1], last)
            continue
        else:
            last = 1
        groups[-1] = max(groups[-1], last)
        i += 1
    return max(groups)


def _skip_escape(regex: str, i: int) -> int:
    j = i + 2
    if i + 1 < len(regex) and regex[i + 1] in _ESCAPE_BRACES and j < len(regex) and regex[j] == "{":
        end = regex.find("}", j)
        return len(regex) if end < 0 else end + 1
    return j


def _skip_class(regex: str, i: int) -> int:
    """Past the `]` that closes the class opened at `i` (classes nest in the library's syntax)."""
    depth, j = 0, i
    while j < len(regex):
        c = regex[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and j > i + 1 and depth:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return j


def _schema_patterns(node: Any) -> Iterator[str]:
    """Every regex in a JSON schema: `pattern` values and `patternProperties` keys, at any depth."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            pattern = cur.get("pattern")
            if isinstance(pattern, str):
                yield pattern
            props = cur.get("patternProperties")
            if isinstance(props, dict):
                yield from (k for k in props if isinstance(k, str))
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# a `"pattern": "..."` of a JSON schema written into a grammar (llguidance's `%json {...}`)
_JSON_PATTERN = re.compile(r'"pattern"\s*:\s*("(?:[^"\\]|\\.)*")')


def _grammar_regexes(grammar: str) -> list[str]:
    """A grammar's text with its double-quoted literals removed (their braces are plain text), and
    the patterns of the JSON schemas written in it."""
    regexes = [_STRING.sub('""', grammar)]
    for m in _JSON_PATTERN.finditer(grammar):
        try:
            regexes.append(json.loads(m.group(1)))
        except ValueError:
            continue  # not JSON: the compiler says so
    return regexes


def check_forced_repeat(spec: StructuredOutputsParams, field: str, limit: int = DEFAULT_MAX_FORCED_REPEAT) -> None:
    """ValueError naming `field` when a regex in `spec` forces more than `limit` repetitions."""
    if spec.regex is not None:
        regexes: list[str] = [spec.regex]
    elif spec.grammar is not None:
        regexes = _grammar_regexes(spec.grammar)
    elif spec.json is not None:
        try:
            regexes = list(_schema_patterns(json.loads(spec.json)))
        except ValueError:
            return  # not JSON: the compiler says so
    else:
        return
    for regex in regexes:
        if (count := forced_repeat(regex)) > limit:
            raise ValueError(f"{field}: a counted repetition forces {count:,} repeats, more than the limit of "
                             f"{limit:,} (the grammar library cannot follow it); lower its minimum")
