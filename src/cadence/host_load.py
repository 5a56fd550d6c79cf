"""Whether this machine is too busy for timings to mean much (a shared or overloaded host)."""

from __future__ import annotations

import os

BUSY_LOAD_PER_CPU = 0.5  # a 1-minute load average above half the CPUs


def busy_warning(advice: str) -> str | None:
    """A warning line when the load average says other work competes for the CPUs, else None."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= BUSY_LOAD_PER_CPU * cores:
        return None
    return f"warning: the machine is busy (load average {load:.1f} on {cores} CPUs): timings will be slow and noisy; {advice}"
