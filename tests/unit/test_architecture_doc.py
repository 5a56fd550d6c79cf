"""docs/architecture.md names what a newcomer should open: its links and names must exist.

- every relative link of the page points at a file or folder of the repository;
- every `Class.member` it names is defined on that class (or a base the page names with it: a
  member of a class's bases counts), read from the source without importing it;
- in "Where each decision is made", every function or class a row names is defined in one of the
  files that row links (so the table sends a reader to the right file).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SRC = ROOT / "src" / "cadence"
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Z]\w*\.\w+")
NAME = re.compile(r"[A-Za-z_]\w*")


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n for t in node.targets for n in _target_names(t)]
    if isinstance(node, ast.AnnAssign):
        return _target_names(node.target)
    return []


def _target_names(t: ast.AST) -> list[str]:
    if isinstance(t, ast.Name):
        return [t.id]
    if isinstance(t, ast.Attribute):
        return [t.attr]
    if isinstance(t, ast.Tuple):
        return [n for e in t.elts for n in _target_names(e)]
    return []


@cache
def _defined(path: Path) -> frozenset[str]:
    """Every name a module defines anywhere: functions, classes, assignments (self.x too)."""
    names: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        names.update(_targets(node))
    return frozenset(names)


@cache
def _classes() -> dict[str, list[tuple[set[str], list[str]]]]:
    """class name -> (its members, the names of its bases), for every class of the package."""
    out: dict[str, list[tuple[set[str], list[str]]]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                members = {n for b in ast.walk(node) for n in ([b.name] if isinstance(
                    b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else _targets(b))}
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                out.setdefault(node.name, []).append((members, bases))
    return out


def _has_member(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    for members, bases in _classes().get(cls, []):
        if member in members or any(_has_member(b, member, seen | {cls}) for b in bases if b not in seen):
            return True
    return False


def _decision_rows(text: str) -> list[str]:
    section = text.split("## 3. Where each decision is made", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "](" in line]


def _row_names(cell: str) -> list[str]:
    """The code names of a row's last cell, outside parentheses (which explain, not name)."""
    depth, kept = 0, []
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            kept.append(ch)
        depth -= ch == ")" and depth > 0
    names = []
    for code in CODE.findall("".join(kept)):
        code = code.split("(")[0]
        if re.fullmatch(r"[A-Za-z_][\w.]*", code):
            names.append(code.rsplit(".", 1)[-1])
    return names


def check_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if "://" not in t and not (DOC.parent / t).resolve().exists()]


def check_members(text: str) -> list[str]:
    bad = []
    for code in CODE.findall(text):
        for ref in DOTTED.findall(code):
            cls, member = ref.split(".", 1)
            if cls in _classes() and not _has_member(cls, member):
                bad.append(ref)
    return sorted(set(bad))


def check_decisions(text: str) -> list[str]:
    bad = []
    for row in _decision_rows(text):
        cells = row.strip("|").split(" | ")
        files = [(DOC.parent / t).resolve() for t in LINK.findall(cells[1])]
        files = [f for f in files if f.suffix == ".py"]
        defined = set().union(*(_defined(f) for f in files)) if files else set()
        bad += [f"{cells[0]}: {n}" for n in _row_names(cells[-1]) if n not in defined]
    return bad


def test_every_link_of_the_page_exists() -> None:
    text = DOC.read_text()
    assert len(LINK.findall(text)) > 50  # the parser found the links
    assert not check_links(text)


def test_every_class_member_the_page_names_exists() -> None:
    assert not check_members(DOC.read_text())


def test_every_decision_is_defined_in_the_files_its_row_links() -> None:
    text = DOC.read_text()
    assert len(_decision_rows(text)) > 20  # the parser found the table
    assert not check_decisions(text)


def test_the_checks_can_fail() -> None:
    """A renamed method, a wrong file for a decision and a dead link are each caught."""
    text = DOC.read_text()
    assert check_members(text.replace("`Scheduler.finish`", "`Scheduler._finish`")) == ["Scheduler._finish"]
    moved = text.replace("| [sched/preempt.py](../src/cadence/sched/preempt.py) | `PreemptionPolicy.choose_victim`",
                         "| [sched/queue.py](../src/cadence/sched/queue.py) | `PreemptionPolicy.choose_victim`")
    assert moved != text and any(b.endswith(": choose_victim") for b in check_decisions(moved))
    assert check_links(text + "\n[x](../src/cadence/nowhere.py)\n") == ["../src/cadence/nowhere.py"]
