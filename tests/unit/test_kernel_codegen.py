"""The compiled kernels: the bfloat16 attention carries none of the 8-bit cache's code.

Compiles kernels/cpu_bf16.c as the package does (`cpu_kernels._build`, the same flags; no AVX512
needed to compile) and reads the machine code of its two attention instantiations with objdump.
A test of the generated code rather than of results: the bits are the same either way, what is
checked is that the bfloat16 cache's chunk loop pays nothing for the 8-bit one.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from cadence.model import cpu_kernels as ck

# Instructions only the 8-bit cache's loads use: int8 -> int32 widening, and two float32 vectors
# packed into one of bfloat16 (the bfloat16 path loads its pairs as they are stored).
KV8_ONLY = ("vpmovsxbd", "vcvtne2ps2bf16")


@pytest.fixture(scope="module")
def disassembly() -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    objdump = shutil.which("objdump")
    if compiler is None or objdump is None:
        pytest.skip("needs a C compiler and objdump (binutils) to read the generated code")
    library = ck._build(compiler)
    return subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True).stdout


def body(disassembly: str, name: str) -> str:
    """The instructions of one function of objdump's output (up to the blank line that ends it)."""
    m = re.search(rf"^[0-9a-f]+ <{re.escape(name)}>:\n(.*?)\n\n", disassembly, re.MULTILINE | re.DOTALL)
    assert m is not None, f"{name} is not a function of the compiled kernels"
    return m.group(1)


def test_bfloat16_attention_has_no_8bit_code(disassembly: str) -> None:
    bf16 = body(disassembly, "attend_tile_bf16")
    assert "vdpbf16ps" in bf16  # the scores: this is the attention loop
    assert not [op for op in KV8_ONLY if op in bf16]
    assert "kv8" not in bf16  # nor a call into the 8-bit loader


def test_8bit_attention_is_where_that_code_is(disassembly: str) -> None:
    kv8 = body(disassembly, "attend_tile_kv8")
    assert all(op in kv8 for op in KV8_ONLY)


@pytest.mark.parametrize("kernel", ["cadence_decode_attention", "cadence_prefill_attention"])
def test_bfloat16_kernels_call_the_bfloat16_instantiation(disassembly: str, kernel: str) -> None:
    # the OpenMP body of each kernel is the function that calls the instantiation
    calls = re.findall(r"call\s+[0-9a-f]+ <(attend_tile\w*)>", body(disassembly, f"{kernel}._omp_fn.0"))
    assert calls and set(calls) == {"attend_tile_bf16"}
