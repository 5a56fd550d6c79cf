"""Whether this machine is too busy for timings to mean much (a shared or overloaded host), and
what it is (for the record of a measurement)."""

from __future__ import annotations

import os
from pathlib import Path

BUSY_LOAD_PER_CPU = 0.5  # a 1-minute load average above half the CPUs


def busy_warning(advice: str) -> str | None:
    """A warning line when the load average says other work competes for the CPUs, else None."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= BUSY_LOAD_PER_CPU * cores:
        return None
    return f"warning: the machine is busy (load average {load:.1f} on {cores} CPUs): timings will be slow and noisy; {advice}"


def cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (/proc/cpuinfo), or None elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
