"""Importing a script of benchmarks/ as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(script: str, module_name: str | None = None) -> ModuleType:
    """benchmarks/`script`.py, executed as the module `module_name` (default: the script's name).
    It is registered in sys.modules first: dataclasses look their module up while being made."""
    name = module_name or script
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
