"""Type checks shared by the validators of requests and of the configuration. Standard library only."""

from __future__ import annotations

import math
from typing import TypeGuard


def is_int(x: object) -> TypeGuard[int]:
    """An integer that is not a bool: `max_tokens=True` is a mistake, not 1."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_finite(x: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
