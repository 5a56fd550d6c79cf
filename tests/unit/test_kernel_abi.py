"""The C kernels' boundary, checked from the source: a mismatch there is a segfault, not an error.

Parses every exported `cadence_*` definition of kernels/cpu_bf16.c and checks model/cpu_kernels.py
against it: the ctypes argument and return types, the `DL_*` layout of a decode layer's pointer
row, and the constants both sides state. Needs no compiler and no AVX512: it reads text.
"""

from __future__ import annotations

import ctypes
import re
import sys

import pytest

from cadence.model import cpu_kernels as ck

SOURCE = ck.SOURCE.read_text()
_CTYPE = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


def _exported() -> dict[str, tuple[type | None, list[type]]]:
    """name -> (return type, argument types) of every non-static `cadence_*` definition."""
    out = {}
    for m in re.finditer(r"^(void|int)\s+(cadence_\w+)\(([^)]*)\)\s*\{", SOURCE, re.MULTILINE):
        ret, name, params = m.groups()
        args = []
        for p in params.split(","):
            p = " ".join(p.replace("const", "").split())
            if "*" in p:
                args.append(ctypes.c_void_p)
            else:
                base = p.rsplit(" ", 1)[0]
                assert base in _CTYPE, f"{name}: parameter {p!r} of a type this test does not know"
                args.append(_CTYPE[base])
        out[name] = (None if ret == "void" else _CTYPE[ret], args)
    return out


def _define(name: str) -> int:
    m = re.search(rf"^#define {name} (\S+)", SOURCE, re.MULTILINE)
    assert m, f"#define {name} not found"
    return int(m.group(1))


def test_every_exported_function_has_its_c_signature() -> None:
    c = _exported()
    assert len(c) >= 12  # the parser found the definitions, not an empty set
    assert set(c) == set(ck._SIGNATURES), "exported functions and _SIGNATURES differ"
    for name, (ret, args) in c.items():
        py_ret, py_args = ck._SIGNATURES[name]
        assert py_ret == ret, f"{name}: return type"
        assert len(py_args) == len(args), f"{name}: {len(py_args)} ctypes arguments for {len(args)} in C"
        for i, (p, want) in enumerate(zip(py_args, args, strict=True)):
            assert p == want, f"{name}: argument {i} is {want.__name__} in C, {p.__name__} in Python"


def test_decode_layer_pointer_row_matches_the_c_enum() -> None:
    m = re.search(r"enum\s*\{([^}]*)\}", SOURCE)
    assert m, "the DL_* enum"
    names = [n.strip() for n in m.group(1).split(",") if n.strip()]
    assert names[-1] == "DL_FIELDS"
    assert [n.removeprefix("DL_").lower() for n in names[:-1]] == list(ck.DL_FIELDS)


@pytest.mark.parametrize("c_name,py_value", [
    ("Q8_RAW_BYTES", ck.Q8_0_BYTES), ("Q4_0_RAW_BYTES", ck.Q4_0_BYTES),
    ("MAX_GROUP", ck.MAX_GROUP), ("MAX_DIM", ck.MAX_HEAD_DIM), ("NB", ck.BLOCK_COLS), ("QK", ck.Q4_1_BLOCK),
    ("Q4_RAW_BYTES", ck.Q4_1_BYTES), ("KV8_SCALE_BYTES", ck.KV8_SCALE_BYTES),
])
def test_constants_agree(c_name: str, py_value: int) -> None:
    assert _define(c_name) == py_value


def test_a_changed_prototype_is_caught(monkeypatch) -> None:
    """The check itself can fail: one argument's type changed in the parsed source."""
    broken = SOURCE.replace("void cadence_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t m, int64_t f,",
                            "void cadence_silu_mul(const uint16_t *gate_up, uint16_t *out, int m, int64_t f,")
    assert broken != SOURCE
    monkeypatch.setattr(sys.modules[__name__], "SOURCE", broken)
    with pytest.raises(AssertionError, match="cadence_silu_mul: argument 2"):
        test_every_exported_function_has_its_c_signature()


def _header() -> str:
    """The source's opening comment, the kernels' table of contents."""
    m = re.match(r"/\*(.*?)\*/", SOURCE, re.DOTALL)
    assert m, "the opening comment"
    return m.group(1)


def test_the_header_lists_every_export() -> None:
    listed = set(re.findall(r"\bcadence_\w+", _header()))
    assert listed == set(_exported()), "the header of cpu_bf16.c and its exported functions differ"


def test_an_export_missing_from_the_header_is_caught(monkeypatch) -> None:
    """The check itself can fail: one export dropped from the header."""
    broken = SOURCE.replace(" *   cadence_sample ", " *   sampling ", 1)
    assert broken != SOURCE
    monkeypatch.setattr(sys.modules[__name__], "SOURCE", broken)
    with pytest.raises(AssertionError, match="header"):
        test_the_header_lists_every_export()
