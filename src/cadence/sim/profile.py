"""Where the shipped cost profiles live. `default_profile_path` is defined beside the cost model
(the engine reads the profile too, to predict a waiting request's time to first token, and the
engine may not import the simulator) and named here for the simulator's readers; the others are
found by their short names."""

from __future__ import annotations

from pathlib import Path

from cadence.executor.cost_model import default_profile_path

__all__ = ["default_profile_path", "shipped_profile", "shipped_profiles"]


def shipped_profiles() -> list[str]:
    """The shipped profiles' short names (`--profile NAME`): `gpu_like_8b.json` is `gpu-like-8b`."""
    return sorted(p.stem.replace("_", "-") for p in (Path(__file__).parent / "profiles").glob("*.json"))


def shipped_profile(name: str) -> Path | None:
    """The shipped profile called `name` (see `shipped_profiles`), or None."""
    if name not in shipped_profiles():
        return None
    return Path(__file__).parent / "profiles" / f"{name.replace('-', '_')}.json"
