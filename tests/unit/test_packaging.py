"""The package builds without setuptools' deprecation warnings (project.license as a TOML table was one)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_builds_without_warnings_and_declares_its_licence(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    log = done.stdout + done.stderr
    assert "BuildBackendWarning" not in log and "project.license" not in log, log[-3000:]
    (wheel,) = tmp_path.glob("cadence-*.whl")
    with zipfile.ZipFile(wheel) as z:
        metadata = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in z.read(metadata).decode().splitlines()
