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


@njit(nogil=True, cache=True)
def float_tile(q, nibbles, zero, t, wf):
    # tile t of the repacked integers -> float32 wf [k, tile], input column major: wf[i, j] is the integer of input
    # column i for output row t tile + j (the nibble less `zero` for the 4-bit formats), exact
    wt = q[t]
    k = wf.shape[0]
    if nibbles:
        for b in range(k // 32):
            for i in range(16):
                wr = wt[b * 16 + i]
                lo = wf[b * 32 + i]
                hi = wf[b * 32 + 16 + i]
                for j in range(tile):
                    v = np.int32(wr[j])
                    lo[j] = np.float32((v & 15) - zero)
                    hi[j] = np.float32((v >> 4) - zero)
    else:
        for i in range(k):
            wr = wt[i]
            wi = wf[i]
            for j in range(tile):
                wi[j] = np.float32(wr[j])


# Integer dots in float32: every product of a weight's and an activation's integer (|w| <= 128, |x| <= 127) and every
# partial sum of a group (G <= 32 products: |sum| < 2^19) is an integer below 2^24, so each is exact in float32
# whatever the order or the fusing of the multiply-adds. So contraction into FMAs is allowed here (it changes no
# bit) and nowhere else; the float64 combine of many_rows_tile keeps IEEE order without FMAs.
@njit(nogil=True, cache=True, fastmath={"contract"})
def group_dots4(wf, xs, i0, i1, p0, p1, p2, p3):
    # p_r[j] = sum over input columns i0..i1 (a multiple of 4 apart) of wf[i, j] * xs[r, i], rows r = 0..3: each
    # weight vector loaded once for four rows, four columns a step (the partial sums stay in registers; eight
    # columns a step ran out of them)
    p0[:] = 0.0
    p1[:] = 0.0
    p2[:] = 0.0
    p3[:] = 0.0
    for b in range(i0, i1, 4):
        w0 = wf[b]
        w1 = wf[b + 1]
        w2 = wf[b + 2]
        w3 = wf[b + 3]
        y00 = xs[0, b]; y01 = xs[0, b + 1]; y02 = xs[0, b + 2]; y03 = xs[0, b + 3]
        y10 = xs[1, b]; y11 = xs[1, b + 1]; y12 = xs[1, b + 2]; y13 = xs[1, b + 3]
        y20 = xs[2, b]; y21 = xs[2, b + 1]; y22 = xs[2, b + 2]; y23 = xs[2, b + 3]
        y30 = xs[3, b]; y31 = xs[3, b + 1]; y32 = xs[3, b + 2]; y33 = xs[3, b + 3]
        for j in range(tile):
            v0 = w0[j]
            v1 = w1[j]
            v2 = w2[j]
            v3 = w3[j]
            p0[j] += v0 * y00 + v1 * y01 + v2 * y02 + v3 * y03
            p1[j] += v0 * y10 + v1 * y11 + v2 * y12 + v3 * y13
            p2[j] += v0 * y20 + v1 * y21 + v2 * y22 + v3 * y23
            p3[j] += v0 * y30 + v1 * y31 + v2 * y32 + v3 * y33


@njit(nogil=True, cache=True)
def combine_group(ps, nr, a64, c64, dx, s, e, r0, g, acc, acc2):
    # one group's block dots ps [4, tile] (exact integers) of rows r0..r0+nr into their float64 sums, as
    # few_rows_tiles combines them (a64, c64: the group's a and c in float64); four rows a pass, so that each a and c
    # is loaded once for them
    if nr == 4:
        d0, d1, d2, d3 = dx[r0, g], dx[r0 + 1, g], dx[r0 + 2, g], dx[r0 + 3, g]
        s0, s1, s2, s3 = s[r0, g], s[r0 + 1, g], s[r0 + 2, g], s[r0 + 3, g]
        p0, p1, p2, p3 = ps[0], ps[1], ps[2], ps[3]
        q0, q1, q2, q3 = acc[0], acc[1], acc[2], acc[3]
        for j in range(tile):
            aj = a64[j]
            cj = c64[j]
            q0[j] += (aj * d0) * np.float64(p0[j]) + cj * s0
            q1[j] += (aj * d1) * np.float64(p1[j]) + cj * s1
            q2[j] += (aj * d2) * np.float64(p2[j]) + cj * s2
            q3[j] += (aj * d3) * np.float64(p3[j]) + cj * s3
    else:
        for rr in range(nr):
            d = dx[r0 + rr, g]
            sv = s[r0 + rr, g]
            pr = ps[rr]
            q = acc[rr]
            for j in range(tile):
                q[j] += (a64[j] * d) * np.float64(pr[j]) + c64[j] * sv
    for rr in range(nr):
        ev = e[r0 + rr, g]
        if ev != 0.0:
            q = acc2[rr]
            for j in range(tile):
                q[j] += c64[j] * ev


@njit(nogil=True, cache=True)
def tile_scales(a, c, j0):
    """Tile j0..j0+tile's a and c [groups, tile] in float64, as combine_group takes them."""
    n_groups = a.shape[0]
    a64 = np.empty((n_groups, tile), np.float64)
    c64 = np.empty((n_groups, tile), np.float64)
    for g in range(n_groups):
        for j in range(tile):
            a64[g, j] = np.float64(a[g, j0 + j])
            c64[g, j] = np.float64(c[g, j0 + j])
    return a64, c64


@njit(nogil=True, cache=True)
def store_rows(acc, acc2, nr, out, r0, j0):
    """Rows r0..r0+nr of the tile's float64 sums into out's columns j0..: each sum rounded, then added."""
    for rr in range(nr):
        o = out[r0 + rr, j0:j0 + tile]
        for j in range(tile):
            o[j] = np.float32(acc[rr, j]) + np.float32(acc2[rr, j])


@njit(nogil=True, cache=True)
def many_rows_tile(wf, a, c, xq, dx, s, e, out, t):
    # every row of xq times tile t (its integers in wf), four rows at a time: the group dots, each combined in
    # float64 at once
    k = wf.shape[0]
    n_groups = a.shape[0]
    g_size = k // n_groups
    j0 = t * tile
    m = xq.shape[0]
    a64, c64 = tile_scales(a, c, j0)
    xs = np.zeros((4, k), np.float32)
    ps = np.empty((4, tile), np.float32)
    acc = np.empty((4, tile), np.float64)
    acc2 = np.empty((4, tile), np.float64)
    for r0 in range(0, m, 4):
        nr = min(4, m - r0)
        for rr in range(nr):
            for i in range(k):
                xs[rr, i] = np.float32(xq[r0 + rr, i])
        for rr in range(nr, 4):
            xs[rr, :] = 0.0
        acc[:] = 0.0
        acc2[:] = 0.0
        for g in range(n_groups):
            group_dots4(wf, xs, g * g_size, (g + 1) * g_size, ps[0], ps[1], ps[2], ps[3])
            combine_group(ps, nr, a64[g], c64[g], dx, s, e, r0, g, acc, acc2)
        store_rows(acc, acc2, nr, out, r0, j0)


@njit(parallel=True, nogil=True, cache=True)
def many_rows_parallel(q, nibbles, zero, a, c, xq, dx, s, e, out, row_chunk):
    # a tile of output rows and row_chunk rows of xq per work item: the tile's integers as float32 (k x tile x 4
    # bytes, in the core's cache), then its rows
    k, m = xq.shape[1], xq.shape[0]
    n_chunks = (m + row_chunk - 1) // row_chunk
    for item in prange(q.shape[0] * n_chunks):
        t = item // n_chunks
        r0 = (item % n_chunks) * row_chunk
        r1 = min(m, r0 + row_chunk)
        wf = np.empty((k, tile), np.float32)
        float_tile(q, nibbles, zero, t, wf)
        many_rows_tile(wf, a, c, xq[r0:r1], dx[r0:r1], s[r0:r1], e[r0:r1], out[r0:r1], t)


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


@njit(parallel=True, nogil=True, cache=True)
def q8_0_parallel(x, q8_1, xq, dx, s, e):
    # q8_0_kernel over blocks of 16 rows spread over numba's threads (prompt rows; each row's numbers its own)
    m = x.shape[0]
    for blk in prange((m + 15) // 16):
        lo, hi = blk * 16, min(m, blk * 16 + 16)
        q8_0_kernel(x[lo:hi], q8_1, xq[lo:hi], dx[lo:hi], s[lo:hi], e[lo:hi])


@njit(parallel=True, nogil=True, cache=True)
def q8_k_parallel(x, group, xq, dx, s, e):
    m = x.shape[0]
    for blk in prange((m + 15) // 16):
        lo, hi = blk * 16, min(m, blk * 16 + 16)
        q8_k_kernel(x[lo:hi], group, xq[lo:hi], dx[lo:hi], s[lo:hi], e[lo:hi])
