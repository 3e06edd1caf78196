"""kernels/quant/intdot.py's integer matmul compiled with numba: the same integers, the same float64 combine in
the same order, so the same bits as its torch reference (tests/kernels/test_intdot.py).

`few_rows` (decode steps, up to FEW_ROWS rows): one pass over the repacked weights per row, a tile of output rows
per work item (prange), the group's integer dot vectorized across the tile's outputs, then the float64 combine of
intdot.py. `many_rows` (prompt rows): a tile's integers unpacked once into int8 and multiplied with every row,
eight input columns a step (the partial sums stay in vector registers), each group's dot combined at once: no
block-dot tensor goes through memory, which made torch's batched matmul + a combine pass memory-bound
(docs/decisions/cpu-matmul.md).
No fastmath: the float ops keep their order and are never fused (LLVM contracts a * b + c into an FMA
only when allowed to). Compiled once per machine into numba's cache (cache=True: next to this file, or
in the user's cache folder where that is read-only); numba missing: `available()` is False and torch runs
both steps (the same bits, slower).
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from kernels.cpu.jit import parallel_launch

log = logging.getLogger("hivejet.kernels")
_LOCK = threading.Lock()
_KERNELS: dict | None = None
_FAILED = False
# a few-row product of at least this many multiply-adds spreads its tiles over numba's threads; smaller ones run on
# the calling thread (the demo model's decode step: the 49152 x 576 output matrix in parallel, its layers' ~0.9M-MAC
# matrices each on one thread)
PARALLEL_MACS = 4 << 20
# rows of a many-row product per work item (with one tile of outputs): their activations (up to 64 x n_in bytes) and
# the tile's float32 integers stay in the core's cache, and a 512-row prompt chunk makes 8 items per tile, which
# spread evenly over the threads
MANY_ROWS_CHUNK = 64
# at least this many rows round their activations on every thread (a decode step's few rows stay on the calling thread)
PARALLEL_ROWS = 32


def _compile() -> dict:
    import numba
    # numba's own thread pool: its OpenMP layer, beside torch's OpenMP runtime, made torch's own ops ~100x slower
    # (a softmax of 9x4x40 values 35 us -> 8.6 ms, measured on this 2-core machine)
    numba.config.THREADING_LAYER = "workqueue"
    from kernels.quant import intdot_kernels as m
    from kernels.quant import intdot_vnni
    vnni = intdot_vnni.many_rows_vnni_parallel if intdot_vnni.usable() else None
    return {"many_rows_vnni": vnni, "few_rows": m.few_rows_tiles, "few_rows_nibbles": m.few_rows_nibbles_tiles,
            "few_rows_parallel": m.few_rows_parallel, "few_rows_nibbles_parallel": m.few_rows_nibbles_parallel,
            "many_rows": m.many_rows_parallel, "q8_0": m.q8_0_kernel, "q8_k": m.q8_k_kernel,
            "q8_0_parallel": m.q8_0_parallel, "q8_k_parallel": m.q8_k_parallel, "numba": numba}


def _kernels() -> dict | None:
    global _KERNELS, _FAILED
    if _KERNELS is None and not _FAILED:
        with _LOCK:
            if _KERNELS is None and not _FAILED:
                try:
                    _KERNELS = _compile()
                except ImportError:
                    _FAILED = True
    return _KERNELS


def available() -> bool:
    """Whether numba imports here (else intdot.py runs its torch reference: the same bits, slower)."""
    return _kernels() is not None


def activations(x: torch.Tensor, q8_k: bool, q8_1: bool, group: int, xq: torch.Tensor, dx: torch.Tensor,
                s: torch.Tensor, e: torch.Tensor) -> None:
    """intdot.int_activations' integers, scales, sums and Q8_1 sum errors (the same bits) into xq int8 [M, K],
    dx / s / e float64 [M, K / group]: Q8_K blocks of 256 (q8_k) or Q8_0 blocks of 32 (q8_1: e is llama.cpp's
    stored Q8_1 sum less s, else 0)."""
    _activations(_kernels(), x.contiguous().numpy(), q8_k, q8_1, group, xq.numpy(), dx.numpy(), s.numpy(), e.numpy())


def _activations(k: dict, xn, q8_k: bool, q8_1: bool, group: int, xq, dx, s, e) -> None:
    if xn.shape[0] >= PARALLEL_ROWS and torch.get_num_threads() > 1:   # prompt rows: 16-row blocks over the threads
        with parallel_launch(k["numba"]):
            if q8_k:
                k["q8_k_parallel"](xn, group, xq, dx, s, e)
            else:
                k["q8_0_parallel"](xn, q8_1, xq, dx, s, e)
    elif q8_k:
        k["q8_k"](xn, group, xq, dx, s, e)
    else:
        k["q8_0"](xn, q8_1, xq, dx, s, e)


def _operands(k: dict, w, x: torch.Tensor) -> tuple:
    """What both matmul kernels take: the weight's numpy views (made once), x's activation integers, scales, sums and
    Q8_1 sum errors, and the output buffer float32 [M, n_pad]."""
    arrays = w.__dict__.get("_numba_arrays")
    if arrays is None:
        arrays = w._numba_arrays = (w.q.numpy(), w.a.numpy(), w.c.numpy())
    m = x.shape[0]
    groups = w.n_in // w.group
    xq = np.empty((m, w.n_in), np.int8)
    dx, s, e = np.empty((3, m, groups), np.float64)
    _activations(k, x.contiguous().numpy(), w.q8_k, w.q8_1, w.group, xq, dx, s, e)
    return arrays + (xq, dx, s, e, np.empty((m, w.n_pad), np.float32))


def few_rows_matmul(w, x: torch.Tensor) -> torch.Tensor:
    """x float32 [M, n_in] -> float32 [M, n_pad]: intdot.int_matmul's result for a few rows (its activations and the
    fused kernel, the same bits), with as little Python around the two kernel calls as a decode step can have."""
    k = _kernels()
    q, a, c, xq, dx, s, e, out = _operands(k, w, x)
    m = x.shape[0]
    if m * w.n_in * w.n_pad < PARALLEL_MACS or torch.get_num_threads() == 1:
        # on this thread: a parallel launch hands the tiles to numba's pool and waits for it, ~10-50 us on an idle
        # machine, a scheduler time slice on a busy one (a 210-matmul decode step: 0.7 s on the shared 2-core
        # machine with every matmul launched)
        if w.zero is None:
            k["few_rows"](q, a, c, xq, dx, s, e, out, 0, q.shape[0])
        else:
            k["few_rows_nibbles"](q, w.zero, a, c, xq, dx, s, e, out, 0, q.shape[0])
        return torch.from_numpy(out)
    with parallel_launch(k["numba"]):
        if w.zero is None:
            k["few_rows_parallel"](q, a, c, xq, dx, s, e, out)
        else:
            k["few_rows_nibbles_parallel"](q, w.zero, a, c, xq, dx, s, e, out)
    return torch.from_numpy(out)


def many_rows_matmul(w, x: torch.Tensor) -> torch.Tensor:
    """x float32 [M, n_in] -> float32 [M, n_pad]: intdot.int_matmul's result for many rows (the same bits): the
    activations' integers, then every tile's integers as float32 once and multiplied with every row, the group
    dots combined in float64 in the kernel (no block-dot tensor in memory), tiles and chunks of MANY_ROWS_CHUNK rows
    over numba's threads."""
    k = _kernels()
    q, a, c, xq, dx, s, e, out = _operands(k, w, x)
    nibbles, zero = w.zero is not None, int(w.zero or 0)
    with parallel_launch(k["numba"]):
        if k["many_rows_vnni"] is not None:
            try:
                k["many_rows_vnni"](q, nibbles, zero, a, c, xq, xq.view(np.int32), dx, s, e, out, MANY_ROWS_CHUNK)
                return torch.from_numpy(out)
            except Exception as ex:   # noqa: BLE001 (it did not compile here: the float32 dots give the same bits)
                k["many_rows_vnni"] = None
                log.warning("the CPU's 8-bit dot kernel (AVX-512 VNNI) did not compile, prompts take the float32 "
                            "one: %s", ex)
        k["many_rows"](q, nibbles, zero, a, c, xq, dx, s, e, out, MANY_ROWS_CHUNK)
    return torch.from_numpy(out)
