"""Every shell command in README.md and docs/ still works, so an example cannot rot.

Each command line of a shell code block is checked without the server it may need: a `cadence`
command must parse with cadence's own parser (every flag exists, every value is accepted) and every
repository file it names must exist; a `benchmarks/` script must exist and know each flag it is
given (its `--help`); `make` targets must exist in the Makefile. The commands that finish in
seconds on their own (no server, no long simulation) are also run, and must exit as documented.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from cadence.cli import build_parser
from cadence.sim.profile import shipped_profiles

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = ("", "bash", "sh", "shell", "console")
COMMANDS = ("cadence", "make", "python", "curl", "pip", "cmake", "cd", "tar", "git")
# Example names that stand for the reader's own files, not files of this repository.
PLACEHOLDERS = {"requests.jsonl", "path/to/model.gguf", "/path/to/model.gguf", "my_profile.json", "quick.json",
                "m.json", "results.jsonl", "p.json"}
FILE_FLAGS = {"--trace", "--requests-file", "--profile", "--input"}
# Commands that finish in seconds without a server: run, not just parsed.
RUN = [
    ("cadence serve --help", 0),
    ("cadence sim plan --workload chat --num-requests 1000 --rate 20 --slo ttft_p95=1", 0),
    ("cadence sim plan --trace traces/azure_llm_2023_code.csv --rate-scale 10 --slo ttft_p95=1.0", 1),  # infeasible
]


def _command_lines() -> list[tuple[str, str]]:
    """(doc:line, command) for every command line of every shell block, continuations joined."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if m.group(1) not in SHELLS:
                continue
            first = text[: m.start(2)].count("\n") + 1
            lines = m.group(2).split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                line = line.strip().removeprefix("$ ")
                words = line.split()
                if words and (words[0].removeprefix(".venv/bin/") in COMMANDS or words[0].startswith(".venv/bin/")):
                    out.append((f"{doc.relative_to(ROOT)}:{first + start}", line))
    return out


def _argv(line: str) -> list[str]:
    """The command's words: no comment, no trailing `&`, no `.venv/bin/` prefix."""
    words = shlex.split(line, comments=True)
    if words and words[-1] == "&":
        words.pop()
    if words:
        words[0] = words[0].removeprefix(".venv/bin/")
    return words


LINES = _command_lines()


def test_the_docs_have_commands_to_check() -> None:
    assert len(LINES) > 40 and any(c.startswith(("cadence", ".venv/bin/cadence")) for _, c in LINES)


@pytest.mark.parametrize("where,line", [x for x in LINES if _argv(x[1])[:1] == ["cadence"]],
                         ids=[w for w, c in LINES if _argv(c)[:1] == ["cadence"]])
def test_cadence_command_parses_and_its_files_exist(where: str, line: str) -> None:
    argv = _argv(line)[1:]
    if any(w.startswith("[") for w in argv):
        return  # a synopsis (`cadence serve [MODEL] [--port PORT] ...`), not a command
    if "--help" in argv:
        return  # run below where cheap; parsing it would only print the help
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `{line}` does not parse (exit {e.code})")
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--profile" and value in shipped_profiles():
            continue  # a shipped profile's short name
        if value.startswith("results/"):
            continue  # written by a command shown before it (results/ is where the docs' commands write)
        if flag in FILE_FLAGS and value not in PLACEHOLDERS:
            assert (ROOT / value).exists(), f"{where}: {flag} {value}: no such file in the repository"
    for word in argv:
        if word.startswith(("traces/", "benchmarks/", "docs/", "examples/")):
            assert (ROOT / word).exists(), f"{where}: {word}: no such file in the repository"


@cache
def _script_flags(script: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, f"{script} --help failed: {proc.stderr[-500:]}"
    return proc.stdout


@pytest.mark.parametrize("where,line", [x for x in LINES if "benchmarks/" in x[1] and "python" in x[1]],
                         ids=[w for w, c in LINES if "benchmarks/" in c and "python" in c])
def test_benchmark_script_exists_and_knows_its_flags(where: str, line: str) -> None:
    argv = _argv(line)
    script = next(w for w in argv if w.startswith("benchmarks/"))
    assert (ROOT / script).is_file(), f"{where}: {script}: no such script"
    help_text = _script_flags(script)
    for word in argv:
        if word.startswith("--") and not word.startswith("--help"):
            flag = word.split("=", 1)[0]
            assert flag in help_text, f"{where}: {script} does not take {flag}"


def test_make_targets_exist() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    used = {_argv(c)[1] for _, c in LINES if _argv(c)[:1] == ["make"] and len(_argv(c)) > 1}
    assert used and used <= targets, f"make targets the docs use but the Makefile lacks: {used - targets}"


@pytest.mark.parametrize("line,status", RUN)
def test_cheap_commands_run(line: str, status: int) -> None:
    assert any(_argv(c) == _argv(line) for _, c in LINES), f"`{line}` is no longer in the docs: update RUN"
    argv = _argv(line)
    proc = subprocess.run([sys.executable, "-m", "cadence.cli", *argv[1:]], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == status, f"`{line}` exited {proc.returncode}: {proc.stderr[-800:]}"
    assert proc.stdout.strip()
