"""Where the shipped cost profile lives: `default_profile_path`, defined beside the cost model
(the engine reads the profile too, to predict a waiting request's time to first token, and the
engine may not import the simulator), and named here for the simulator's readers."""

from __future__ import annotations

from cadence.executor.cost_model import default_profile_path

__all__ = ["default_profile_path"]
