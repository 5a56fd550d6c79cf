"""Counts in messages: "1 request", "2 requests"."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, singular for exactly one (`plural` where adding an s is wrong)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
