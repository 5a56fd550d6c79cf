"""docs/architecture.md's dependency rules, checked by parsing every module's imports (nothing is imported).

- every part of cadence imports only parts of lower layers (`LAYERS`), but for the exceptions
  listed in `AGAINST_THE_FLOW`; inside sched/ and kv/ each module imports only those after it
  in its package's order (`PACKAGE_ORDER`);
- the pure core (request, sched/, kv/, clock, workload, routing, and the plain-data modules they share:
  config, errors, checks, boundary) imports only the standard library and itself;
- engine/core imports no torch and no asyncio, not even through the cadence modules it imports,
  and of executor/ only its protocol (executor/base);
- model/ and executor/ never import asyncio or the server;
- only server/ imports FastAPI and pydantic;
- only metrics/prometheus.py and metrics/vllm_compat.py import prometheus_client;
- only server/tracing.py imports OpenTelemetry;
- only fleet/ imports Ray, and the server knows nothing of the fleet (nor of Ray).
- pyproject.toml's strict mypy list covers the pure core;
- no module imports another's private (underscored) names.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "cadence"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}

PURE = ("cadence.request", "cadence.sched", "cadence.kv", "cadence.clock", "cadence.workload", "cadence.routing")
SHARED_PLAIN_DATA = ("cadence.config", "cadence.errors", "cadence.checks", "cadence.boundary")


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


# The parts of cadence (a top-level module, or a package), lowest layer first. A part imports only
# parts of lower layers: the vocabulary at the bottom, then the pure core (kv/, then sched/ and
# routing) with the model beside it, the executor, the engine, the exporters, and the front ends on top.
LAYERS = (
    ("checks", "clock", "errors", "wording", "workload", "host_load"),  # leaves
    ("request", "config"),
    ("boundary",),  # the records crossing the scheduler's boundary, and the stats
    ("kv", "model", "outputs"),
    ("sched", "routing", "structured"),
    ("executor",),
    ("engine",),
    ("metrics",),  # the exporters of the stats
    ("llm", "server", "bench"),
    ("sim", "fleet", "chat_client"),
    ("cli", "cadence"),  # `cadence` is the package's __init__
)
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}
# Known arrows against the flow (docs/architecture.md, "Dependencies"): `cadence sim` and the
# fleet reuse `cadence serve`'s engine flags from cli.py, which loads them lazily.
AGAINST_THE_FLOW = {("sim", "cli"), ("fleet", "cli")}
# Inside a package of the pure core: a module imports only those after it.
PACKAGE_ORDER = {
    "cadence.sched": ("scheduler", "introspect", "results", "speculation", "plan", "records", "admission", "queue", "preempt", "ngram", "draft_proposals", "adaptive", "features"),
    "cadence.kv": ("manager", "block_pool", "hashing"),
}


def part(module: str) -> str:
    """The part of cadence a module belongs to (its package, or itself at the top level)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def resolve(name: str) -> str | None:
    """The cadence module an imported name is, or is in (None outside cadence, and for the package
    root, which every import of a cadence module loads anyway)."""
    if name == "cadence" or name.startswith("cadence.__"):
        return None
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rpartition(".")[0]
    return name


def arrow_allowed(importer: str, imported: str) -> bool:
    """Whether part `importer` may import part `imported`."""
    return importer == imported or LAYER[imported] < LAYER[importer] or (importer, imported) in AGAINST_THE_FLOW


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


def test_engine_core_sees_executors_only_through_the_protocol() -> None:
    """engine/core drives any executor (the model runner, the simulator's, the tests' fakes)
    through `executor/base`'s protocol: it names no executor of its own."""
    bad = sorted(i for i in imports_of("cadence.engine.core")
                 if within(i, ("cadence.executor",)) and resolve(i) != "cadence.executor.base")
    assert not bad, f"cadence.engine.core imports {bad}"


def private_imports(module: str) -> list[str]:
    """Underscored names `module` imports from another cadence module (`from x import _y`)."""
    bad = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("cadence"):
            bad += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


@pytest.mark.parametrize("module", list(MODULES))
def test_no_module_imports_another_modules_private_names(module: str) -> None:
    assert not private_imports(module), f"{module} imports private names: {private_imports(module)}"


def test_the_pure_core_is_type_checked_strictly() -> None:
    """`make lint` runs mypy strictly on the pure core and its plain data (pyproject.toml)."""
    # (Read as text: tomllib is not in Python 3.10's standard library.)
    overrides = (SRC.parent / "pyproject.toml").read_text().split("[[tool.mypy.overrides]]")[1:]
    strict = next(o for o in overrides if "disallow_untyped_defs = true" in o)
    listed = re.search(r"module = \[(.*?)\]", strict, re.DOTALL)
    assert listed, "the strict override's module list"
    patterns = tuple(m.removesuffix(".*") for m in re.findall(r'"([\w.*]+)"', listed.group(1)))
    assert "cadence.sched" in patterns  # the parser found the list
    missing = sorted(m for m in MODULES if within(m, PURE + SHARED_PLAIN_DATA) and not within(m, patterns))
    assert not missing, f"not in pyproject.toml's strict mypy list: {missing}"


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
    assert "cadence.boundary" in imports_of("cadence.sched.scheduler")
    assert "cadence.kv.manager" in cadence_closure("cadence.engine.core")
    assert "heapq" in imports_of("cadence.sched.queue")


def test_every_part_is_in_a_layer() -> None:
    assert {part(m) for m in MODULES} == set(LAYER)


@pytest.mark.parametrize("module", list(MODULES))
def test_imports_go_down_the_layers(module: str) -> None:
    here = part(module)
    bad = sorted(i for i in imports_of(module)
                 if (target := resolve(i)) is not None and not arrow_allowed(here, part(target)))
    assert not bad, f"{module} ({here}, layer {LAYER[here]}) imports against the flow: {bad}"


@pytest.mark.parametrize("package", sorted(PACKAGE_ORDER))
def test_modules_of_a_core_package_import_in_order(package: str) -> None:
    order = PACKAGE_ORDER[package]
    inside = {m.rpartition(".")[2] for m in MODULES if m.startswith(package + ".")}
    assert inside == set(order), f"{package}: place every module in PACKAGE_ORDER"
    for k, name in enumerate(order):
        targets = {resolve(i) for i in imports_of(f"{package}.{name}")}
        bad = sorted(t for t in targets if t and t.startswith(package + ".") and t.rpartition(".")[2] not in order[k + 1:])
        assert not bad, f"{package}.{name} imports {bad}, which come before it in {order}"


def test_arrows_against_the_flow_are_caught() -> None:
    """The layer check refuses what the redesign removed: config reaching into kv/, the
    boundary records importing the scheduler, stats and the scheduler importing each other,
    and the pure core reaching the engine or the simulator."""
    for importer, imported in (("config", "kv"), ("config", "request"), ("boundary", "sched"), ("kv", "sched"),
                               ("sched", "engine"), ("sched", "sim"), ("sched", "metrics"), ("model", "sched"),
                               ("executor", "engine"), ("engine", "sim"), ("model", "executor")):
        assert not arrow_allowed(importer, imported), (importer, imported)
    assert arrow_allowed("sim", "sched") and arrow_allowed("server", "boundary")


@pytest.mark.parametrize("module", [m for m in MODULES if within(m, ("cadence.server",))])
def test_the_server_knows_nothing_of_blocks_or_the_scheduler(module: str) -> None:
    bad = sorted(i for i in imports_of(module) if within(i, ("cadence.sched", "cadence.kv")))
    assert not bad, f"{module} imports {bad}"
