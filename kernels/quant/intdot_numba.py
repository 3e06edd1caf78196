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

import math
import threading

import numpy as np
import torch

TILE = 64   # output rows per tile of kernels/quant/intdot.py's repacked integers (one work item; a compile-time width)

_LOCK = threading.Lock()
_KERNELS: dict | None = None
_FAILED = False
_RUN = threading.Lock()   # the workqueue layer takes one parallel launch at a time
# a few-row product of at least this many multiply-adds spreads its tiles over numba's threads; smaller ones run on
# the calling thread (the demo model's decode step: the 49152 x 576 output matrix in parallel, its layers' ~0.9M-MAC
# matrices each on one thread)
PARALLEL_MACS = 4 << 20


def _compile() -> dict:
    import numba
    from numba import njit, prange
    # numba's own thread pool: its OpenMP layer, beside torch's OpenMP runtime, made torch's own ops ~100x slower
    # (a softmax of 9x4x40 values 35 us -> 8.6 ms, measured on this 2-core machine)
    numba.config.THREADING_LAYER = "workqueue"

    tile = TILE   # a compile-time constant: the loops over a tile's outputs unroll into whole vectors

    @njit(nogil=True, cache=True)
    def few_rows_tiles(q, a, c, xq, dx, s, e, out, t0, t1):
        k = q.shape[1]
        n_groups = a.shape[0]
        g_size = k // n_groups
        m = xq.shape[0]
        for t in range(t0, t1):
            wt = q[t]
            j0 = t * tile
            isum = np.zeros(tile, np.int32)
            acc = np.zeros(tile, np.float64)
            acc2 = np.zeros(tile, np.float64)
            for r in range(m):
                xr = xq[r]
                acc[:] = 0.0
                acc2[:] = 0.0
                for g in range(n_groups):
                    isum[:] = 0
                    for i in range(g * g_size, (g + 1) * g_size):
                        wr = wt[i]
                        xv = np.int32(xr[i])
                        for j in range(tile):
                            isum[j] += np.int32(wr[j]) * xv
                    d = dx[r, g]
                    sv = s[r, g]
                    ev = e[r, g]
                    ar = a[g, j0:j0 + tile]
                    cr = c[g, j0:j0 + tile]
                    for j in range(tile):
                        acc[j] += (np.float64(ar[j]) * d) * np.float64(isum[j]) + np.float64(cr[j]) * sv
                    if ev != 0.0:
                        for j in range(tile):
                            acc2[j] += np.float64(cr[j]) * ev
                o = out[r, j0:j0 + tile]
                for j in range(tile):
                    o[j] = np.float32(acc[j]) + np.float32(acc2[j])

    @njit(nogil=True, cache=True)
    def few_rows_nibbles_tiles(q, zero, a, c, xq, dx, s, e, out, t0, t1):
        # q uint8 [n_tiles, k / 2, tile]: group g's column 32 g + i in the low nibble of byte 16 g + i, column
        # 32 g + 16 + i in the high one; the integer is the nibble less `zero` (sum(q * x) less zero * sum(x))
        n_groups = a.shape[0]
        m = xq.shape[0]
        for t in range(t0, t1):
            wt = q[t]
            j0 = t * tile
            isum = np.zeros(tile, np.int32)
            part = np.zeros(tile, np.int16)
            acc = np.zeros(tile, np.float64)
            acc2 = np.zeros(tile, np.float64)
            for r in range(m):
                xr = xq[r]
                acc[:] = 0.0
                acc2[:] = 0.0
                for g in range(n_groups):
                    isum[:] = 0
                    xsum = 0
                    for half in range(2):   # 8 byte rows at a time in int16: |sum| <= 8 * 2 * 15 * 127 < 2^15
                        part[:] = 0
                        for i in range(half * 8, half * 8 + 8):
                            wr = wt[g * 16 + i]
                            xl = np.int16(xr[g * 32 + i])
                            xh = np.int16(xr[g * 32 + 16 + i])
                            xsum += np.int32(xl) + np.int32(xh)
                            for j in range(tile):
                                part[j] += np.int16(wr[j] & 15) * xl + np.int16(wr[j] >> 4) * xh
                        for j in range(tile):
                            isum[j] += np.int32(part[j])
                    corr = np.int32(zero * xsum)
                    d = dx[r, g]
                    sv = s[r, g]
                    ev = e[r, g]
                    ar = a[g, j0:j0 + tile]
                    cr = c[g, j0:j0 + tile]
                    for j in range(tile):
                        acc[j] += (np.float64(ar[j]) * d) * np.float64(isum[j] - corr) + np.float64(cr[j]) * sv
                    if ev != 0.0:
                        for j in range(tile):
                            acc2[j] += np.float64(cr[j]) * ev
                o = out[r, j0:j0 + tile]
                for j in range(tile):
                    o[j] = np.float32(acc[j]) + np.float32(acc2[j])

    @njit(parallel=True, nogil=True, cache=True)
    def few_rows_parallel(q, a, c, xq, dx, s, e, out):
        for t in prange(q.shape[0]):
            few_rows_tiles(q, a, c, xq, dx, s, e, out, t, t + 1)

    @njit(parallel=True, nogil=True, cache=True)
    def few_rows_nibbles_parallel(q, zero, a, c, xq, dx, s, e, out):
        for t in prange(q.shape[0]):
            few_rows_nibbles_tiles(q, zero, a, c, xq, dx, s, e, out, t, t + 1)

    @njit(parallel=True, nogil=True, cache=True)
    def combine_kernel(p, a, c, dx, s, e, out):
        n_groups, m, n = p.shape
        for r in prange(m):
            acc = np.zeros(n, np.float64)
            acc2 = np.zeros(n, np.float64)
            for g in range(n_groups):
                d = dx[r, g]
                sv = s[r, g]
                ev = e[r, g]
                pr = p[g, r]
                ar = a[g]
                cr = c[g]
                for j in range(n):
                    acc[j] += (np.float64(ar[j]) * d) * np.float64(pr[j]) + np.float64(cr[j]) * sv
                if ev != 0.0:
                    for j in range(n):
                        acc2[j] += np.float64(cr[j]) * ev
            o = out[r]
            for j in range(n):
                o[j] = np.float32(acc[j]) + np.float32(acc2[j])

    @njit(parallel=True, nogil=True, cache=True)
    def float_columns_kernel(q, nibbles, zero, t0, t1, g_size, out):
        # tiles t0..t1 of the repacked integers -> float32 out [k / G, G, (t1 - t0) * tile]: out[g, i, t * tile + j] is
        # the integer of input column g G + i for output row (t0 + t) tile + j (for intdot.block_dots_ref)
        k = out.shape[0] * g_size
        for t in prange(t1 - t0):
            wt = q[t0 + t]
            c0 = t * tile
            if nibbles:
                for b in range(k // 32):
                    for i in range(16):
                        wr = wt[b * 16 + i]
                        lo_c = b * 32 + i
                        hi_c = lo_c + 16
                        olo = out[lo_c // g_size, lo_c % g_size]
                        ohi = out[hi_c // g_size, hi_c % g_size]
                        for j in range(tile):
                            v = np.int32(wr[j])
                            olo[c0 + j] = np.float32((v & 15) - zero)
                            ohi[c0 + j] = np.float32((v >> 4) - zero)
            else:
                for c in range(k):
                    wr = wt[c]
                    o = out[c // g_size, c % g_size]
                    for j in range(tile):
                        o[c0 + j] = np.float32(wr[j])

    @njit(nogil=True, cache=True)
    def fp16_round(v):
        """v (float32 or float64) rounded to the nearest fp16 value (ties to even), as float64; finite range only
        (past 65504: infinity, as fp16)."""
        if v == 0.0 or not np.isfinite(v):
            return np.float64(v)
        _, e = math.frexp(v)
        ulp = math.ldexp(1.0, max(e, -13) - 11)   # normal: 11 significant bits; subnormal: 2^-24 steps
        r = np.rint(np.float64(v) / ulp) * ulp
        return r if abs(r) <= 65504.0 else math.copysign(math.inf, v)

    @njit(nogil=True, cache=True)
    def q8_0_kernel(x, q8_1, xq, dx, s, e):
        m, k = x.shape
        for r in range(m):
            for b in range(k // 32):
                blk = x[r, b * 32:(b + 1) * 32]
                amax = np.float32(0.0)
                for i in range(32):
                    amax = max(amax, abs(blk[i]))
                d = amax / np.float32(127.0)
                inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
                qsum = np.float32(0.0)
                for i in range(32):
                    qv = np.rint(blk[i] * inv)
                    xq[r, b * 32 + i] = np.int8(qv)
                    qsum += qv
                dx[r, b] = fp16_round(d)
                s[r, b] = dx[r, b] * np.float64(qsum)
                e[r, b] = fp16_round(qsum * d) - s[r, b] if q8_1 else 0.0

    @njit(nogil=True, cache=True)
    def q8_k_kernel(x, group, xq, dx, s, e):
        m, k = x.shape
        per = 256 // group
        for r in range(m):
            for b in range(k // 256):
                blk = x[r, b * 256:(b + 1) * 256]
                imax = 0
                amax = np.float32(-1.0)
                for i in range(256):
                    if abs(blk[i]) > amax:
                        amax = abs(blk[i])
                        imax = i
                mx = blk[imax]
                # -127 / mx as torch's reference computes it: 1 / mx rounded, then times -127 (Tensor.__rdiv__)
                iscale = (np.float32(1.0) / mx) * np.float32(-127.0) if mx != 0 else np.float32(0.0)
                d = np.float64(np.float32(1.0) / iscale) if iscale != 0 else 0.0
                for gi in range(per):
                    qsum = 0.0
                    for i in range(gi * group, (gi + 1) * group):
                        qv = min(np.rint(blk[i] * iscale), np.float32(127.0))
                        xq[r, b * 256 + i] = np.int8(qv)
                        qsum += np.float64(qv)
                    dx[r, b * per + gi] = d
                    s[r, b * per + gi] = d * qsum
                    e[r, b * per + gi] = 0.0

    return {"few_rows": few_rows_tiles, "few_rows_nibbles": few_rows_nibbles_tiles,
            "few_rows_parallel": few_rows_parallel, "few_rows_nibbles_parallel": few_rows_nibbles_parallel, "combine": combine_kernel, "float_columns": float_columns_kernel, "q8_0": q8_0_kernel, "q8_k": q8_k_kernel,
            "numba": numba}


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


_SET_THREADS = [0]


def _threads(k: dict) -> None:
    """numba's threads follow torch's (set_num_threads), asked of numba only when torch's change."""
    n = torch.get_num_threads()
    if _SET_THREADS[0] != n:
        numba = k["numba"]
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        _SET_THREADS[0] = n


def activations(x: torch.Tensor, q8_k: bool, q8_1: bool, group: int, xq: torch.Tensor, dx: torch.Tensor,
                s: torch.Tensor, e: torch.Tensor) -> None:
    """intdot.int_activations' integers, scales, sums and Q8_1 sum errors (the same bits) into xq int8 [M, K],
    dx / s / e float64 [M, K / group]: Q8_K blocks of 256 (q8_k) or Q8_0 blocks of 32 (q8_1: e is llama.cpp's
    stored Q8_1 sum less s, else 0)."""
    _activations(_kernels(), x.contiguous().numpy(), q8_k, q8_1, group, xq.numpy(), dx.numpy(), s.numpy(), e.numpy())


def _activations(k: dict, xn, q8_k: bool, q8_1: bool, group: int, xq, dx, s, e) -> None:
    if q8_k:
        k["q8_k"](xn, group, xq, dx, s, e)
    else:
        k["q8_0"](xn, q8_1, xq, dx, s, e)


def few_rows_matmul(w, x: torch.Tensor) -> torch.Tensor:
    """x float32 [M, n_in] -> float32 [M, n_pad]: intdot.int_matmul's result for a few rows (its activations and the
    fused kernel, the same bits), with as little Python around the two kernel calls as a decode step can have."""
    k = _kernels()
    arrays = w.__dict__.get("_numba_arrays")
    if arrays is None:   # the weight's numpy views, made once
        arrays = w._numba_arrays = (w.q.numpy(), w.a.numpy(), w.c.numpy())
    m = x.shape[0]
    groups = w.n_in // w.group
    xq = np.empty((m, w.n_in), np.int8)
    dx, s, e = np.empty((3, m, groups), np.float64)
    _activations(k, x.contiguous().numpy(), w.q8_k, w.q8_1, w.group, xq, dx, s, e)
    out = np.empty((m, w.n_pad), np.float32)
    q, a, c = arrays
    if m * w.n_in * w.n_pad < PARALLEL_MACS or torch.get_num_threads() == 1:
        # on this thread: a parallel launch hands the tiles to numba's pool and waits for it, ~10-50 us on an idle
        # machine, a scheduler time slice on a busy one (a 210-matmul decode step: 0.7 s on the shared 2-core
        # machine with every matmul launched)
        if w.zero is None:
            k["few_rows"](q, a, c, xq, dx, s, e, out, 0, q.shape[0])
        else:
            k["few_rows_nibbles"](q, w.zero, a, c, xq, dx, s, e, out, 0, q.shape[0])
        return torch.from_numpy(out)
    with _RUN:
        _threads(k)
        if w.zero is None:
            k["few_rows_parallel"](q, a, c, xq, dx, s, e, out)
        else:
            k["few_rows_nibbles_parallel"](q, w.zero, a, c, xq, dx, s, e, out)
    return torch.from_numpy(out)


def float_columns(w, t0: int, t1: int) -> torch.Tensor:
    """intdot.IntWeight.float_columns(t0, t1) (the same values) in one pass over the repacked integers, its tiles
    spread over numba's threads."""
    k = _kernels()
    out = np.empty((w.n_in // w.group, w.group, (t1 - t0) * TILE), np.float32)
    q = w.__dict__.get("_q_np")
    if q is None:
        q = w._q_np = w.q.numpy()
    with _RUN:
        _threads(k)
        k["float_columns"](q, w.zero is not None, int(w.zero or 0), t0, t1, w.group, out)
    return torch.from_numpy(out)


def combine(p: torch.Tensor, a: torch.Tensor, c: torch.Tensor, dx: torch.Tensor, s: torch.Tensor, e: torch.Tensor,
            out: torch.Tensor) -> None:
    """out[:] = intdot.combine_ref(p, a, c, dx, s, e) (the same bits); out may be a column slice."""
    k = _kernels()
    o = out if out.is_contiguous() else torch.empty(out.shape, dtype=torch.float32)
    with _RUN:
        _threads(k)
        k["combine"](p.numpy(), np.ascontiguousarray(a.numpy()), np.ascontiguousarray(c.numpy()),
                     dx.contiguous().numpy(), s.contiguous().numpy(), e.contiguous().numpy(), o.numpy())
    if o is not out:
        out.copy_(o)
