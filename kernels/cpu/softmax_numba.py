"""The float64 softmax of a query row's scores that the CPU path's attention kernels share (kernels/cpu/
paged_decode_numba.py, causal_numba.py): the reference's operations in its order (kernels/attention/ref.py: the
scores times scale, exp of each less the maximum, their sum in key order, each times 1 / sum), in place."""
from __future__ import annotations

import math

from numba import njit


@njit(nogil=True, cache=True)
def scaled_softmax(s, n, scale):
    # s float64 [>= n]: s[:n] = softmax(s[:n] * scale)
    mx = -math.inf
    for j in range(n):
        s[j] *= scale
        if s[j] > mx:
            mx = s[j]
    tot = 0.0
    for j in range(n):
        e = math.exp(s[j] - mx)
        s[j] = e
        tot += e
    inv = 1.0 / tot
    for j in range(n):
        s[j] = s[j] * inv
