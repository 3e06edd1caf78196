"""The numba kernels of kernels/cpu/paged_decode.py (module-level functions, so that numba's cache keys them by name and
loads them on the next run; imported only where numba is installed)."""
from __future__ import annotations


import numpy as np
from numba import njit

from kernels.cpu.softmax_numba import scaled_softmax


@njit(nogil=True, cache=True)
def f16_bits(b):
    # float32 bits (int64 in [0, 2^32)) -> fp16 bits, round to nearest even (torch's .to(float16))
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x47800000:
        return sign | 0x7C00
    if a >= 0x38800000:
        h = (((a >> 23) - 112) << 10) | ((a & 0x7FFFFF) >> 13)
        rem = a & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
            h += 1
        return sign | h
    if a < 0x33000000:
        return sign
    m = (a & 0x7FFFFF) | 0x800000
    shift = 126 - (a >> 23)
    h = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return sign | h


@njit(nogil=True, cache=True)
def bf16_bits(b):
    # float32 bits -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (c10's round_to_nearest_even)
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0
    return ((b + ((b >> 16) & 1) + 0x7FFF) >> 16) & 0xFFFF


@njit(nogil=True, cache=True)
def encode_row(bits, kind, dst):
    for i in range(bits.shape[0]):
        b = np.int64(bits[i]) & 0xFFFFFFFF
        h = f16_bits(b) if kind == 0 else bf16_bits(b)
        dst[i] = np.int16(h - 65536 if h >= 32768 else h)

two112 = np.float32(2.0 ** 112)


@njit(nogil=True, cache=True)
def to_bits(h, kind):
    # a 16-bit pattern (int32, 0..65535) -> the bits of a float32 that is its value (bf16), or its value / 2^112
    # (fp16: sign, exponent and mantissa moved into place; infinities and NaN with the exponent all ones)
    if kind == 1:
        return h << 16
    b = ((h & 0x8000) << 16) | ((h & 0x7FFF) << 13)
    return b | 0x7F800000 if (h & 0x7C00) == 0x7C00 else b


@njit(nogil=True, cache=True)
def decode_rows(cache, table, lo, n, hk, kind, bits, dst, transposed):
    # positions lo..lo+n of KV head hk of cache int16 [n_blocks, block_size, Hkv, D] (through the block table)
    # -> float64 dst [n, D], or [D, n] when transposed: torch's values (fp16: the float32 times 2^112, exact;
    # infinity and NaN times 2^112 stay infinity and NaN)
    bs = cache.shape[1]
    D = cache.shape[3]
    for j in range(n):
        p = lo + j
        r = cache[table[p // bs], p % bs, hk]
        br = bits[j]
        for d in range(D):
            br[d] = to_bits(np.int32(r[d]) & 0xFFFF, kind)
    f = bits.view(np.float32)
    m = two112 if kind == 0 else np.float32(1.0)   # infinities and NaN stay what they are
    if transposed:
        for d in range(D):
            fd = dst[d]
            for j in range(n):
                fd[j] = np.float64(f[j, d] * m)
    else:
        for j in range(n):
            fr = f[j]
            dj = dst[j]
            for d in range(D):
                dj[d] = np.float64(fr[d] * m)


@njit(nogil=True, cache=True)
def decode_row(src, kind, bits, dst):
    # one row int16 [n] -> float64 [n] (decode_rows' values; for tests)
    for i in range(src.shape[0]):
        bits[i] = to_bits(np.int32(src[i]) & 0xFFFF, kind)
    f = bits.view(np.float32)
    m = two112 if kind == 0 else np.float32(1.0)
    for i in range(src.shape[0]):
        dst[i] = np.float64(f[i] * m)


@njit(nogil=True, cache=True)
def attend_at(q, kc, vc, table, first, start, scale, window, kind_k, kind_v, out):
    # q float32 [H, D] at position `start` over positions first..start (window > 0: the last `window`) of the
    # cache through `table`; out float32 [H, Dv]
    H, D = q.shape
    hkv = kc.shape[2]
    dv = vc.shape[3]
    g = H // hkv
    lo = first
    if window > 0 and start - window + 1 > lo:
        lo = start - window + 1
    n = start + 1 - lo
    kt = np.empty((D, n), np.float64)      # keys, channel-major: a query's scores are a vector loop over keys
    vt = np.empty((n, dv), np.float64)
    bits_k = np.empty((n, D), np.int32)
    bits_v = np.empty((n, dv), np.int32)
    sc = np.empty(n, np.float64)
    acc = np.empty(dv, np.float64)
    for hk in range(hkv):
        decode_rows(kc, table, lo, n, hk, kind_k, bits_k, kt, True)
        decode_rows(vc, table, lo, n, hk, kind_v, bits_v, vt, False)
        for gi in range(g):
            h = hk * g + gi
            sc[:] = 0.0
            for d in range(D):       # each score's sum runs over d in order; the keys are the vector lanes
                qd = np.float64(q[h, d])
                kd = kt[d]
                for j in range(n):
                    sc[j] += qd * kd[j]
            scaled_softmax(sc, n, scale)
            acc[:] = 0.0
            for j in range(n):
                pj = sc[j]
                vj = vt[j]
                for d in range(dv):
                    acc[d] += pj * vj[d]
            for d in range(dv):
                out[h, d] = np.float32(acc[d])


@njit(nogil=True, cache=True)
def decode_attend(q, kbits, vbits, kc, vc, table, first, start, scale, window, kind_k, kind_v, out):
    # q float32 [H, D]; kbits / vbits: the new row's float32 bits, int32 [Hkv, D] / [Hkv, Dv]; kc / vc: the
    # layer's cache as int16 [n_blocks, block_size, Hkv, D|Dv]; table int64 block ids; out float32 [H, Dv]
    bs = kc.shape[1]
    blk = table[start // bs]
    slot = start % bs
    for hk in range(kbits.shape[0]):
        encode_row(kbits[hk], kind_k, kc[blk, slot, hk])
        encode_row(vbits[hk], kind_v, vc[blk, slot, hk])
    attend_at(q, kc, vc, table, first, start, scale, window, kind_k, kind_v, out)


@njit(nogil=True, cache=True)
def attend_rows(q, kc, vc, tables, lengths, scale, window, kind_k, kind_v, out):
    # decode rows whose K/V are in the cache: row r's q float32 [H, D] at position lengths[r] - 1 over the blocks
    # of tables[r] (int32, the runner's), every block held (first = 0); out float32 [rows, H, Dv]
    for r in range(q.shape[0]):
        attend_at(q[r], kc, vc, tables[r], 0, lengths[r] - 1, scale, window, kind_k, kind_v, out[r])
