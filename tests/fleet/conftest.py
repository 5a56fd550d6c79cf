"""The fleet tests' module-scoped fleet (fleet_helpers.running_fleet): one Ray cluster at a time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fleet_helpers import Fleet, running_fleet


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with running_fleet() as f:
        yield f
