"""One query row's attention over a paged KV cache on the CPU, with its K/V write: the numba kernel reads the keys and
values straight from the pool's blocks through the block table (no gather copy) and computes the float64 attention
of kernels/attention/ref.py's `causal_attention` (scores, scale, softmax, weighted sum) in the same operations and
order, rounded once to float32.

`decode_attention(q, k, v, k_cache, v_cache, table, first, start, scale, window, codec_k, codec_v)`: write k [1,
Hkv, D] and v [1, Hkv, Dv] at position `start` (blocks of `table`, a long tensor of block ids, -1 for a block a
sliding window dropped; `first`: the first position still held), then attend q [1, H, D] (GQA: head i reads KV head
i // (H / Hkv)) over positions first..start (window > 0: the last `window` of them). Returns float32 [1, H, Dv].
`ref_decode_attention` is the torch code the CPU path runs otherwise (engine/kv/sequence.py: encode, indexed write,
gather, decode, causal_attention), with the same signature. Cache types f16 and bf16 (the values themselves, 16
bits: `supported`); the others take the reference.

The K / V rows are encoded as torch's .to(float16) / .to(bfloat16) rounds them (nearest even) and decoded exactly
(fp16: the bits moved into a float32 and scaled by 2^112; bf16: the float32's upper half). The float64 products and exp are IEEE
operations in the reference's order; the sums (the q . k dot, the softmax's, the weighted sum of values) run in
key and channel order, where BLAS and torch's vectorized softmax may sum in another order: a last-bit float64
difference, which the one rounding to float32 almost never shows (tests/kernels/cpu/test_paged_decode.py checks
the float32 bits; docs/decisions/cpu-decode-step.md).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.attention.ref import causal_attention, gather_blocks
from kernels.cpu.jit import LazyKernels

_KINDS = {"f16": 0, "bf16": 1}


def _compile() -> dict:
    import math

    from numba import njit

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
        # -> float64 dst [n, D], or [D, n] when transposed: torch's values (fp16: the float32 times 2^112, exact)
        bs = cache.shape[1]
        D = cache.shape[3]
        for j in range(n):
            p = lo + j
            r = cache[table[p // bs], p % bs, hk]
            br = bits[j]
            for d in range(D):
                br[d] = to_bits(np.int32(r[d]) & 0xFFFF, kind)
        f = bits.view(np.float32)
        for j in range(n):
            br = bits[j]
            fr = f[j]
            for d in range(D):
                x = fr[d]
                if kind == 0 and (br[d] & 0x7F800000) != 0x7F800000:
                    x = x * two112
                if transposed:
                    dst[d, j] = np.float64(x)
                else:
                    dst[j, d] = np.float64(x)

    @njit(nogil=True, cache=True)
    def decode_row(src, kind, bits, dst):
        # one row int16 [n] -> float64 [n] (decode_rows' values; for tests)
        for i in range(src.shape[0]):
            bits[i] = to_bits(np.int32(src[i]) & 0xFFFF, kind)
        f = bits.view(np.float32)
        for i in range(src.shape[0]):
            x = f[i]
            if kind == 0 and (bits[i] & 0x7F800000) != 0x7F800000:
                x = x * two112
            dst[i] = np.float64(x)

    @njit(nogil=True, cache=True)
    def decode_attend(q, kbits, vbits, kc, vc, table, first, start, scale, window, kind_k, kind_v, out):
        # q float32 [H, D]; kbits / vbits: the new row's float32 bits, int32 [Hkv, D] / [Hkv, Dv]; kc / vc: the
        # layer's cache as int16 [n_blocks, block_size, Hkv, D|Dv]; table int64 block ids; out float32 [H, Dv]
        H, D = q.shape
        hkv = kbits.shape[0]
        dv = vbits.shape[1]
        g = H // hkv
        bs = kc.shape[1]
        blk = table[start // bs]
        slot = start % bs
        for hk in range(hkv):
            encode_row(kbits[hk], kind_k, kc[blk, slot, hk])
            encode_row(vbits[hk], kind_v, vc[blk, slot, hk])
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
                m = -math.inf
                for j in range(n):
                    sc[j] *= scale
                    if sc[j] > m:
                        m = sc[j]
                tot = 0.0
                for j in range(n):
                    e = math.exp(sc[j] - m)
                    sc[j] = e
                    tot += e
                inv = 1.0 / tot
                acc[:] = 0.0
                for j in range(n):
                    pj = sc[j] * inv
                    vj = vt[j]
                    for d in range(dv):
                        acc[d] += pj * vj[d]
                for d in range(dv):
                    out[h, d] = np.float32(acc[d])

    return {"decode_attend": decode_attend, "encode_row": encode_row, "decode_row": decode_row, "decode_rows": decode_rows}


_KERNELS = LazyKernels(_compile)


def available() -> bool:
    return _KERNELS.get() is not None


def supported(codec_k, codec_v) -> bool:
    """Whether the kernel takes these cache types (f16 / bf16 K and V) and numba imports here."""
    return codec_k.name in _KINDS and codec_v.name in _KINDS and available()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, first: int, start: int, scale: float, window: int, codec_k,
                     codec_v) -> torch.Tensor:
    """Write k, v at `start` and attend q over positions first..start (see the module docstring); float32 [1, H, Dv].
    Takes the reference where the kernel does not apply."""
    if not supported(codec_k, codec_v) or q.shape[0] != 1 or k.shape[0] != 1 or q.dtype != torch.float32 \
            or q.device.type != "cpu" or k_cache.device.type != "cpu":
        return ref_decode_attention(q, k, v, k_cache, v_cache, table, first, start, scale, window, codec_k, codec_v)
    kern = _KERNELS.get()
    H, dv = q.shape[1], v.shape[2]
    out = np.empty((H, dv), np.float32)
    kk, kv = _KINDS[codec_k.name], _KINDS[codec_v.name]
    kern["decode_attend"](q[0].numpy(), k[0].float().contiguous().view(torch.int32).numpy(),
                          v[0].float().contiguous().view(torch.int32).numpy(), k_cache.view(torch.int16).numpy(),
                          v_cache.view(torch.int16).numpy(), table.numpy(), int(first), int(start), float(scale),
                          int(window), kk, kv, out)
    return torch.from_numpy(out).view(1, H, dv)


def ref_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, table: torch.Tensor, first: int, start: int, scale: float, window: int,
                         codec_k, codec_v) -> torch.Tensor:
    """The torch code: k, v encoded and written at `start`, the held blocks gathered and decoded, causal_attention
    (float64) of q over them, the output taken from the stored domain."""
    bs = k_cache.shape[1]
    blk, slot = int(table[start // bs]), start % bs
    k_cache[blk, slot] = codec_k.encode(k[0])
    v_cache[blk, slot] = codec_v.encode(v[0])
    got_first, kp = gather_blocks(k_cache, table, start + 1)
    _, vp = gather_blocks(v_cache, table, start + 1)
    if got_first != first:
        raise ValueError(f"the table's first held position is {got_first}, not {first}")
    K, V = codec_k.decode_stored(kp), codec_v.decode_stored(vp)
    out = causal_attention(codec_k.to_stored(q), K, V, start, scale, window, k_start=first)
    return codec_v.from_stored(out, v.shape[-1])
