"""Where the shipped cost profiles live.

A module of its own so that `cadence sim` finds the profile without importing the calibration
code, which needs torch and the model (the simulator needs neither).
"""

from __future__ import annotations

from pathlib import Path


def default_profile_path() -> Path:
    """The profile shipped with cadence: the default model on this project's machine (docs/simulator.md)."""
    return Path(__file__).parent / "profiles" / "default.json"


def shipped_profiles() -> list[str]:
    """The shipped profiles' short names (`--profile NAME`): `gpu_like_8b.json` is `gpu-like-8b`."""
    return sorted(p.stem.replace("_", "-") for p in (Path(__file__).parent / "profiles").glob("*.json"))


def shipped_profile(name: str) -> Path | None:
    """The shipped profile called `name` (see `shipped_profiles`), or None."""
    if name not in shipped_profiles():
        return None
    return Path(__file__).parent / "profiles" / f"{name.replace('-', '_')}.json"
