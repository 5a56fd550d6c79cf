"""DESIGN.md's dependency rules, checked by parsing every module's imports (nothing is imported).

- the pure core (request, sched/, kv/, clock, workload, routing, and the plain-data modules they share:
  config, errors, metrics/stats) imports only the standard library and itself;
- engine/core imports no torch and no asyncio, not even through the cadence modules it imports;
- model/ and executor/ never import asyncio or the server;
- only server/ imports FastAPI and pydantic;
- only metrics/prometheus.py and metrics/vllm_compat.py import prometheus_client;
- only server/tracing.py imports OpenTelemetry;
- only fleet/ imports Ray, and the server knows nothing of the fleet (nor of Ray).
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "cadence"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}

PURE = ("cadence.request", "cadence.sched", "cadence.kv", "cadence.clock", "cadence.workload", "cadence.routing")
SHARED_PLAIN_DATA = ("cadence.config", "cadence.errors", "cadence.metrics.stats")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def parse_imports(source: str, package: str) -> set[str]:
    """Absolute names of everything `source` imports, anywhere in the file (functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{a.name}" for a in node.names)  # may name a submodule
    return found


@cache
def imports_of(module: str) -> frozenset[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    # `from a.b import C` also yields "a.b.C": harmless, every rule below matches by prefix.
    return frozenset(parse_imports(path.read_text(), package))


def cadence_closure(module: str) -> set[str]:
    """`module` and every cadence module it reaches through imports."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen or m not in MODULES:
            continue
        seen.add(m)
        todo.extend(i for i in imports_of(m) if i.startswith("cadence"))
    return seen


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_package_is_found() -> None:
    assert "cadence.sched.scheduler" in MODULES and "cadence.engine.core" in MODULES


@pytest.mark.parametrize("module", [m for m in MODULES if within(m, PURE + SHARED_PLAIN_DATA)])
def test_pure_core_imports_only_stdlib_and_itself(module: str) -> None:
    bad = sorted(i for i in imports_of(module) if top(i) not in STDLIB and not within(i, PURE + SHARED_PLAIN_DATA))
    assert not bad, f"{module} imports {bad}"


def test_engine_core_pulls_in_no_torch_and_no_asyncio() -> None:
    reached = cadence_closure("cadence.engine.core")
    offenders = {m: sorted(top(i) for i in imports_of(m) if top(i) in {"torch", "asyncio"}) for m in reached}
    assert not {m: v for m, v in offenders.items() if v}


@pytest.mark.parametrize("module", [m for m in MODULES if within(m, ("cadence.model", "cadence.executor"))])
def test_model_and_executor_stay_off_asyncio_and_the_server(module: str) -> None:
    bad = sorted(i for i in imports_of(module) if top(i) == "asyncio" or within(i, ("cadence.server",)))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", list(MODULES))
def test_web_and_exporter_libraries_stay_in_their_modules(module: str) -> None:
    tops = {top(i) for i in imports_of(module)}
    if not within(module, ("cadence.server",)):
        assert not tops & {"fastapi", "pydantic"}, f"{module} imports FastAPI/pydantic outside server/"
    if module not in ("cadence.metrics.prometheus", "cadence.metrics.vllm_compat"):
        assert "prometheus_client" not in tops, f"{module} imports prometheus_client"
    if module != "cadence.server.tracing":  # the OpenTelemetry SDK is loaded only when tracing is on
        assert "opentelemetry" not in tops, f"{module} imports OpenTelemetry"


@pytest.mark.parametrize("module", list(MODULES))
def test_ray_stays_in_the_fleet(module: str) -> None:
    imported = imports_of(module)
    if not within(module, ("cadence.fleet",)):
        assert "ray" not in {top(i) for i in imported}, f"{module} imports Ray outside fleet/"
    if within(module, ("cadence.server",)):
        assert not any(within(i, ("cadence.fleet",)) for i in imported), f"{module} imports the fleet"


def test_the_checker_resolves_relative_nested_and_from_imports() -> None:
    # Guard against a checker that silently finds nothing.
    src = "from . import queue\nfrom ..kv.manager import X\ndef f():\n    import torch\n"
    found = parse_imports(src, "cadence.sched")
    assert {"cadence.sched.queue", "cadence.kv.manager", "torch"} <= found
    assert "cadence.sched.output" in imports_of("cadence.sched.scheduler")
    assert "cadence.kv.manager" in cadence_closure("cadence.engine.core")
    assert "heapq" in imports_of("cadence.sched.queue")
