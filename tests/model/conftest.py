"""Fixtures shared by the real-model tests: the transformers reference and each prompt run alone."""

from __future__ import annotations

import pytest
from test_parity_real import Job, Reference, build_reference, run_jobs


@pytest.fixture(scope="module")
def ref() -> Reference:
    """transformers and cadence on the default model's weights, float32 on the CPU (one per module)."""
    return build_reference()


@pytest.fixture(scope="module")
def alone(ref: Reference) -> dict[str, Job]:
    """Each prompt generated alone on the CPU, whole prompt in one chunk: the batched and CUDA runs'
    reference."""
    return {f"p{i}": run_jobs(ref.runner, [Job(f"p{i}", p)], seed=i)[f"p{i}"] for i, p in enumerate(ref.prompts)}
