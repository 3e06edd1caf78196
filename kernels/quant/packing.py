"""The packed layout of every quantized GGUF weight type on the GPU: one affine layout that all of them are
repacked into once at load time (`pack_weight`), stacks of matrices that share an input (`stack_rows`), and the
layout's torch reference (`dequant_packed_ref`). kernels/quant/packed.py holds the Triton matmul over it, the row
gather for embedding tables and their launch settings.

This generalizes kernels/quant/q4_gemm.py (Packed4 / q4_matmul) from Q4_0/Q4_1/Q4_K to every
quantized type in kernels.quant.ref.SUPPORTED_TYPES. F32/F16/BF16 weights are not packed
(`pack_weight` raises ValueError; the caller multiplies them with torch).

Layout of a packed [N, K] matrix (row n holds the K inputs of output n). Every GROUP consecutive
values of a row form a group (GROUP = the type's sub-block: 16 for Q2_K, Q3_K, Q6_K; 32 for the
rest), and

    W[n, k] = scale[n, k // GROUP] * q[n, k] - minv[n, k // GROUP]

with each group's scale and min as the type's scale kind (kernels/packed_layout.py) stores them.
Row-major, the tensors would be (what `row_major` returns):

    planes[0]    hi_bits in (0, 1, 2): the 4-bit plane, uint8 [N, K/2]: bits 0..3 of the values, two
                 per byte, in the order a tensor-core fragment takes them (`_interleave_nibbles`: in
                 each tile row of R = TILE_K / 32 runs of 32 values, byte 4Rt + 4r + 2c + p holds value
                 32r + 16c + 2t + p and, high nibble, that + 8; `nibble_values` gives them in order)
                 hi_bits == 8: the int8 plane, int8 [N, K]: q itself (signed)
    planes[1]    only when hi_bits is 1 or 2: the high plane, uint8 [N, K*hi_bits/8]: bits 4..
                 of the values; hi_bits == 2 in fragment order like the 4-bit plane
                 (`_interleave_crumbs`; `high_values` gives them in order); hi_bits == 1: 8 values
                 per byte; value v of byte j (v-th field of
                 hi_bits bits from the least significant end) is value j*(8 // hi_bits) + v.
                 q = low nibble | (high field << 4)
    scale        "f16", "f16+min": fp16 [N, K/GROUP]; "codes": int8 codes [N, K/GROUP];
                 "codes+min": uint8 [N, 2K/GROUP], (sc, mn) code pairs
    minv         "f16+min" only: fp16 [N, K/GROUP]; the other kinds store no min (it is offset *
                 scale, from codes, or 0)
    supers       "codes": fp16 d [N, K/TILE_K]; "codes+min": fp16 (d, dmin) pairs [N, 2K/TILE_K]: the
                 256-value super-block's factors, one per tile row (TILE_K divides 256)

Stored, every one of them is cut into tiles of TILE_N rows x TILE_K values, each tile contiguous,
tiles in (row band, K) order: a tensor [N_pad / TILE_N, K / TILE_K, TILE_N, bytes of TILE_K values]
(N_pad: N rounded up to TILE_N, the extra rows zero). A decode matmul program then streams whole
contiguous tiles: on the H200 this moved 1.3-1.46 TB/s against 1.0-1.07 for row-major tiles of the
same size (docs/PERFORMANCE.md). TILE_N is 128 for N >= 16384, else 64; TILE_K is 256, or the largest
power of two >= 32 that divides K.

Per type (d, dmin, m: the block's fp16 fields; sc, mn: its sub-block scale/min codes; a product is
computed exactly in float32 and rounded once to fp16, by the packer, or by the kernel as by
`group_scales` when the codes are kept: the only inexact step; bits/value of the packed layout, with
the coded kinds as fp16 products (the default) / with their codes kept, vs the GGUF type):

    type    group  planes      q           scale (kind)         minv          bits/value: f16 / codes / GGUF
    Q4_0    32     4-bit       0..15       d (f16)              8*scale       4.5 / 4.5 / 4.5
    Q4_1    32     4-bit       0..15       d (f16+min)          -m            5 / 5 / 5
    Q5_0    32     4-bit + 1   0..31       d (f16)              16*scale      5.5 / 5.5 / 5.5
    Q5_1    32     4-bit + 1   0..31       d (f16+min)          -m            6 / 6 / 6
    Q8_0    32     int8        -128..127   d (f16)              0             8.5 / 8.5 / 8.5
    Q2_K    16     4-bit       0..3        d*sc (codes+min)     dmin*mn       6 / 5.125 / 2.625
    Q3_K    16     4-bit       0..7        d*(sc-32) (codes)    4*scale       5 / 4.5625 / 3.4375
    Q4_K    32     4-bit       0..15       d*sc (codes+min)     dmin*mn       5 / 4.625 / 4.5
    Q5_K    32     4-bit + 1   0..31       d*sc (codes+min)     dmin*mn       6 / 5.625 / 5.5
    Q6_K    16     4-bit + 2   0..63       d*sc (codes)         32*scale      7 / 6.5625 / 6.5625
    IQ4_NL  32     int8        table[idx]  d (f16)              0             8.5 / 8.5 / 4.5
    IQ4_XS  32     int8        table[idx]  d*(sc-32) (codes)    0             8.5 / 8.3125 / 4.25

(Q3_K: GGUF's x = d*(sc-32) * (q_low - 4*(1 - hbit)) = scale * (q_low | hbit << 2) - 4*scale.
Q6_K: x = d*sc*(q - 32). IQ4: the non-linear codebook value, kernels.quant.ref._IQ4_KVALUES[idx],
is stored, so the kernel needs no table lookup.) The offsets (4, 8, 16, 32 times the scale) are
exact in fp16 and not stored. Where no product is rounded (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, and
the others whenever d*sc happens to be exact in fp16), `dequant_packed_ref` is bit-identical to
kernels.quant.ref.dequantize (= gguf.quants.dequantize); otherwise each scale/min is within fp16
rounding (2^-11 relative) of the exact one. The fp16 scales must not overflow (|d*sc| < 65504),
which real weights never approach.

Either way the values, and so the kernel's results, are the same bits. Only types whose min is not a
fixed multiple of the scale store it (the 27B's matrices 17.4 GB, 18.05 GB with every type's min,
16.1 GB with the codes kept, against 16.1 GB of GGUF bytes). The codes are not the default because
making the scales in the kernel costs more than the bytes they save: the 27B's decode step takes 18.1 ms
with them, 15.9 ms without (docs/PERFORMANCE.md). The 2- and 3-bit types and the IQ4 types cost 1.3-2.3x their GGUF
bytes (their q in a 4-bit or int8 plane); the other types stay within 1.11x.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from kernels.packed_layout import PACKED_LAYOUT, default_tile_k, default_tile_n, scale_kind
from kernels.quant.ref import (
    _expand_bits, _f16, _fields, _iq4_values, _k_scale_min, check_supported, weight_rows,
)

__all__ = ["PackedWeight", "PACKED_TYPES", "SUPER_BLOCK", "pack_weight", "dequant_packed_ref", "stack_rows",
           "stack_key", "row_major", "group_scales", "nibble_values", "high_values"]


@dataclass
class PackedWeight:
    """A [n, k] weight in the packed affine layout (see the module docstring).

    planes: (4-bit plane,) | (4-bit plane, high plane) | (int8 plane,)
    scale: fp16 [.., k // group] scales (kind "f16", "f16+min"), or int8 codes [.., k // group]
      ("codes"), or uint8 (scale, min) code pairs [.., 2 * k // group] ("codes+min")
    minv: fp16 [.., k // group] (kind "f16+min" only), else None
    supers: fp16 [.., 1] d, or [.., 2] (d, dmin), per tile row (kinds "codes", "codes+min"), else None
    offset: the min is offset * scale (Q4_0 8, Q5_0 16, Q3_K 4, Q6_K 32; 0: none or stored)
    hi_bits: 0, 1 or 2 extra bits per value in the high plane; 8 for the int8 plane
    qtype: the GGUF type it was packed from
    tile_n, tile_k: every tensor is stored in contiguous tiles of tile_n rows x tile_k values,
    [n_pad / tile_n, k / tile_k, tile_n, bytes, groups or factors of tile_k values]."""
    planes: tuple[torch.Tensor, ...]
    scale: torch.Tensor
    minv: torch.Tensor | None
    n: int
    k: int
    group: int
    hi_bits: int
    qtype: QT
    tile_n: int = 64
    tile_k: int = 256
    supers: torch.Tensor | None = None
    offset: int = 0
    tma: tuple | None = field(default=None, init=False, repr=False, compare=False)   # _descriptors' result
    counts: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # _arrival_counts
    # counts outgrown by a launch of more m-blocks: CUDA graphs captured before still use them (kept alive)
    old_counts: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def codes(self) -> int:
        """0: fp16 scales; 1: int8 codes times d; 2: (scale, min) code pairs times (d, dmin)."""
        return 0 if self.supers is None else self.supers.shape[-1]

    @property
    def n_pad(self) -> int:
        return self.scale.shape[0] * self.tile_n

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (*self.planes, self.scale, self.minv, self.supers) if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def device(self) -> torch.device:
        return self.scale.device


# ---------------------------------------------------------------------------------------------
# repacking: each function takes GGUF blocks b (uint8 [nb, type_size]) and returns, in value
# order, (lo, hi, scales): lo uint8 [nb, B] (0..15) or int8 [nb, B] (int8 plane), hi uint8 [nb, B]
# (the bits above bit 3) or None, and the scales as the type's kind stores them (PACKED_LAYOUT):
#   "f16":       scale float32 [nb, B // group]
#   "f16+min":   (scale, minv) float32 [nb, B // group] each
#   "codes":     (codes int8 [nb, B // group], d float32 [nb, 1])
#   "codes+min": (codes uint8 [nb, 2 * B // group] as (sc, mn) pairs, (d, dmin) float32 [nb, 2])

def _pairs(sc, mn):
    return torch.stack([sc, mn], dim=2).view(sc.shape[0], -1)


def _q4_0(b):
    qs = b[:, 2:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=1), None, _f16(b, 0)[:, None]


def _q4_1(b):
    qs = b[:, 4:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=1), None, (_f16(b, 0)[:, None], -_f16(b, 2)[:, None])


def _q5_0(b):
    lo = _fields(b, 6, 22, 4, 2, (-1, 16), 1).view(-1, 32)
    return lo, _expand_bits(b[:, 2:6], 0), _f16(b, 0)[:, None]


def _q5_1(b):
    lo = _fields(b, 8, 24, 4, 2, (-1, 16), 1).view(-1, 32)
    return lo, _expand_bits(b[:, 4:8], 0), (_f16(b, 0)[:, None], -_f16(b, 2)[:, None])


def _q8_0(b):
    return b[:, 2:].view(torch.int8), None, _f16(b, 0)[:, None]


def _d_dmin(b, off):
    return torch.stack([_f16(b, off), _f16(b, off + 2)], dim=1)


def _q2_k(b):
    n, sc = b.shape[0], b[:, :16]
    q = _fields(b, 16, 80, 2, 4, (-1, 2, 32), 2).view(n, 256)
    return q, None, (_pairs(sc & 0x0F, sc >> 4), _d_dmin(b, 80))


def _q3_k(b):
    n = b.shape[0]
    sc = _fields(b, 96, 104, 4, 2, (-1, 8), 1).view(n, 16)
    sc |= _fields(b, 104, 108, 2, 4, (-1, 4), 1, lshift=4).view(n, 16)
    q = _fields(b, 32, 96, 2, 4, (-1, 2, 32), 2).view(n, 256)
    q |= _fields(b, 0, 32, 1, 8, (-1, 32), 1, lshift=2).view(n, 256)  # q_low | hbit << 2
    return q, None, (sc.view(torch.int8).sub_(32), _f16(b, 108)[:, None])


def _q4_k(b):
    return _fields(b, 16, 144, 4, 2, (-1, 4, 32), 2).view(-1, 256), None, (_pairs(*_k_scale_min(b, 4)), _d_dmin(b, 0))


def _q5_k(b):
    lo = _fields(b, 48, 176, 4, 2, (-1, 4, 32), 2).view(-1, 256)
    hi = _fields(b, 16, 48, 1, 8, (-1, 32), 1).view(-1, 256)
    return lo, hi, (_pairs(*_k_scale_min(b, 4)), _d_dmin(b, 0))


def _q6_k(b):
    n = b.shape[0]
    lo = _fields(b, 0, 128, 4, 2, (-1, 2, 64), 2).view(n, 256)
    hi = _fields(b, 128, 192, 2, 4, (-1, 2, 32), 2).view(n, 256)
    return lo, hi, (b[:, 192:208].view(torch.int8), _f16(b, 208)[:, None])


def _iq4_nl(b):
    return _iq4_values(b[:, 2:]).view(-1, 32), None, _f16(b, 0)[:, None]


def _iq4_xs(b):
    n = b.shape[0]
    sl, sh = b[:, 4:8], b[:, 2:4]
    sc = torch.stack([sl & 0x0F, sl >> 4], dim=2).view(n, 8)
    sc |= torch.stack([(sh >> (2 * k)) & 0x03 for k in range(4)], dim=2).view(n, 8) << 4
    return _iq4_values(b[:, 8:].view(n, 8, 16)).view(n, 256), None, (sc.view(torch.int8).sub_(32), _f16(b, 0)[:, None])


# qtype -> (repack function, offset: the min is offset * scale, exact in fp16 (a power of two))
_PACKERS = {
    QT.Q4_0: (_q4_0, 8), QT.Q4_1: (_q4_1, 0), QT.Q5_0: (_q5_0, 16), QT.Q5_1: (_q5_1, 0), QT.Q8_0: (_q8_0, 0),
    QT.Q2_K: (_q2_k, 0), QT.Q3_K: (_q3_k, 4), QT.Q4_K: (_q4_k, 0), QT.Q5_K: (_q5_k, 0), QT.Q6_K: (_q6_k, 32),
    QT.IQ4_NL: (_iq4_nl, 0), QT.IQ4_XS: (_iq4_xs, 0),
}
PACKED_TYPES: frozenset[QT] = frozenset(_PACKERS)
SUPER_BLOCK = 256   # values per d (and dmin) of the coded kinds: the K-quants' and IQ4_XS's block

_CHUNK_VALUES = 1 << 24  # values repacked per step (bounds the temporaries: ~10 bytes per value)


def _products(sc, group: int):
    """A coded kind's (codes, d) as its fp16 counterpart's float32 scales (and mins): d * code, exact."""
    codes, d = sc
    per = SUPER_BLOCK // group
    if d.shape[1] == 2:
        c = codes.view(codes.shape[0], per, 2).float()
        return d[:, :1] * c[..., 0], d[:, 1:] * c[..., 1]
    return d * codes.float()


def _pack_bits(h: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, K] fields of `bits` bits -> uint8 [R, K * bits / 8]: 8 // bits values per byte,
    value v of a byte in bits v*bits.. (least significant first)."""
    per = 8 // bits
    h = h.view(h.shape[0], -1, per)
    out = h[..., 0].clone()
    for v in range(1, per):
        out |= h[..., v] << (v * bits)
    return out


def _interleave_nibbles(q: torch.Tensor, tile_k: int) -> torch.Tensor:
    """uint8 [R, K] values 0..15 -> the 4-bit plane, uint8 [R, K/2], in the order a tensor-core fragment
    takes it. A fragment wants from each 16 values the pairs 2t, 2t+1 and 2t+8, 2t+9 in one thread
    (t = its lane % 4). Each 32 values (a run) of a row give thread t one 32-bit word: byte 2*chunk + parity
    of it holds value 16*chunk + 2*t + parity in its low nibble and that + 8 in its high nibble (chunk,
    parity: 0..1), spread to fp16 pairs by whole-word PRMT and LOP3 (_nibbles_f16) instead of one load and
    ~4 instructions per byte. Within each tile row (tile_k values), thread t's words of all runs lie
    together: byte 4 * runs * t + 4 * run + 2 * chunk + parity (runs = tile_k / 32). So a thread reads its
    row of a tile as one 16-byte shared-memory load (128-value tiles), and the 8 rows a warp reads at once
    are one contiguous stretch: no bank conflicts (with the words of one run together, 8 rows 64 bytes
    apart hit the same banks 4 ways: an H200 profile, docs/PERFORMANCE.md)."""
    r = q.shape[0]
    v = q.view(r, -1, tile_k // 32, 2, 2, 4, 2)      # [R, tile, run, chunk, high, t, parity]
    v = v.permute(0, 1, 5, 2, 3, 6, 4)               # [R, tile, t, run, chunk, parity, high]
    return (v[..., 0] | (v[..., 1] << 4)).reshape(r, -1)


def _deinterleave_nibbles(b: torch.Tensor, tile_k: int) -> torch.Tensor:
    """Inverse of _interleave_nibbles: uint8 [R, K/2] -> uint8 [R, K] values in order."""
    r = b.shape[0]
    v = torch.stack([b & 0x0F, b >> 4], dim=-1).view(r, -1, 4, tile_k // 32, 2, 2, 2)
    return v.permute(0, 1, 3, 4, 6, 2, 5).reshape(r, -1)      # [R, tile, run, chunk, high, t, parity]


def nibble_values(p: "PackedWeight", ids: torch.Tensor | None = None) -> torch.Tensor:
    """The 4-bit plane's values (the low 4 bits of q) row-major, uint8 [rows, K]: all rows or rows ids."""
    return _deinterleave_nibbles(row_major(p, p.planes[0], ids), p.tile_k)


def _interleave_crumbs(h: torch.Tensor, tile_k: int) -> torch.Tensor:
    """uint8 [R, K] values 0..3 -> the 2-bit high plane in fragment order, uint8 [R, K/4]. Each run of 32
    values gives thread t (= lane % 4) two bytes: byte `parity` of them holds, in bits 2f, 2f+1
    (f = chunk + 2*high), value 16*chunk + 8*high + 2*t + parity: the same values as its word of the
    4-bit plane (_interleave_nibbles), spread to fp16 by _crumbs_f16. Within each tile row thread t's
    bytes of all runs lie together, as in the 4-bit plane: byte 2 * runs * t + 2 * run + parity."""
    r = h.shape[0]
    v = h.view(r, -1, tile_k // 32, 2, 2, 4, 2)      # [R, tile, run, chunk, high, t, parity]
    v = v.permute(0, 1, 5, 2, 6, 4, 3).reshape(r, -1, 4)  # [R, tile * t * run * parity, (high, chunk) -> f]
    return v[..., 0] | (v[..., 1] << 2) | (v[..., 2] << 4) | (v[..., 3] << 6)


def _deinterleave_crumbs(b: torch.Tensor, tile_k: int) -> torch.Tensor:
    """Inverse of _interleave_crumbs: uint8 [R, K/4] -> uint8 [R, K] values in order."""
    r = b.shape[0]
    v = torch.stack([(b >> (2 * f)) & 3 for f in range(4)], dim=-1)   # [R, bytes, f = chunk + 2 * high]
    v = v.view(r, -1, 4, tile_k // 32, 2, 2, 2)                        # [R, tile, t, run, parity, high, chunk]
    return v.permute(0, 1, 3, 6, 5, 2, 4).reshape(r, -1)


def high_values(p: "PackedWeight", ids: torch.Tensor | None = None) -> torch.Tensor:
    """The high plane's values (bits 4.. of q) row-major, uint8 [rows, K]: all rows or rows ids."""
    b = row_major(p, p.planes[1], ids)
    return _deinterleave_crumbs(b, p.tile_k) if p.hi_bits == 2 else _unpack_bits(b, p.hi_bits)


def pack_weight(raw: torch.Tensor, qtype, n: int, k: int, tile_n: int = 0, tile_k: int = 0,
                coded: bool | None = None) -> PackedWeight:
    """Repack a quantized GGUF weight of shape [n, k] (n outputs, k inputs; `raw` its GGUF bytes,
    uint8 of any shape, on any device) into the packed affine layout, with torch ops on raw's
    device (so on the GPU at load time; no host synchronisation). coded (default
    kernels.packed_layout.CODED_SCALES): False stores the coded kinds' scales as fp16 products (the
    same values, more bytes). Raises ValueError (UnsupportedTypeError) for unknown/unsupported types
    and for F32/F16/BF16, which are not packed."""
    check_supported(qtype)
    qt = QT(qtype)
    if qt not in _PACKERS:
        raise ValueError(f"{qt.name} is not a quantized type: multiply it with torch instead of packing")
    fn, offset = _PACKERS[qt]
    group, hi_bits, _ = PACKED_LAYOUT[qt.name]
    kind = scale_kind(qt.name, coded)
    as_f16 = kind != PACKED_LAYOUT[qt.name][2]     # a coded kind stored as fp16 products
    type_size = GGML_QUANT_SIZES[qt][1]
    rows = weight_rows(raw, qt, n, k)
    if rows.storage_offset() % 8:
        rows = rows.clone()  # blocks are viewed as int16/int32 words
    dev = rows.device
    tn = tile_n or default_tile_n(n)
    keeps_codes = kind.startswith("codes")
    tk = tile_k or default_tile_k(k, keeps_codes)
    if k % tk or tk % group or tn % 16 or (keeps_codes and SUPER_BLOCK % tk):
        raise ValueError(f"tile {tn}x{tk} does not fit K = {k} (groups of {group})")
    nt, kt = -(-n // tn), k // tk

    def tiled(per_row: int, dtype) -> torch.Tensor:
        return torch.zeros((nt, kt, tn, per_row), dtype=dtype, device=dev)
    if hi_bits == 8:
        planes = (tiled(tk, torch.int8),)
    else:
        planes = (tiled(tk // 2, torch.uint8),)
        if hi_bits:
            planes += (tiled(tk * hi_bits // 8, torch.uint8),)
    g = tk // group
    minv = supers = None
    if kind == "codes+min":
        scale, supers = tiled(2 * g, torch.uint8), tiled(2, torch.float16)
    elif kind == "codes":
        scale, supers = tiled(g, torch.int8), tiled(1, torch.float16)
    else:
        scale = tiled(g, torch.float16)
        if kind == "f16+min":
            minv = tiled(g, torch.float16)

    def put(dst: torch.Tensor, r0: int, rm: torch.Tensor) -> None:
        """Row-major rows r0.. (r0 a multiple of tn) into their tiles."""
        rr = rm.shape[0]
        full = -(-rr // tn) * tn
        if full != rr:
            rm = torch.cat([rm, rm.new_zeros(full - rr, rm.shape[1])])
        dst[r0 // tn:(r0 + full) // tn] = rm.view(full // tn, tn, kt, -1).permute(0, 2, 1, 3)
    step = max(1, _CHUNK_VALUES // max(k, 1)) // tn * tn or tn
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        lo, hi, sc = fn(rows[r0:r1].reshape(-1, type_size))
        if as_f16:
            sc = _products(sc, group)
        rr = r1 - r0
        if hi_bits == 8:
            put(planes[0], r0, lo.reshape(rr, k))
        else:
            lo = lo.reshape(rr, k)
            put(planes[0], r0, _interleave_nibbles(lo, tk))
            if hi_bits == 2:
                put(planes[1], r0, _interleave_crumbs(hi.reshape(rr, k), tk))
            elif hi_bits:
                put(planes[1], r0, _pack_bits(hi.reshape(rr, k), hi_bits))
        if keeps_codes:
            codes, d = sc
            put(scale, r0, codes.reshape(rr, -1))
            # one (d[, dmin]) per tile row: its super-block's
            d = d.reshape(rr, k // SUPER_BLOCK, -1).repeat_interleave(SUPER_BLOCK // tk, dim=1)
            put(supers, r0, d.to(torch.float16).reshape(rr, -1))
        else:
            s, m = sc if kind == "f16+min" else (sc, None)
            put(scale, r0, s.reshape(rr, k // group).to(torch.float16))
            if m is not None:
                put(minv, r0, m.reshape(rr, k // group).to(torch.float16))
    return PackedWeight(planes=planes, scale=scale, minv=minv, n=n, k=k, group=group, hi_bits=hi_bits,
                        qtype=qt, tile_n=tn, tile_k=tk, supers=supers, offset=offset)


def stack_key(p: PackedWeight) -> tuple:
    """What two packed weights must share to be stacked (`stack_rows`): the same layout of a tile."""
    return (p.k, p.group, p.hi_bits, p.tile_n, p.tile_k, p.scale.dtype, p.minv is None, p.codes, p.offset,
            p.device)


def stack_rows(parts: list[PackedWeight]) -> tuple[PackedWeight, list[PackedWeight]]:
    """Weights with the same input (and the same `stack_key`) as one [sum of n_pad, k] weight, their
    tiles one after the other, and each part again as a view into it (so the parts take no memory of
    their own once the caller drops the originals). Part i's outputs are the stack's columns
    offsets[i] .. offsets[i] + n_i, offsets the running sum of the parts' n_pad. The stack's qtype is
    the first part's (all parts have the same packed layout; their GGUF types may differ)."""
    if len({stack_key(p) for p in parts}) != 1:
        raise ValueError("only weights with the same packed tile layout can be stacked")
    first = parts[0]

    def cat(get):
        return None if get(first) is None else torch.cat([get(p) for p in parts])
    planes = tuple(cat(lambda p, i=i: p.planes[i]) for i in range(len(first.planes)))
    stack = PackedWeight(planes=planes, scale=cat(lambda p: p.scale), minv=cat(lambda p: p.minv),
                         n=sum(p.n_pad for p in parts), k=first.k, group=first.group, hi_bits=first.hi_bits,
                         qtype=first.qtype, tile_n=first.tile_n, tile_k=first.tile_k,
                         supers=cat(lambda p: p.supers), offset=first.offset)
    views, b0 = [], 0
    for p in parts:
        b1 = b0 + p.n_pad // p.tile_n

        def band(t):
            return None if t is None else t[b0:b1]
        views.append(PackedWeight(planes=tuple(band(t) for t in planes), scale=band(stack.scale),
                                  minv=band(stack.minv), n=p.n, k=p.k, group=p.group, hi_bits=p.hi_bits,
                                  qtype=p.qtype, tile_n=p.tile_n, tile_k=p.tile_k, supers=band(stack.supers),
                                  offset=p.offset))
        b0 = b1
    return stack, views


def row_major(p: PackedWeight, t: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """One of p's tiled tensors (a plane, scale, minv or supers) as row-major [n, bytes/values per row],
    or only rows `ids` (a 1-D integer tensor)."""
    nt, kt, tn, w = t.shape
    if ids is None:
        return t.permute(0, 2, 1, 3).reshape(nt * tn, kt * w)[:p.n]
    return t.permute(0, 2, 1, 3)[ids // tn, ids % tn].reshape(ids.shape[0], kt * w)


# ---------------------------------------------------------------------------------------------
# torch reference / row gather

def _unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of _pack_bits: uint8 [R, B] -> uint8 [R, B * 8 / bits]."""
    mask = (1 << bits) - 1
    return torch.stack([(p >> (v * bits)) & mask for v in range(8 // bits)], dim=-1).view(p.shape[0], -1)


def group_scales(p: PackedWeight, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every group's scale and min as the kernel uses them: fp16 [rows, k // group] each (row-major, all
    rows or rows `ids`). Coded scales: fp16(d * code) (the float32 product is exact); offset mins:
    offset * scale (exact in fp16); no min: zeros."""
    def sel(t):
        return row_major(p, t, ids)
    sc = sel(p.scale)
    if p.codes:
        sup = sel(p.supers).float()
        sup = sup.view(sup.shape[0], p.k // p.tile_k, p.codes).repeat_interleave(p.tile_k // p.group, dim=1)
        if p.codes == 2:     # [rows, groups, (d, dmin)]; codes: (sc, mn) pairs
            return (sup[..., 0] * sc[:, 0::2].float()).half(), (sup[..., 1] * sc[:, 1::2].float()).half()
        scale = (sup[..., 0] * sc.float()).half()
    else:
        scale = sc
        if p.minv is not None:
            return scale, sel(p.minv)
    return scale, (scale.float() * p.offset).half()


def _dequant(p: PackedWeight, ids: torch.Tensor | None) -> torch.Tensor:
    def sel(t):
        return row_major(p, t, ids)
    if p.hi_bits == 8:
        q = sel(p.planes[0])
    else:
        q = nibble_values(p, ids)
        if p.hi_bits:
            q |= high_values(p, ids) << 4
    r = q.shape[0]
    scale, minv = group_scales(p, ids)
    w = q.float().view(r, p.k // p.group, p.group)
    w.mul_(scale.float()[..., None])    # separate ops in float32, no FMA
    w.sub_(minv.float()[..., None])
    return w.view(r, p.k)


def dequant_packed_ref(p: PackedWeight) -> torch.Tensor:
    """Torch reference of the packed layout: float32 [N, K] = scale * q - minv (float32 ops)."""
    return _dequant(p, None)
