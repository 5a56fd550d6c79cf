"""Every option of every cadence command says what it does: `--help` is where a user looks first."""

from __future__ import annotations

import argparse

import pytest

from cadence.cli import build_parser, readable_default
from cadence.config import OPTION_CHOICES, OPTION_HELP, engine_option_fields


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command and sub-action (`sim plan`, ...): subparsers nested under a command too."""
    out = []
    for name, p in _subparsers().items():
        out.append((name, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                out.extend((f"{name} {sub}", sp) for sub, sp in a.choices.items())
    return out


def test_every_engine_option_has_a_help_line() -> None:
    names = {f.name for _, f in engine_option_fields()}
    assert names == set(OPTION_HELP), "OPTION_HELP and the engine options differ"
    assert all(len(text) > 15 for text in OPTION_HELP.values())


@pytest.mark.parametrize("command,parser", _commands(), ids=[c for c, _ in _commands()])
def test_every_option_is_described(command: str, parser: argparse.ArgumentParser) -> None:
    for a in parser._actions:
        if not a.option_strings or a.help == argparse.SUPPRESS or "-h" in a.option_strings:
            continue
        text = (a.help or "").strip()
        bare = text.startswith("(default") or not text
        assert not bare, f"cadence {command} {a.option_strings[0]}: no description in --help"
        for raw in ("1073741824", "()", "default: None"):
            assert raw not in text, f"cadence {command} {a.option_strings[0]}: raw default {raw!r} in its help"


def test_choices_and_readable_defaults_in_serve_help(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, choices in OPTION_CHOICES.items():
        flag = "--" + name.replace("_", "-")
        assert f"{flag} {{{','.join(choices)}}}" in text, f"{flag} does not list its choices"
    assert "(default: 1GiB)" in text and "(default: fcfs)" in text
    assert readable_default("kv_cache_memory", 3 << 20) == "3MiB"
    assert readable_default("tenant_weights", ()) == "none" and readable_default("x", False) == "off"
