"""A GGUF file's metadata and tensor table, parsed in one pass over the mapped bytes.

`gguf.GGUFReader` makes numpy views for every part of every field: on SmolLM2's 49,152-token
vocabulary that took 5-6 s per open on a quiet Zen 1 (25 s on a busy one), and a worker opens its
file three or four times at start (weights, tokenizer, the `--weights auto` sizing). This reads
the same format (little-endian GGUF v2 and v3) with `struct` in well under a second, and keeps
`gguf`'s own type tables, so a tensor here looks like a `ReaderTensor` to the loader: `data` is a
read-only view of the mapped file, shaped as `GGUFReader` shapes it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")

_SCALARS: dict[int, str] = {  # GGUFValueType -> struct format
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H", gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.UINT64: "Q", gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.FLOAT64: "d",
    gguf.GGUFValueType.BOOL: "?",
}
_ELEMENT_DTYPES = {  # tensor types whose data GGUFReader gives as elements, not bytes
    gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF stores it
    n_elements: int
    n_bytes: int
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from `buf`, refusing any read past its end."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise GGUFFormatError(f"truncated: {n} bytes wanted at offset {self.at}")
        piece = self.buf[self.at:self.at + n]
        self.at += n
        return piece

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        if kind == gguf.GGUFValueType.ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind])

    def array(self) -> list[Any]:
        kind, count = self.scalar("I"), self.scalar("Q")
        if kind in _SCALARS:  # numbers in one read: vocabularies hold ~50k of them
            fmt = _SCALARS[kind]
            size = struct.calcsize(fmt)
            if count * size > len(self.buf) - self.at:
                raise GGUFFormatError(f"truncated: an array of {count} values at {self.at}")
            return np.frombuffer(self.take(count * size), dtype="<" + fmt).tolist()
        if count > len(self.buf) - self.at:  # every element takes at least one byte
            raise GGUFFormatError(f"truncated: an array of {count} values at {self.at}")
        if kind == gguf.GGUFValueType.STRING:
            return self.strings(count)
        return [self.value(kind) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop (a vocabulary and its merges: ~100k of them)."""
        buf, at, end, out = self.buf, self.at, len(self.buf), []
        for _ in range(count):
            if at + 8 > end:
                raise GGUFFormatError(f"truncated: a string wanted at offset {at}")
            (n,) = _U64.unpack_from(buf, at)
            if at + 8 + n > end:
                raise GGUFFormatError(f"truncated: a string of {n} bytes at offset {at}")
            out.append(str(buf[at + 8:at + 8 + n], "utf-8", "replace"))
            at += 8 + n
        self.at = at
        return out


class GGUFFile:
    """`metadata` (key -> int, float, bool, str or list) and `tensors`, in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        cursor = _Cursor(memoryview(self._map))
        if bytes(cursor.take(4)) != MAGIC:
            raise GGUFFormatError("no GGUF magic at the start")
        version = cursor.scalar("I")
        if version not in VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} (supported: 2, 3; little-endian)")
        n_tensors, n_fields = cursor.scalar("Q"), cursor.scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("I"))
        infos = [self._tensor_info(cursor) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or 1
        start = -(-cursor.at // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise GGUFFormatError("duplicated tensor names")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name, n_dims = cursor.string(), cursor.scalar("I")
        if not 1 <= n_dims <= 8:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cursor.scalar("Q") for _ in range(n_dims))
        return name, dims, cursor.scalar("I"), cursor.scalar("Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int,
                offset: int) -> GGUFTensor:
        try:
            kind = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError) as exc:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from exc
        n_elements = int(np.prod(dims, dtype=np.int64))
        if dims[0] % block:
            raise GGUFFormatError(f"tensor {name!r}: {dims[0]} is not a multiple of {block}")
        n_bytes = n_elements // block * type_size
        if start + offset + n_bytes > len(self._map):
            raise GGUFFormatError(f"tensor {name!r} lies past the end of the file")
        shape = tuple(reversed(dims))
        dtype = np.dtype(_ELEMENT_DTYPES.get(kind, np.uint8))
        if kind not in _ELEMENT_DTYPES:  # blocks: each row its bytes, as GGUFReader gives them
            shape = (*shape[:-1], shape[-1] // block * type_size)
        data = np.frombuffer(self._map, dtype=dtype, count=n_bytes // dtype.itemsize,
                             offset=start + offset).reshape(shape)
        return GGUFTensor(name, kind, dims, n_elements, n_bytes, data)
