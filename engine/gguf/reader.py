"""Read a GGUF file: header, key/value metadata and the tensor index, with tensor data memory-mapped.

The `gguf` package defines the format (value types, quantization types, block sizes) and we use its
constants. Its GGUFReader builds a numpy view per string, which takes ~9 s for a 262K-token vocabulary,
so the header is parsed here directly (tests cross-check every field against GGUFReader).

Every problem with the file (missing, truncated, bad magic, corrupt header) becomes one GGUFError
naming the file and the problem, so callers never see a raw struct/numpy exception.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_NP_SCALAR = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "?",
}


class GGUFError(ValueError):
    """A GGUF file cannot be used; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class _Truncated(Exception):
    pass


@dataclass
class TensorInfo:
    """One tensor of the file: GGUF dims are innermost-first; `shape` is torch order (outermost first)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated()
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")


def _read_value(cur: _Cursor, vtype: int) -> Any:
    vtype = GGUFValueType(vtype)
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        etype = GGUFValueType(cur.unpack("<I"))
        count = cur.unpack("<Q")
        if etype == GGUFValueType.STRING:
            return [cur.string() for _ in range(count)]
        if etype == GGUFValueType.ARRAY:
            return [_read_value(cur, GGUFValueType.ARRAY) for _ in range(count)]
        dt = np.dtype(_NP_SCALAR[etype])
        raw = cur.take(count * dt.itemsize)
        return np.frombuffer(raw, dtype=dt).tolist()
    return cur.unpack(_SCALAR[vtype])


class GGUFFile:
    """A parsed GGUF file: `metadata` (plain Python values), `tensors` (name -> TensorInfo), and
    `tensor_bytes(name)` giving a zero-copy uint8 view into the memory-mapped file."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        self.path = p
        if not p.exists():
            raise GGUFError(p, "file not found")
        if not p.is_file():
            raise GGUFError(p, "not a regular file")
        size = p.stat().st_size
        if size < 24:
            raise GGUFError(p, f"truncated: only {size} bytes, too short for a GGUF header")
        # copy-on-write mapping: torch can view it without a read-only warning; pages are never copied
        # because nothing writes to weights.
        self._map = np.memmap(p, dtype=np.uint8, mode="c")
        try:
            self._parse(memoryview(self._map), size)
        except _Truncated:
            self.close()
            raise GGUFError(p, "truncated or damaged header (a field runs past the end of the file)") from None
        except GGUFError:
            self.close()
            raise
        except (ValueError, UnicodeError, struct.error, OverflowError, MemoryError) as e:
            self.close()
            raise GGUFError(p, f"damaged header ({e})") from None

    def _parse(self, buf: memoryview, size: int) -> None:
        cur = _Cursor(buf)
        magic = bytes(cur.take(4))
        if magic != GGUF_MAGIC:
            raise GGUFError(self.path, f"not a GGUF file (bad magic {magic!r}, expected {GGUF_MAGIC!r})")
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            if self.version & 0xFFFF == 0 and self.version >> 16 in (2, 3):
                raise GGUFError(self.path, "big-endian GGUF files are not supported")
            raise GGUFError(self.path, f"unsupported GGUF version {self.version} (supported: 2, 3)")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        if n_tensors > size or n_kv > size:
            raise GGUFError(self.path, f"damaged header (claims {n_tensors} tensors and {n_kv} keys)")
        md: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            md[key] = _read_value(cur, cur.unpack("<I"))
        self.metadata = md
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 8:
                raise GGUFError(self.path, f"damaged header (tensor {name!r} has {n_dims} dims)")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            raw_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            infos.append((name, dims, raw_type, offset))
        align = int(md.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise GGUFError(self.path, f"damaged header (alignment {align})")
        data_start = (cur.pos + align - 1) // align * align
        self.data_offset = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, raw_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                qtype = None
            if qtype is None or qtype not in GGML_QUANT_SIZES:
                raise GGUFError(self.path, f"tensor {name!r} has unknown tensor type {raw_type}")
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_el = 1
            for d in dims:
                n_el *= d
            if dims and dims[0] % block:
                raise GGUFError(self.path, f"tensor {name!r}: row of {dims[0]} is not a multiple of {qtype.name}'s block {block}")
            n_bytes = n_el // block * type_size
            start = data_start + offset
            if start + n_bytes > size:
                raise GGUFError(self.path, f"truncated: tensor {name!r} needs bytes up to {start + n_bytes} but the file has {size}")
            if name in self.tensors:
                raise GGUFError(self.path, f"damaged header (tensor {name!r} appears twice)")
            self.tensors[name] = TensorInfo(name, qtype, tuple(reversed(dims)), start, n_bytes)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Raw bytes of one tensor as a read-only uint8 view of the mapped file (no copy)."""
        t = self.tensors[name]
        return self._map[t.offset:t.offset + t.n_bytes]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(self.path, "no general.architecture key: not a model file")
        return arch

    def close(self) -> None:
        m = getattr(self, "_map", None)
        if m is not None:
            mm = getattr(m, "_mmap", None)
            self._map = None
            try:
                if mm is not None:
                    mm.close()
            except BufferError:
                pass  # tensors still reference the mapping; it closes when they are freed
