"""kernels/quant/intdot.py's integer matmul compiled with numba: the same integers, the same float64 combine in
the same order, so the same bits as its torch reference (tests/kernels/test_intdot.py).

`few_rows` (decode steps, up to FEW_ROWS rows): one pass over the repacked int8 weights per row, a tile of
output rows per work item (prange), the group's integer dot vectorized across the tile's outputs, then the
float64 combine of intdot.py. `combine` (many rows): the float64 combine of block dots that torch's batched
matmul made (MKL's sgemm is far faster at many rows than anything numba vectorizes).
No fastmath: the float ops keep their order and are never fused (LLVM contracts a * b + c into an FMA
only when allowed to). Compiled once per machine into numba's cache (cache=True: next to this file, or
in the user's cache folder where that is read-only); numba missing: `available()` is False and torch runs
both steps (the same bits, slower).
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from kernels.quant.intdot import TILE

_LOCK = threading.Lock()
_KERNELS: dict | None = None
_FAILED = False
_RUN = threading.Lock()   # the workqueue layer takes one parallel launch at a time


def _compile() -> dict:
    import numba
    from numba import njit, prange
    # numba's own thread pool: its OpenMP layer, beside torch's OpenMP runtime, made torch's own ops ~100x slower
    # (a softmax of 9x4x40 values 35 us -> 8.6 ms, measured on this 2-core machine)
    numba.config.THREADING_LAYER = "workqueue"

    tile = TILE   # a compile-time constant: the loops over a tile's outputs unroll into whole vectors

    @njit(parallel=True, nogil=True, cache=True)
    def few_rows_kernel(q, a, c, xq, dx, s, out):
        n_tiles, k, _ = q.shape
        n_groups = a.shape[0]
        g_size = k // n_groups
        m = xq.shape[0]
        for t in prange(n_tiles):
            wt = q[t]
            j0 = t * tile
            isum = np.zeros(tile, np.int32)
            acc = np.zeros(tile, np.float64)
            for r in range(m):
                xr = xq[r]
                acc[:] = 0.0
                for g in range(n_groups):
                    isum[:] = 0
                    for i in range(g * g_size, (g + 1) * g_size):
                        wr = wt[i]
                        xv = np.int32(xr[i])
                        for j in range(tile):
                            isum[j] += np.int32(wr[j]) * xv
                    d = dx[r, g]
                    sv = s[r, g]
                    ar = a[g, j0:j0 + tile]
                    cr = c[g, j0:j0 + tile]
                    for j in range(tile):
                        acc[j] += (np.float64(ar[j]) * d) * np.float64(isum[j]) + np.float64(cr[j]) * sv
                o = out[r, j0:j0 + tile]
                for j in range(tile):
                    o[j] = np.float32(acc[j])

    @njit(parallel=True, nogil=True, cache=True)
    def combine_kernel(p, a, c, dx, s, out):
        n_groups, m, n = p.shape
        for r in prange(m):
            acc = np.zeros(n, np.float64)
            for g in range(n_groups):
                d = dx[r, g]
                sv = s[r, g]
                pr = p[g, r]
                ar = a[g]
                cr = c[g]
                for j in range(n):
                    acc[j] += (np.float64(ar[j]) * d) * np.float64(pr[j]) + np.float64(cr[j]) * sv
            o = out[r]
            for j in range(n):
                o[j] = np.float32(acc[j])

    return {"few_rows": few_rows_kernel, "combine": combine_kernel, "numba": numba}


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


def _threads(k: dict) -> None:
    numba = k["numba"]
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def few_rows(w, xq: torch.Tensor, dx: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    """out float32 [M, n_pad] = x @ W.T for an IntWeight w and intdot.int_activations' (xq, dx, s)."""
    k = _kernels()
    with _RUN:
        _threads(k)
        k["few_rows"](w.q.numpy(), w.a.numpy(), w.c.numpy(), xq.numpy(), dx.contiguous().numpy(),
                      s.contiguous().numpy(), out.numpy())


def combine(p: torch.Tensor, a: torch.Tensor, c: torch.Tensor, dx: torch.Tensor, s: torch.Tensor,
            out: torch.Tensor) -> None:
    """out[:] = intdot.combine_ref(p, a, c, dx, s) (the same bits); out may be a column slice."""
    k = _kernels()
    o = out if out.is_contiguous() else torch.empty(out.shape, dtype=torch.float32)
    with _RUN:
        _threads(k)
        k["combine"](p.numpy(), np.ascontiguousarray(a.numpy()), np.ascontiguousarray(c.numpy()),
                     dx.contiguous().numpy(), s.contiguous().numpy(), o.numpy())
    if o is not out:
        out.copy_(o)
