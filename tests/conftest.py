"""Shared test set-up. Runs before any test module imports torch."""

import os

# See cadence/__init__.py: spinning OpenMP waiters slow every torch op on a shared CPU by 10-50x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
