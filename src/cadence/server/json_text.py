"""JSON text a client or a model wrote, parsed with nesting too deep to parse as a ValueError.

Python's parser recurses once per level of nesting and raises RecursionError (not a ValueError)
past the interpreter's limit, so `"[" * 5000` would escape every `except ValueError` that turns bad
input into a 400 (or, for a model's output, into plain text)."""

from __future__ import annotations

import json
from typing import Any

TOO_DEEP = "nested too deeply (past Python's recursion limit)"


def parse_json(text: str) -> Any:
    """`json.loads(text)`; a ValueError for text that is not JSON or is nested too deeply."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None
