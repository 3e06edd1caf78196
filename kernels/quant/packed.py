"""Every quantized GGUF weight type on the GPU: one affine layout that all of them are repacked
into once at load time, a Triton matmul for it (M rows against each weight tile while the tile is
on chip: decode tokens and drafts, or a prefill chunk), and a row gather for embedding tables.

This generalizes kernels/quant/q4_gemm.py (Packed4 / q4_matmul) from Q4_0/Q4_1/Q4_K to every
quantized type in kernels.quant.ref.SUPPORTED_TYPES. F32/F16/BF16 weights are not packed
(`pack_weight` raises ValueError; the caller multiplies them with torch).

Layout of a packed [N, K] matrix (row n holds the K inputs of output n). Every GROUP consecutive
values of a row form a group (GROUP = the type's sub-block: 16 for Q2_K, Q3_K, Q6_K; 32 for the
rest), and

    W[n, k] = scale[n, k // GROUP] * q[n, k] - minv[n, k // GROUP]

    scale, minv  fp16 [N, K/GROUP]
    planes[0]    hi_bits in (0, 1, 2): the 4-bit plane, uint8 [N, K/2]: bits 0..3 of value 2j
                 in the low nibble of byte j, of value 2j+1 in the high nibble (as Packed4)
                 hi_bits == 8: the int8 plane, int8 [N, K]: q itself (signed)
    planes[1]    only when hi_bits is 1 or 2: the high plane, uint8 [N, K*hi_bits/8]: bits 4..
                 of the values, 8 // hi_bits values per byte; value v of byte j (v-th field of
                 hi_bits bits from the least significant end) is value j*(8 // hi_bits) + v.
                 q = low nibble | (high field << 4)

Per type (d, dmin, m: the block's fp16 fields; sc, mn: its sub-block scale/min codes; "fp16
product" marks a scale that is a product rounded to fp16, the only inexact step of the repacking;
bits/value of the packed layout vs the GGUF type, bytes ratio = packed / GGUF):

    type    group  planes      q           scale              minv               bits/value  ratio
    Q4_0    32     4-bit       0..15       d                  8*d                5 / 4.5     1.11
    Q4_1    32     4-bit       0..15       d                  -m                 5 / 5       1.00
    Q5_0    32     4-bit + 1   0..31       d                  16*d               6 / 5.5     1.09
    Q5_1    32     4-bit + 1   0..31       d                  -m                 6 / 6       1.00
    Q8_0    32     int8        -128..127   d                  0                  9 / 8.5     1.06
    Q2_K    16     4-bit       0..3        d*sc (fp16 prod)   dmin*mn (fp16 prod) 6 / 2.625  2.29
    Q3_K    16     4-bit       0..7        d*(sc-32) (prod)   4*scale            6 / 3.4375  1.75
    Q4_K    32     4-bit       0..15       d*sc (fp16 prod)   dmin*mn (fp16 prod) 5 / 4.5    1.11
    Q5_K    32     4-bit + 1   0..31       d*sc (fp16 prod)   dmin*mn (fp16 prod) 6 / 5.5    1.09
    Q6_K    16     4-bit + 2   0..63       d*sc (fp16 prod)   32*scale           8 / 6.5625  1.22
    IQ4_NL  32     int8        table[idx]  d                  0                  9 / 4.5     2.00
    IQ4_XS  32     int8        table[idx]  d*(sc-32) (prod)   0                  9 / 4.25    2.12

(Q3_K: GGUF's x = d*(sc-32) * (q_low - 4*(1 - hbit)) = scale * (q_low | hbit << 2) - 4*scale.
Q6_K: x = d*sc*(q - 32). IQ4: the non-linear codebook value, kernels.quant.ref._IQ4_KVALUES[idx],
is stored, so the kernel needs no table lookup.) Offsets folded into minv (4*scale, 8*d, 16*d,
32*scale) are exact in fp16. Where no product is rounded (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
and the others whenever d*sc happens to be exact in fp16), `dequant_packed_ref` is bit-identical
to kernels.quant.ref.dequantize (= gguf.quants.dequantize); otherwise each scale/min is within
fp16 rounding (2^-11 relative) of the exact one. The fp16 scales must not overflow (|d*sc| <
65504), which real weights never approach.

The 2- and 3-bit types and the IQ4 types cost 1.75-2.3x their GGUF bytes in this layout (the
4-bit/int8 planes, and a 16-value group's two fp16 numbers are 2 bits/value on their own); the
other types stay within 1.25x.

The matmul kernel is split-K like q4_matmul: program (m-block, n-tile, k-slice) loads each
[BLOCK_N, BLOCK_K] tile of the planes and scales once, dequantizes it in registers (in fp32,
rounded once to fp16) and multiplies it with a [BLOCK_M = 16, BLOCK_K] block of x (fp16) with
tl.dot (grid axes 0, 1, 2 = m-block, n-tile, k-slice: the m-blocks vary fastest, so when M > 16
the programs that share a weight tile run together and all but the first find it in L2),
accumulating fp32; each k-slice writes its own partial sums, which are added afterwards in a
fixed order (no atomics). Block sizes and the split come from the weight's shape only, never
from M, so a row's result is bit-identical whatever the other rows are (batch invariance), and
nothing reads tensor values on the host, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from kernels.quant.ref import (
    _expand_bits, _f16, _fields, _iq4_values, _k_scale_min, check_supported, weight_rows,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference instead
    triton = None

__all__ = ["PackedWeight", "PACKED_TYPES", "pack_weight", "dequant_packed_ref", "dequant_packed",
           "packed_matmul", "prefill_matmul", "packed_rows"]


@dataclass
class PackedWeight:
    """A [n, k] weight in the packed affine layout (see the module docstring).

    planes: (4-bit plane,) | (4-bit plane, high plane) | (int8 plane,)
    scale, minv: fp16 [n, k // group]
    hi_bits: 0, 1 or 2 extra bits per value in the high plane; 8 for the int8 plane
    qtype: the GGUF type it was packed from."""
    planes: tuple[torch.Tensor, ...]
    scale: torch.Tensor
    minv: torch.Tensor
    n: int
    k: int
    group: int
    hi_bits: int
    qtype: QT

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.planes, self.scale, self.minv))

    @property
    def device(self) -> torch.device:
        return self.scale.device


# ---------------------------------------------------------------------------------------------
# repacking: each function takes GGUF blocks b (uint8 [nb, type_size]) and returns, in value
# order, (lo, hi, scale, minv, offset): lo uint8 [nb, B] (0..15) or int8 [nb, B] (int8 plane),
# hi uint8 [nb, B] (the bits above bit 3) or None, scale float32 [nb, B // group], and either
# minv float32 [nb, B // group] (offset None; None = zeros) or offset: minv = offset * fp16(scale).

def _q4_0(b):
    qs = b[:, 2:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=1), None, _f16(b, 0)[:, None], None, 8


def _q4_1(b):
    qs = b[:, 4:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=1), None, _f16(b, 0)[:, None], -_f16(b, 2)[:, None], None


def _q5_0(b):
    lo = _fields(b, 6, 22, 4, 2, (-1, 16), 1).view(-1, 32)
    return lo, _expand_bits(b[:, 2:6], 0), _f16(b, 0)[:, None], None, 16


def _q5_1(b):
    lo = _fields(b, 8, 24, 4, 2, (-1, 16), 1).view(-1, 32)
    return lo, _expand_bits(b[:, 4:8], 0), _f16(b, 0)[:, None], -_f16(b, 2)[:, None], None


def _q8_0(b):
    return b[:, 2:].view(torch.int8), None, _f16(b, 0)[:, None], None, None


def _q2_k(b):
    n, sc = b.shape[0], b[:, :16]
    scale = _f16(b, 80)[:, None] * (sc & 0x0F).float()
    minv = _f16(b, 82)[:, None] * (sc >> 4).float()
    return _fields(b, 16, 80, 2, 4, (-1, 2, 32), 2).view(n, 256), None, scale, minv, None


def _q3_k(b):
    n = b.shape[0]
    sc = _fields(b, 96, 104, 4, 2, (-1, 8), 1).view(n, 16)
    sc |= _fields(b, 104, 108, 2, 4, (-1, 4), 1, lshift=4).view(n, 16)
    scale = _f16(b, 108)[:, None] * sc.view(torch.int8).sub_(32).float()
    q = _fields(b, 32, 96, 2, 4, (-1, 2, 32), 2).view(n, 256)
    q |= _fields(b, 0, 32, 1, 8, (-1, 32), 1, lshift=2).view(n, 256)  # q_low | hbit << 2
    return q, None, scale, None, 4


def _k_scales(b):
    sc, mn = _k_scale_min(b, 4)
    return _f16(b, 0)[:, None] * sc.float(), _f16(b, 2)[:, None] * mn.float()


def _q4_k(b):
    scale, minv = _k_scales(b)
    return _fields(b, 16, 144, 4, 2, (-1, 4, 32), 2).view(-1, 256), None, scale, minv, None


def _q5_k(b):
    scale, minv = _k_scales(b)
    lo = _fields(b, 48, 176, 4, 2, (-1, 4, 32), 2).view(-1, 256)
    hi = _fields(b, 16, 48, 1, 8, (-1, 32), 1).view(-1, 256)
    return lo, hi, scale, minv, None


def _q6_k(b):
    n = b.shape[0]
    scale = _f16(b, 208)[:, None] * b[:, 192:208].view(torch.int8).float()
    lo = _fields(b, 0, 128, 4, 2, (-1, 2, 64), 2).view(n, 256)
    hi = _fields(b, 128, 192, 2, 4, (-1, 2, 32), 2).view(n, 256)
    return lo, hi, scale, None, 32


def _iq4_nl(b):
    return _iq4_values(b[:, 2:]).view(-1, 32), None, _f16(b, 0)[:, None], None, None


def _iq4_xs(b):
    n = b.shape[0]
    sl, sh = b[:, 4:8], b[:, 2:4]
    sc = torch.stack([sl & 0x0F, sl >> 4], dim=2).view(n, 8)
    sc |= torch.stack([(sh >> (2 * k)) & 0x03 for k in range(4)], dim=2).view(n, 8) << 4
    scale = _f16(b, 0)[:, None] * sc.view(torch.int8).sub_(32).float()
    return _iq4_values(b[:, 8:].view(n, 8, 16)).view(n, 256), None, scale, None, None


# qtype -> (repack function, group, hi_bits)
_PACKERS = {
    QT.Q4_0: (_q4_0, 32, 0), QT.Q4_1: (_q4_1, 32, 0), QT.Q5_0: (_q5_0, 32, 1),
    QT.Q5_1: (_q5_1, 32, 1), QT.Q8_0: (_q8_0, 32, 8), QT.Q2_K: (_q2_k, 16, 0),
    QT.Q3_K: (_q3_k, 16, 0), QT.Q4_K: (_q4_k, 32, 0), QT.Q5_K: (_q5_k, 32, 1),
    QT.Q6_K: (_q6_k, 16, 2), QT.IQ4_NL: (_iq4_nl, 32, 8), QT.IQ4_XS: (_iq4_xs, 32, 8),
}
PACKED_TYPES: frozenset[QT] = frozenset(_PACKERS)

_CHUNK_VALUES = 1 << 24  # values repacked per step (bounds the temporaries: ~10 bytes per value)


def _pack_bits(h: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, K] fields of `bits` bits -> uint8 [R, K * bits / 8]: 8 // bits values per byte,
    value v of a byte in bits v*bits.. (least significant first)."""
    per = 8 // bits
    h = h.view(h.shape[0], -1, per)
    out = h[..., 0].clone()
    for v in range(1, per):
        out |= h[..., v] << (v * bits)
    return out


def pack_weight(raw: torch.Tensor, qtype, n: int, k: int) -> PackedWeight:
    """Repack a quantized GGUF weight of shape [n, k] (n outputs, k inputs; `raw` its GGUF bytes,
    uint8 of any shape, on any device) into the packed affine layout, with torch ops on raw's
    device (so on the GPU at load time; no host synchronisation). Raises ValueError
    (UnsupportedTypeError) for unknown/unsupported types and for F32/F16/BF16, which are not
    packed."""
    check_supported(qtype)
    qt = QT(qtype)
    if qt not in _PACKERS:
        raise ValueError(f"{qt.name} is not a quantized type: multiply it with torch instead of packing")
    fn, group, hi_bits = _PACKERS[qt]
    type_size = GGML_QUANT_SIZES[qt][1]
    rows = weight_rows(raw, qt, n, k)
    if rows.storage_offset() % 8:
        rows = rows.clone()  # blocks are viewed as int16/int32 words
    dev = rows.device
    if hi_bits == 8:
        planes = (torch.empty((n, k), dtype=torch.int8, device=dev),)
    else:
        planes = (torch.empty((n, k // 2), dtype=torch.uint8, device=dev),)
        if hi_bits:
            planes += (torch.empty((n, k * hi_bits // 8), dtype=torch.uint8, device=dev),)
    scale = torch.empty((n, k // group), dtype=torch.float16, device=dev)
    minv = torch.empty_like(scale)
    step = max(1, _CHUNK_VALUES // max(k, 1))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        lo, hi, s, m, offset = fn(rows[r0:r1].reshape(-1, type_size))
        rr = r1 - r0
        if hi_bits == 8:
            planes[0][r0:r1] = lo.reshape(rr, k)
        else:
            lo = lo.reshape(rr, k)
            planes[0][r0:r1] = lo[:, 0::2] | (lo[:, 1::2] << 4)
            if hi_bits:
                planes[1][r0:r1] = _pack_bits(hi.reshape(rr, k), hi_bits)
        s16 = s.reshape(rr, k // group).to(torch.float16)
        scale[r0:r1] = s16
        if offset is not None:
            minv[r0:r1] = s16.float().mul_(offset).to(torch.float16)  # exact: a power of two
        elif m is None:
            minv[r0:r1] = 0
        else:
            minv[r0:r1] = m.reshape(rr, k // group).to(torch.float16)
    return PackedWeight(planes=planes, scale=scale, minv=minv, n=n, k=k, group=group,
                        hi_bits=hi_bits, qtype=qt)


# ---------------------------------------------------------------------------------------------
# torch reference / row gather

def _unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of _pack_bits: uint8 [R, B] -> uint8 [R, B * 8 / bits]."""
    mask = (1 << bits) - 1
    return torch.stack([(p >> (v * bits)) & mask for v in range(8 // bits)], dim=-1).view(p.shape[0], -1)


def _dequant(p: PackedWeight, ids: torch.Tensor | None) -> torch.Tensor:
    def sel(t):
        return t if ids is None else t.index_select(0, ids)
    if p.hi_bits == 8:
        q = sel(p.planes[0])
    else:
        q = _unpack_bits(sel(p.planes[0]), 4)
        if p.hi_bits:
            q |= _unpack_bits(sel(p.planes[1]), p.hi_bits) << 4
    r = q.shape[0]
    w = q.float().view(r, p.k // p.group, p.group)
    w.mul_(sel(p.scale).float()[..., None])    # separate ops in float32, no FMA
    w.sub_(sel(p.minv).float()[..., None])
    return w.view(r, p.k)


def dequant_packed_ref(p: PackedWeight) -> torch.Tensor:
    """Torch reference of the packed layout: float32 [N, K] = scale * q - minv (float32 ops)."""
    return _dequant(p, None)


def packed_rows(p: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Dequantize only rows `ids` (an integer tensor of any shape, on p's device) -> float32
    ids.shape + (K,): an embedding lookup from a packed table. Same values as
    dequant_packed_ref(p)[ids]; torch ops, no host synchronisation."""
    flat = ids.reshape(-1).to(device=p.device, dtype=torch.long)
    return _dequant(p, flat).view(*ids.shape, p.k)


# ---------------------------------------------------------------------------------------------
# Triton matmul

if triton is not None:
    @triton.jit
    def _load_fields(ptr, rows, stride, k0, K, BITS: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Values k0..k0+BLOCK_K of `rows` from a plane of BITS-bit fields (8 // BITS per byte,
        least significant first), as uint8 [BLOCK_N, BLOCK_K]."""
        PER: tl.constexpr = 8 // BITS
        offs = k0 // PER + tl.arange(0, BLOCK_K // PER)
        ptrs = ptr + rows[:, None] * stride + offs[None, :]
        if EVEN_K:
            b = tl.load(ptrs)
        else:
            b = tl.load(ptrs, mask=offs[None, :] < K // PER, other=0)
        # tl.join (new last axis of 2) rather than shifting by a broadcast arange: ptxas needs
        # about half the registers (sm_90: 140 vs 255 + spills at 4 warps for the 4-bit plane)
        # join(a, b)[..., i, j] = (a, b)[j][..., i]: nested joins take the fields in bit-reversed
        # order so that the flattened index is the field number
        if BITS == 4:
            f = tl.join(b & 0x0F, b >> 4)
        elif BITS == 2:
            f = tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, b >> 6))
        else:
            f = tl.join(tl.join(tl.join(b & 1, (b >> 4) & 1), tl.join((b >> 2) & 1, (b >> 6) & 1)),
                        tl.join(tl.join((b >> 1) & 1, (b >> 5) & 1), tl.join((b >> 3) & 1, b >> 7)))
        return tl.reshape(f, (BLOCK_N, BLOCK_K))

    @triton.jit
    def _packed_mm_kernel(x_ptr, lo_ptr, hi_ptr, s_ptr, m_ptr, part_ptr, M, N, K,
                          stride_xm, stride_lo, stride_hi, stride_s,
                          HI_BITS: tl.constexpr, GROUP: tl.constexpr, K_SPLIT: tl.constexpr,
                          EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr = False):
        # m-blocks vary fastest, so the programs that share a weight tile run back to back and
        # all but the first read it from L2
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (cols % N).to(tl.int64)  # tail rows re-read valid rows (no load masks); not stored
        mask_m = offs_m < M
        # SWAP_AB: the weight tile is the dot's first operand (out^T = W x^T), the usual layout for
        # skinny products: the few activation rows become the small N side of the MMA
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = pid_k * K_SPLIT + kk
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xmask = mask_m[:, None]
            if not EVEN_K:
                xmask = xmask & (offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=xmask,
                        other=0.0).to(tl.float16)
            if HI_BITS == 8:
                qp = lo_ptr + rows[:, None] * stride_lo + offs_k[None, :]
                if EVEN_K:
                    q = tl.load(qp).to(tl.float32)
                else:
                    q = tl.load(qp, mask=offs_k[None, :] < K, other=0).to(tl.float32)
            else:
                qi = _load_fields(lo_ptr, rows, stride_lo, k0, K, 4, EVEN_K, BLOCK_N, BLOCK_K)
                if HI_BITS > 0:
                    qi = qi | (_load_fields(hi_ptr, rows, stride_hi, k0, K, HI_BITS, EVEN_K,
                                            BLOCK_N, BLOCK_K) << 4)
                q = qi.to(tl.float32)
            offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            sp = rows[:, None] * stride_s + offs_g[None, :]
            if EVEN_K:
                s = tl.load(s_ptr + sp).to(tl.float32)
            else:
                s = tl.load(s_ptr + sp, mask=offs_g[None, :] < K // GROUP, other=0.0).to(tl.float32)
            w = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None]
            if HI_BITS != 8:  # the int8 types have minv == 0
                if EVEN_K:
                    mn = tl.load(m_ptr + sp).to(tl.float32)
                else:
                    mn = tl.load(m_ptr + sp, mask=offs_g[None, :] < K // GROUP, other=0.0).to(tl.float32)
                w = w - mn[:, :, None]
            w16 = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(tl.float16)
            if SWAP_AB:
                acc += tl.dot(w16, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w16))
        if SWAP_AB:
            acc = tl.trans(acc)
        out = (part_ptr + pid_k.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N
               + cols[None, :])
        tl.store(out, acc.to(part_ptr.dtype.element_ty), mask=mask_m[:, None] & (cols[None, :] < N))

    @triton.jit
    def _sum_parts_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """out = part[0] + part[1] + ... + part[SPLIT-1], added in that order."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        offs_i = offs  # int64: part[i] starts at i * MN (scalar args may be constexpr, no .to)
        for i in tl.static_range(1, SPLIT):
            offs_i = offs_i + MN
            acc += tl.load(part_ptr + offs_i, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _dequant_kernel(lo_ptr, hi_ptr, s_ptr, m_ptr, out_ptr, N, K, stride_lo, stride_hi, stride_s,
                        HI_BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """out[n, k] = fp16(scale * q - minv) for one [BLOCK_N, BLOCK_K] tile (K % BLOCK_K == 0)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(rows, N - 1).to(tl.int64)   # tail rows rewrite the last row (same values)
        k0 = tl.program_id(1) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if HI_BITS == 8:
            q = tl.load(lo_ptr + rows[:, None] * stride_lo + offs_k[None, :]).to(tl.float32)
        else:
            qi = _load_fields(lo_ptr, rows, stride_lo, k0, K, 4, True, BLOCK_N, BLOCK_K)
            if HI_BITS > 0:
                qi = qi | (_load_fields(hi_ptr, rows, stride_hi, k0, K, HI_BITS, True, BLOCK_N, BLOCK_K) << 4)
            q = qi.to(tl.float32)
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        sp = rows[:, None] * stride_s + offs_g[None, :]
        w = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * tl.load(s_ptr + sp).to(tl.float32)[:, :, None]
        if HI_BITS != 8:
            w = w - tl.load(m_ptr + sp).to(tl.float32)[:, :, None]
        tl.store(out_ptr + rows[:, None] * K + offs_k[None, :], tl.reshape(w, (BLOCK_N, BLOCK_K)).to(tl.float16))


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_split_k(n_tiles: int, steps: int, n_sm: int) -> int:
    """The smallest divisor of `steps` (BLOCK_K steps along K) that makes the grid cover every SM
    about twice (or `steps` if none does): each slice gets a whole number of steps."""
    want = max(1, -(-2 * n_sm // max(n_tiles, 1)))
    for s in range(1, steps + 1):
        if steps % s == 0 and s >= want:
            return s
    return max(steps, 1)


def _default_block_k(k: int) -> int:
    """256, or the largest power of two >= 32 that divides K when 256 does not."""
    for bk in (256, 128, 64, 32):
        if k % bk == 0:
            return bk
    return 256  # K not a multiple of 32 cannot happen for block-quantized rows; masked anyway


def _split_for(n_tiles: int, steps: int, n_sm: int, waves: int) -> int:
    """The smallest divisor of `steps` that makes n_tiles * split >= waves * n_sm programs."""
    want = max(1, -(-waves * n_sm // max(n_tiles, 1)))
    for s in range(1, steps + 1):
        if steps % s == 0 and s >= want:
            return s
    return max(steps, 1)


def tuned_config(p: PackedWeight, prefill: bool, n_sm: int) -> dict:
    """Block sizes from the weight's shape only (never from M: batch invariance), measured on the
    H200 (.ci/gpu/sweep_matmul.py, docs/PERFORMANCE.md).
    decode rows (M <= 64): memory-bound; 2 pipeline stages, 4 warps, wide tiles for wide matrices,
    short K steps for long K, and split-K to about 4 programs per SM. Measured on Q4_K 17408x5120
    and 5120x17408 at M = 1 and 16: 1.0-1.1 TB/s of packed bytes vs 0.5 with the first defaults.
    prefill rows: 128x128 output tiles, K steps of 128, 8 warps, no split: each dequantized tile
    serves 128 rows (199 TFLOP/s on Q4_K 17408x5120, M = 512, vs 84 with 16-row tiles)."""
    K, N = p.k, p.n
    if prefill:
        return dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, split_k=1)
    # (SWAP_AB won a second, noisier kernel sweep by ~10 % but lost ~5 % end to end on the 27B:
    # not used; docs/PERFORMANCE.md)
    block_n = 128 if N >= 16384 else 64
    block_k = 256 if K <= 8192 else 128
    if block_k % p.group:
        block_k = _default_block_k(K)
    steps = -(-K // block_k)
    split = _split_for(-(-N // block_n), steps, n_sm, 4)
    return dict(block_m=16, block_n=block_n, block_k=block_k, num_warps=8 if p.hi_bits in (1, 2) else 4,
                num_stages=2, split_k=split)


def packed_matmul(x: torch.Tensor, p: PackedWeight, out_dtype: torch.dtype = torch.float32, *,
                  block_n: int = 64, block_k: int | None = None, block_m: int = 16,
                  split_k: int | None = None, num_warps: int | None = None, num_stages: int = 3,
                  swap_ab: bool = False) -> torch.Tensor:
    """x [..., K] (any float dtype; rounded to fp16) @ W.T -> out_dtype [..., N], W packed.

    Triton (CUDA, or the interpreter with TRITON_INTERPRET=1). Defaults: block_k 256 (or the
    largest power of two dividing K), split_k from the weight's shape and the SM count (4 SMs
    assumed off CUDA), num_warps 8 with a high plane (sm_90 ptxas: ~120 registers, vs 255 at 4
    warps) and 4 otherwise (128-140 registers); not yet tuned by timing. Batch invariance holds
    for any fixed settings: never choose them from M. No host synchronisation: usable inside
    CUDA graph capture (the SM count is cached per device; call once before capturing)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    K = x.shape[-1]
    if K != p.k:
        raise ValueError(f"x has {K} columns, the weight has {p.k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], p.n
    if block_k is None:
        block_k = _default_block_k(K)
    if block_k % p.group or block_k % 16 or block_m < 16 or block_n < 16:
        raise ValueError("block_k must be a multiple of the group size and 16; block_m, block_n >= 16")
    n_tiles = -(-N // block_n)
    steps = -(-K // block_k)
    if split_k is None:
        n_sm = _sm_count(x2.device.index if x2.device.index is not None else torch.cuda.current_device()) \
            if x2.is_cuda else 4
        split_k = _default_split_k(n_tiles, steps, n_sm)  # from the weight's shape only, never M
    split_k = max(1, min(split_k, steps))
    k_split = -(-steps // split_k) * block_k
    even_k = k_split * split_k == K
    if M == 0 or N == 0:
        return torch.zeros((*lead, N), dtype=out_dtype, device=x.device)
    part = torch.empty((split_k, M, N), dtype=torch.float32 if split_k > 1 else out_dtype,
                       device=x.device)
    if num_warps is None:
        num_warps = 8 if p.hi_bits in (1, 2) else 4
    lo = p.planes[0]
    hi = p.planes[1] if p.hi_bits in (1, 2) else lo
    grid = (-(-M // block_m), n_tiles, split_k)
    _packed_mm_kernel[grid](
        x2, lo, hi, p.scale, p.minv, part, M, N, K,
        x2.stride(0), lo.stride(0), hi.stride(0), p.scale.stride(0),
        HI_BITS=p.hi_bits, GROUP=p.group, K_SPLIT=k_split, EVEN_K=even_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP_AB=swap_ab,
        **(dict(num_warps=num_warps, num_stages=num_stages) if x2.is_cuda else {}))
    if split_k == 1:
        return part.view(*lead, N)
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    block = 1024
    _sum_parts_kernel[(-(-(M * N) // block),)](part, out, M * N, SPLIT=split_k, BLOCK=block)
    return out.view(*lead, N)


def dequant_packed(p: PackedWeight) -> torch.Tensor:
    """The whole weight as fp16 [N, K] (Triton): each value fp16(scale * q - minv), computed in
    float32 as in packed_matmul, so a product with it sees the same weights as the fused kernel."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    block_k = 64 if p.k % 64 == 0 else 32
    if p.k % block_k or block_k % p.group:
        raise ValueError(f"K = {p.k} is not a multiple of {block_k}")
    out = torch.empty((p.n, p.k), dtype=torch.float16, device=p.device)
    lo = p.planes[0]
    hi = p.planes[1] if p.hi_bits in (1, 2) else lo
    block_n = 32
    _dequant_kernel[(-(-p.n // block_n), p.k // block_k)](
        lo, hi, p.scale, p.minv, out, p.n, p.k, lo.stride(0), hi.stride(0), p.scale.stride(0),
        HI_BITS=p.hi_bits, GROUP=p.group, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def prefill_matmul(x: torch.Tensor, p: PackedWeight, pad_rows: int = 0) -> torch.Tensor:
    """Prompt rows: dequantize the weight to fp16 once, then one cuBLAS product with fp32 results.
    A prefill chunk is compute-bound, and cuBLAS's tensor-core kernels run about 3.5x the fused
    Triton kernel's TFLOP/s on the H200 (docs/PERFORMANCE.md); the fp16 copy costs one pass over the
    weight and its 2-byte values, freed after the product. cuBLAS picks its kernel from M, so a row's
    result depends on its chunk's length, which depends only on the prompt and the fixed chunk
    boundaries, not on other sequences. pad_rows: fewer rows are zero-padded to this many, so that every
    chunk of a prompt runs the same cuBLAS kernel and a row's result does not depend on how the prompt
    was cut into chunks either (a kernel reduces each output over K in its own fixed order, whatever
    the other rows hold)."""
    w = dequant_packed(p)
    x2 = x.reshape(-1, p.k).to(torch.float16)
    m = x2.shape[0]
    if m < pad_rows:
        x2 = torch.cat([x2, x2.new_zeros(pad_rows - m, p.k)])
    try:
        out = torch.mm(x2, w.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):   # torch without mm(out_dtype=): fp16 results, widened
        out = torch.mm(x2, w.t()).float()
    return out[:m].view(*x.shape[:-1], p.n)


def matmul_tuned(x: torch.Tensor, p: PackedWeight, prefill: int = 0) -> torch.Tensor:
    """What the engine's GPU path calls. prefill > 0: the rows are prompt rows (a chunk of at most
    `prefill` rows, padded to that many): dequantize + cuBLAS (`prefill_matmul`); else decode/draft
    rows: packed_matmul with `tuned_config` (fixed per weight shape), so a decode row's result does not
    depend on the other rows."""
    if not x.is_cuda:
        return packed_matmul(x, p)
    if prefill and PREFILL_CUBLAS:
        return prefill_matmul(x, p, pad_rows=int(prefill))
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (p.n, p.k, p.hi_bits, p.group, prefill, dev)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = tuned_config(p, prefill, _sm_count(dev))
    return packed_matmul(x, p, **cfg)


_CONFIGS: dict = {}
PREFILL_CUBLAS = True   # False: prompt rows through packed_matmul's prefill configuration (benchmarks)
