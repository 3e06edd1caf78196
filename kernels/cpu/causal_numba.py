"""The numba kernels of kernels/cpu/causal.py (module-level functions, so that numba's cache keys them by name and
loads them on the next run; imported only where numba is installed)."""
from __future__ import annotations


import numpy as np
from numba import njit, prange

from kernels.cpu.softmax_numba import scaled_softmax


@njit(parallel=True, nogil=True, cache=True)
def heads_transposed(k, v, kt, vh):
    # k float32 [S, Hkv, D] -> kt float64 [Hkv, D, S] (keys channel-major: a query's scores are a vector loop over
    # the keys); v [S, Hkv, Dv] -> vh float64 [Hkv, S, Dv]
    S, hkv, D = k.shape
    dv = v.shape[2]
    for h in prange(hkv):
        for j in range(S):
            for d in range(D):
                kt[h, d, j] = np.float64(k[j, h, d])
            for d in range(dv):
                vh[h, j, d] = np.float64(v[j, h, d])


@njit(nogil=True, cache=True)
def query_row(qr, kt, vh, lo, hi, scale, sc, acc):
    # one query (float64 qr [D]) over keys lo..hi of its KV head: scores summed over d in order (the keys are the
    # vector lanes), times scale, softmax (max, exp, sum in key order, times 1 / sum), the values summed in key order.
    # Four channels (keys) a step, added left to right: (((s + a) + b) + c) + d is the same order as one at a time,
    # with a quarter of the partial sums' loads and stores
    D = qr.shape[0]
    dv = acc.shape[0]
    n = hi - lo
    s = sc[:n]
    s[:] = 0.0
    d = 0
    while d + 4 <= D:
        q0, q1, q2, q3 = qr[d], qr[d + 1], qr[d + 2], qr[d + 3]
        k0, k1, k2, k3 = kt[d, lo:hi], kt[d + 1, lo:hi], kt[d + 2, lo:hi], kt[d + 3, lo:hi]
        for j in range(n):
            s[j] = s[j] + q0 * k0[j] + q1 * k1[j] + q2 * k2[j] + q3 * k3[j]
        d += 4
    while d < D:
        qd = qr[d]
        kd = kt[d, lo:hi]
        for j in range(n):
            s[j] += qd * kd[j]
        d += 1
    scaled_softmax(s, n, scale)
    acc[:] = 0.0
    vb = vh[lo:hi]
    j = 0
    while j + 4 <= n:
        p0, p1, p2, p3 = s[j], s[j + 1], s[j + 2], s[j + 3]
        v0, v1, v2, v3 = vb[j], vb[j + 1], vb[j + 2], vb[j + 3]
        for c in range(dv):
            acc[c] = acc[c] + p0 * v0[c] + p1 * v1[c] + p2 * v2[c] + p3 * v3[c]
        j += 4
    while j < n:
        pj = s[j]
        vj = vb[j]
        for c in range(dv):
            acc[c] += pj * vj[c]
        j += 1


@njit(parallel=True, nogil=True, cache=True)
def causal_rows(q, kt, vh, q_start, k_start, scale, window, rows, out):
    # q float32 [T, H, D]; kt / vh from heads_transposed; out float32 [T, H, Dv]. A work item is one query head and
    # `rows` query rows; row t (position q_start + t) sees the keys at k_start.. up to its own position (window > 0:
    # the last `window` of them)
    T, H, D = q.shape
    hkv, _, S = kt.shape
    g = H // hkv
    dv = vh.shape[2]
    n_blocks = (T + rows - 1) // rows
    for item in prange(H * n_blocks):
        h = item // n_blocks
        hk = h // g
        t0 = (item % n_blocks) * rows
        qr = np.empty(D, np.float64)
        sc = np.empty(S, np.float64)
        acc = np.empty(dv, np.float64)
        for t in range(t0, min(T, t0 + rows)):
            p = q_start + t
            lo = 0
            if window > 0 and p - window + 1 > k_start:
                lo = p - window + 1 - k_start
            hi = p + 1 - k_start
            for d in range(D):
                qr[d] = np.float64(q[t, h, d])
            query_row(qr, kt[hk], vh[hk], lo, hi, scale, sc, acc)
            for d in range(dv):
                out[t, h, d] = np.float32(acc[d])
