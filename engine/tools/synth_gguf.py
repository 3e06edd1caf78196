"""Writing synthetic GGUF files: the tensor list (`Layout`, `TensorSpec`), the random streams and
generation jobs that make each tensor's bytes, and the writer that puts metadata, tensor index and data
into a GGUF through a `.part` file (`write_gguf`, `part_writer`). engine/tools/synth.py (language
models) and engine/tools/synth_mmproj.py (vision projectors, vision-language models) both write through
it.

Every chunk of a tensor has its own random stream seeded from (seed, crc32(tensor name), chunk index),
so the bytes depend only on the seed and the layout, never on the thread count. Chunks are generated
by a thread pool and written in order (memory stays bounded).
"""
from __future__ import annotations

import math
import os
import sys
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import gguf
from gguf import GGML_QUANT_SIZES, GGUFValueType, Keys
from gguf import GGMLQuantizationType as QT

from engine.tools.synth_quant import DIRECT_TYPES, direct_blocks, encode

__all__ = ["TensorSpec", "Layout", "float_values", "write_gguf", "part_writer"]

_DIRECT_MIN_ELEMENTS = 1 << 22      # larger quantized tensors are generated directly as blocks
_CHUNK_BYTES = 32 << 20             # output bytes per generation job
_ALIGN = gguf.GGUF_DEFAULT_ALIGNMENT


# ---------------------------------------------------------------------------------------------
# tensor lists

@dataclass
class TensorSpec:
    name: str
    qtype: QT
    shape: tuple[int, ...]       # torch order
    init: tuple                  # ("normal", std) | ("norm", jitter) | ("uniform", lo, hi) | ("neg_loguniform", lo, hi)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * size


