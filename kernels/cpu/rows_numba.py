"""The numba kernels of kernels/cpu/rows.py (module-level functions, so that numba's cache keys them by name and
loads them on the next run; imported only where numba is installed, after rows.py has chosen numba's threading
layer)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(nogil=True, cache=True)
def rms_norm_rows(x, w, has_w, eps, out):
    # x float32 [N, E] -> out float32 [N, E]: float64(x) * (1 / sqrt(sum(x^2) / E + eps)) * w, rounded once
    n, e = x.shape
    for r in range(n):
        ss = 0.0
        for i in range(e):
            v = np.float64(x[r, i])
            ss += v * v
        inv = 1.0 / math.sqrt(ss / e + eps)
        if has_w:
            for i in range(e):
                out[r, i] = np.float32((np.float64(x[r, i]) * inv) * np.float64(w[i]))
        else:
            for i in range(e):
                out[r, i] = np.float32(np.float64(x[r, i]) * inv)


@njit(nogil=True, cache=True)
def silu_rows(gate, up, out):
    # gate, up float32 [N, F]: silu(g) * u = (g / (1 + exp(-g))) * u in float64 (torch's silu), rounded once
    n, f = gate.shape
    for r in range(n):
        for i in range(f):
            g = np.float64(gate[r, i])
            out[r, i] = np.float32((g / (1.0 + math.exp(-g))) * np.float64(up[r, i]))


@njit(parallel=True, nogil=True, cache=True)
def silu_rows_parallel(gate, up, out):
    # silu_rows over blocks of 16 rows spread over numba's threads (prompt rows)
    n, f = gate.shape
    for blk in prange((n + 15) // 16):
        for r in range(blk * 16, min(n, blk * 16 + 16)):
            for i in range(f):
                g = np.float64(gate[r, i])
                out[r, i] = np.float32((g / (1.0 + math.exp(-g))) * np.float64(up[r, i]))


@njit(nogil=True, cache=True)
def norm_rope_rows(x, w, norm, has_w, eps, cos, sin, rope_dim, neox, out):
    # x float32 [N, H, D]: optional RMSNorm per head (as rms_norm_rows, rounded to float32), then rotary over the
    # first rope_dim dims in float32 (a*c - b*s, a*s + b*c); the rest pass through
    n, h, d = x.shape
    half = rope_dim // 2
    y = np.empty(d, np.float32)
    for r in range(n):
        for hh in range(h):
            xr = x[r, hh]
            if norm:
                ss = 0.0
                for i in range(d):
                    v = np.float64(xr[i])
                    ss += v * v
                inv = 1.0 / math.sqrt(ss / d + eps)
                for i in range(d):
                    t = np.float64(xr[i]) * inv
                    y[i] = np.float32(t * np.float64(w[i]) if has_w else t)
            else:
                for i in range(d):
                    y[i] = xr[i]
            o = out[r, hh]
            for p in range(half):
                c = cos[r, p]
                s = sin[r, p]
                if neox:
                    i0, i1 = p, p + half
                else:
                    i0, i1 = 2 * p, 2 * p + 1
                a = y[i0]
                b = y[i1]
                o[i0] = a * c - b * s
                o[i1] = a * s + b * c
            for i in range(rope_dim, d):
                o[i] = y[i]
