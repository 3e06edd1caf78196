"""The numba kernels of kernels/quant/intdot_numba.py (module-level functions, so that numba's cache keys them by name
and loads them on the next run, the parallel ones included; imported only where numba is installed, after
intdot_numba has chosen numba's threading layer). TILE, the output rows of a tile, is a compile-time constant:
the loops over a tile's outputs unroll into whole vectors."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kernels.quant.intdot_tile import TILE as tile


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