class Layout:
    """(name, torch-order shape, init) of tensors, in the order added; `init` as in TensorSpec."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, tuple[int, ...], tuple]] = []

    def add(self, name: str, shape: tuple[int, ...], init: tuple) -> None:
        self.rows.append((name, shape, init))

    def linear(self, name: str, n_out: int, n_in: int, scale: float = 1.0) -> None:
        """A (n_out, n_in) matrix of normals with std scale / sqrt(n_in): outputs of std ~scale for
        unit-RMS inputs."""
        self.add(name, (n_out, n_in), ("normal", scale / math.sqrt(n_in)))

    def norm(self, name: str, n: int) -> None:
        """A norm weight: 1 + U(-0.1, 0.1)."""
        self.add(name, (n,), ("norm", 0.1))


# ---------------------------------------------------------------------------------------------
# values and generation jobs

def _rng(seed: int, name: str, chunk: int) -> np.random.SFC64:
    return np.random.SFC64(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32 & 0xFFFFFFFF,
                                                   zlib.crc32(name.encode()), chunk]))


def float_values(init: tuple, n: int, g: np.random.Generator) -> np.ndarray:
    """n float32 draws from `g` for a tensor whose init is `init` (TensorSpec.init)."""
    kind = init[0]
    if kind == "normal":
        return g.standard_normal(n, dtype=np.float32) * np.float32(init[1])
    if kind == "norm":
        return (1.0 + g.uniform(-init[1], init[1], n)).astype(np.float32)
    if kind == "uniform":
        return g.uniform(init[1], init[2], n).astype(np.float32)
    if kind == "neg_loguniform":          # ssm_a = -exp(A_log), A log-uniform in [lo, hi]
        return (-np.exp(g.uniform(math.log(init[1]), math.log(init[2]), n))).astype(np.float32)
    raise ValueError(f"unknown init {init!r}")


def _jobs(spec: TensorSpec, seed: int) -> list[Callable[[], np.ndarray]]:
    """Callables whose outputs, concatenated, are the tensor's bytes."""
    ncols = spec.shape[-1]
    nrows = spec.n_elements // ncols
    block, size = GGML_QUANT_SIZES[spec.qtype]
    row_bytes = ncols // block * size
    rows_per_job = max(1, _CHUNK_BYTES // row_bytes)
    direct = (spec.qtype in DIRECT_TYPES and spec.n_elements > _DIRECT_MIN_ELEMENTS and spec.init[0] == "normal")
    jobs = []
    for ci, r0 in enumerate(range(0, nrows, rows_per_job)):
        nr = min(rows_per_job, nrows - r0)

        def job(ci=ci, nr=nr):
            rng = _rng(seed, spec.name, ci)
            if direct:
                return direct_blocks(spec.qtype, nr * ncols // block, spec.init[1], rng)
            x = float_values(spec.init, nr * ncols, np.random.Generator(rng)).reshape(nr, ncols)
            return encode(x, spec.qtype)
        jobs.append(job)
    return jobs


# ---------------------------------------------------------------------------------------------
# writing

def _pad(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.t0 = self.last = time.monotonic()
        self.done = 0

    def add(self, n: int, force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (force or now - self.last >= 2.0):
            self.last = now
            el = max(now - self.t0, 1e-9)
            rate = self.done / el
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            print(f"synth: {100.0 * self.done / max(self.total, 1):5.1f}%  {self.done / 1e9:6.2f} / {self.total / 1e9:.2f} GB"
                  f"  {rate / 1e6:7.1f} MB/s  elapsed {el:5.0f} s  eta {eta:5.0f} s", file=sys.stderr, flush=True)


def _vtype(value) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return GGUFValueType.UINT32, None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, list):
        first = value[0]
        sub = (GGUFValueType.STRING if isinstance(first, str) else GGUFValueType.BOOL if isinstance(first, bool)
               else GGUFValueType.INT32 if isinstance(first, int) else GGUFValueType.FLOAT32)
        return GGUFValueType.ARRAY, sub
    raise TypeError(f"unsupported metadata value {value!r}")


@contextmanager
def part_writer(path, arch: str) -> Iterator[gguf.GGUFWriter]:
    """A GGUFWriter on `path`.part, renamed to `path` when the block ends normally and removed when it
    raises (a failed write leaves no file behind)."""
    path = os.fspath(path)
    tmp = path + ".part"
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_gguf(path, arch: str, metadata: dict[str, Any], specs: list[TensorSpec], seed: int, *,
               header_only: bool = False, progress: bool = False, threads: int | None = None) -> int:
    """Write a GGUF with `metadata` (in order; general.architecture comes from `arch`) and the tensors
    `specs` generated from `seed`; return the file size.

    header_only: write the header, metadata and tensor index only; the file is then extended (sparse,
    no disk blocks) to its full length, so readers accept it and every tensor reads as zeros."""
    n_bytes = sum(s.n_bytes for s in specs)
    with part_writer(path, arch) as writer:
        for key, value in metadata.items():
            if key == Keys.General.ARCHITECTURE:
                continue  # GGUFWriter adds it first
            vt, sub = _vtype(value)
            writer.add_key_value(key, value, vt, sub)
        for s in specs:
            writer.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.n_bytes, raw_dtype=s.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        data_start = _pad(fout.tell())
        file_size = data_start + sum(_pad(s.n_bytes) for s in specs)
        if header_only:
            fout.flush()
            fout.truncate(file_size)
        else:
            fout.write(b"\0" * (data_start - fout.tell()))
            _write_data(fout, specs, seed, _Progress(n_bytes, progress), threads)
        fout.flush()
        written = os.fstat(fout.fileno()).st_size
        if written != file_size:
            raise RuntimeError(f"synth: wrote {written} bytes, expected {file_size}")
    return file_size


def _write_data(fout, specs: list[TensorSpec], seed: int, prog: _Progress, threads: int | None) -> None:
    workers = max(1, threads or os.cpu_count() or 1)
    window = 2 * workers

    def all_jobs() -> Iterator[tuple[int, Callable[[], np.ndarray]]]:
        for i, s in enumerate(specs):
            for j in _jobs(s, seed):
                yield i, j

    pending: deque = deque()
    written = [0] * len(specs)
    with ThreadPoolExecutor(max_workers=workers) as ex:
        it = all_jobs()
        exhausted = False
        while True:
            while not exhausted and len(pending) < window:
                try:
                    i, j = next(it)
                except StopIteration:
                    exhausted = True
                    break
                pending.append((i, ex.submit(j)))
            if not pending:
                break
            i, fut = pending.popleft()
            data = fut.result()
            fout.write(memoryview(data))
            written[i] += data.nbytes
            prog.add(data.nbytes)
            if written[i] == specs[i].n_bytes:
                fout.write(b"\0" * (_pad(specs[i].n_bytes) - specs[i].n_bytes))
            elif written[i] > specs[i].n_bytes:
                raise RuntimeError(f"synth: tensor {specs[i].name} produced too many bytes")
    for s, w in zip(specs, written):
        if w != s.n_bytes:
            raise RuntimeError(f"synth: tensor {s.name} produced {w} bytes, expected {s.n_bytes}")
    prog.add(0, force=True)
