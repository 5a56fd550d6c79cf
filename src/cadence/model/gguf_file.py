"""Opening a GGUF file safely: validate every length field against the file size, then hand it to gguf.

`gguf.GGUFReader` trusts the header: an array that claims 2**63 scalar elements past the end of the
file makes it loop forever, and a huge tensor count makes it build millions of records. So before the
reader sees a file, `validate_gguf` walks the same header with bounds checks only (no values kept),
and proves that every string, array and tensor lies inside the file. The walk is cheap: the big
vocabulary arrays are skipped by arithmetic where elements have a fixed size.
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAX_DIMS = 4  # ggml tensors have at most four dimensions
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type tag, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims, type, offset
_MAX_ARRAY_NESTING = 2


class LoadError(ValueError):
    """A model file that cannot be used: missing, truncated, corrupted or unsupported. One line."""


class _Truncated(Exception):
    pass


class _Cursor:
    """Bounds-checked little-endian reads over a memory map."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(self.pos)
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return bytes(self.buf[start : start + n])

    def skip_string(self) -> None:
        self.take(self.u64())


def _scalar_sizes() -> dict[int, int]:
    from gguf import GGUFReader

    return {int(t): np.dtype(np_type).itemsize for t, np_type in GGUFReader.gguf_scalar_to_np.items()}


def _skip_value(cur: _Cursor, vtype: int, sizes: dict[int, int], depth: int = 0) -> None:
    from gguf import GGUFValueType

    if vtype in sizes:
        cur.take(sizes[vtype])
    elif vtype == GGUFValueType.STRING:
        cur.skip_string()
    elif vtype == GGUFValueType.ARRAY and depth < _MAX_ARRAY_NESTING:
        itype, count = cur.u32(), cur.u64()
        left = cur.size - cur.pos
        if itype in sizes:
            if count * sizes[itype] > left:
                raise ValueError(f"an array of {count} elements runs past the end of the file")
            cur.take(count * sizes[itype])
            return
        if count * 8 > left:  # every string or nested array takes at least 8 bytes
            raise ValueError(f"an array of {count} elements runs past the end of the file")
        for _ in range(count):
            _skip_value(cur, itype, sizes, depth + 1)
    else:
        raise ValueError(f"unknown metadata value type {vtype}")


def _tensor_infos(cur: _Cursor, count: int) -> tuple[list[tuple[str, int, int, int]], int]:
    """(name, type, n_bytes, offset) per tensor, and where the tensor infos end."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    infos = []
    for _ in range(count):
        name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = [cur.u64() for _ in range(n_dims)]
        raw_type, offset = cur.u32(), cur.u64()
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name} has unknown type {raw_type}") from None
        n_elems = 1
        for d in dims:
            n_elems *= d
        if dims[0] % block or n_elems > 1 << 48:
            raise ValueError(f"tensor {name} has an impossible shape {dims} for {qtype.name}")
        infos.append((name, raw_type, n_elems // block * type_size, offset))
    return infos, cur.pos


def validate_gguf(path: Path) -> None:
    """Raise LoadError unless every length and offset in the file's header lies inside the file."""
    size = path.stat().st_size
    if size < 24:
        raise LoadError(f"{path}: not a GGUF file (only {size} bytes)")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise LoadError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        try:
            _walk(_Cursor(buf, size), size)
        except _Truncated as t:
            raise LoadError(f"{path}: truncated or corrupt GGUF header (a field at byte {t.args[0]} runs past the end)") from None
        except ValueError as e:
            raise LoadError(f"{path}: corrupt GGUF file ({e})") from None


def _walk(cur: _Cursor, size: int) -> None:
    from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValueType

    cur.take(4)
    version = cur.u32()
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    if n_tensors * _MIN_TENSOR_INFO_BYTES > size or n_kv * _MIN_KV_BYTES > size:
        raise ValueError(
            f"the header claims {n_tensors} tensors and {n_kv} metadata keys, more than {size} bytes can hold; truncated?"
        )
    sizes = _scalar_sizes()
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.u32()
        if key == b"general.alignment" and vtype == GGUFValueType.UINT32:
            alignment = struct.unpack_from("<I", cur.buf, cur.pos)[0] if cur.pos + 4 <= size else 0
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment} is not a power of two")
        _skip_value(cur, vtype, sizes)
    infos, end = _tensor_infos(cur, n_tensors)
    data_start = -(-end // alignment) * alignment
    for name, _, n_bytes, offset in infos:
        if data_start + offset + n_bytes > size:
            raise ValueError(f"tensor {name} ends at byte {data_start + offset + n_bytes}, past the end ({size}); truncated?")


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over a validated file; any remaining reader error becomes a LoadError.

    Readers are cached by (path, size, mtime): the engine opens the same file for the tokenizer and
    for the weights, and building a reader walks ~100k vocabulary strings in Python (seconds).
    """
    path = Path(path)
    if not path.is_file():
        raise LoadError(f"{path}: not a regular file" if path.exists() else f"{path}: no such file")
    try:
        st = path.stat()
        return _open_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise LoadError(f"{path}: {e.strerror or e}") from None


@functools.lru_cache(maxsize=2)
def _open_cached(path_str: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    path = Path(path_str)
    validate_gguf(path)
    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as e:
        raise LoadError(f"{path}: corrupt GGUF file ({e})") from None


def field_value(reader: Any, key: str) -> Any:
    """A metadata value as plain Python (str, int, float, bool, list), or None when absent."""
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except (UnicodeDecodeError, IndexError, ValueError) as e:
        where = getattr(reader.data, "filename", None) or "GGUF file"
        raise LoadError(f"{where}: metadata key {key} is unreadable ({e})") from None
