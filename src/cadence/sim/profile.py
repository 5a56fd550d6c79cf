"""Where the shipped cost profile lives.

A module of its own so that `cadence sim` finds the profile without importing the calibration
code, which needs torch and the model (the simulator needs neither).
"""

from __future__ import annotations

from pathlib import Path


def default_profile_path() -> Path:
    """The profile shipped with cadence: the default model on this project's machine (docs/simulator.md)."""
    return Path(__file__).parent / "profiles" / "default.json"
