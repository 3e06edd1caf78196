"""Torch dequantization references for GGUF weight types.

Bit-exact with `gguf.quants.dequantize` (gguf-py's numpy code). Integer unpacking happens in
uint8/int8 and is exact whatever the order; every float operation is done in float32 in the same
order as gguf-py (e.g. Q4_K: d*sc and dmin*m first, then (d*sc)*q - (dmin*m)), as separate ops,
never fused (no addcmul/FMA). (In these formats the products of an fp16 scale and small integers
are exact in float32, so in practice only the final add/sub of Q4_1/Q5_1/K-quant mins rounds.)

Vectorized over all blocks (no Python loop over blocks) and device-agnostic: it runs wherever
`raw` lives. Each format's function takes `b`, uint8 [n_blocks, type_size], and writes float32
[n_blocks, block_size] into `out`.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QT = GGMLQuantizationType

__all__ = [
    "SUPPORTED_TYPES", "UnsupportedTypeError", "check_supported", "row_bytes",
    "dequantize", "dequantize_rows", "quantized_matmul_ref",
]


class UnsupportedTypeError(ValueError):
    """A GGUF tensor type that this dequantizer does not handle."""


# ---------------------------------------------------------------------------------------------
# helpers
#
# Speed notes (CPU, measured): torch elementwise ops are fast on contiguous data but slow on
# strided views with short rows (a per-row overhead, and uint8 ops fall back to scalar code on
# rows shorter than a vector), and shifting by a broadcast tensor of shift amounts is ~50x
# slower than by a scalar. So bit fields are taken with scalar shifts over contiguous bytes
# (whole blocks for the 32-value formats, a copied-out byte region for the 256-value ones), on
# int16 words (2 bytes per element; bits that cross over from the neighbouring byte are masked
# off afterwards), gathered into value order by one torch.stack, then converted to float32 and
# scaled in place. Q4_0/Q4_1 instead convert whole nibble planes to float and gather inside the
# scale multiply. Fresh allocations are costly too (page faults), hence the `out=` parameters.


@lru_cache(maxsize=None)
def _bit_lut(shift: int, device: torch.device) -> torch.Tensor:
    """int64 [256]: entry v holds 8 bytes, byte j = ((v >> j) & 1) << shift (in memory order)."""
    v = torch.arange(256)
    bits = ((v[:, None] >> torch.arange(8)) & 1) << shift
    return bits.to(torch.uint8).contiguous().view(torch.int64).view(256).to(device)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 field at (even) byte `off` of every block, as float32 [n_blocks]."""
    return b.view(torch.int16)[:, off // 2].view(torch.float16).float()


def _fields(b: torch.Tensor, start: int, stop: int, bits: int, count: int, shape: tuple[int, ...],
            dim: int, lshift: int = 0) -> torch.Tensor:
    """Bit fields of bytes b[:, start:stop] (viewed as `shape`): field k = (byte >> bits*k) & mask,
    for k < count, stacked at `dim`, each shifted left by `lshift`. Contiguous uint8 result."""
    if b.shape[1] < 64:
        r = b  # small blocks: shifting whole blocks costs less than copying the region out
    else:
        r, start, stop = b[:, start:stop].contiguous(), 0, stop - start
    w = r.view(torch.int16)  # every block and region size is even
    parts = [r] + [(w >> (bits * k)).view(torch.uint8) for k in range(1, count)]
    q = torch.stack([p[:, start:stop].view(shape) for p in parts], dim=dim)
    q &= (1 << bits) - 1
    if lshift:
        q <<= lshift
    return q


def _expand_bits(x: torch.Tensor, lshift: int) -> torch.Tensor:
    """uint8 x [n, k] -> uint8 [n, 8k]: bit j of byte i becomes byte 8*i + j, shifted left by
    `lshift` (one table lookup per byte)."""
    idx = x.reshape(-1).int()
    return _bit_lut(lshift, x.device).index_select(0, idx).view(torch.uint8).view(x.shape[0], -1)


def _scale_q(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = float32(q) * scale (q integer, so exactly representable; scale [n, ...] is
    broadcast over q's trailing dims). Returns out viewed as q's shape."""
    out = out.view(q.shape)
    scale = scale.view(scale.shape + (1,) * (q.dim() - scale.dim()))
    out.copy_(q)
    out.mul_(scale)
    return out


def _bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """t [n, ...] viewed with trailing size-1 dims up to `ndim` dims, for broadcasting."""
    return t.view(t.shape + (1,) * (ndim - t.dim()))


# ---------------------------------------------------------------------------------------------
# formats (block layouts are byte offsets inside one block; f16 = little-endian half float;
# "nibbles as Q4_0" = value j of a 32-value group in the low nibble of byte j, value 16+j in the
# high nibble of byte j)

# F32 / F16 / BF16: no blocks (block size 1); handled directly in _dense().

def _q8_0(b, out):
    # Q8_0, 34 bytes / 32 values: d f16 [0:2] | qs int8[32] [2:34];  x = qs * d
    _scale_q(b[:, 2:].view(torch.int8), _f16(b, 0), out)


def _nibble_planes(b: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high nibbles of every byte of the blocks, plus `offset`, as float32 [n, type_size].
    Small-block formats gather their values from these with strided float ops, which is
    cheaper than gathering bytes (float rows of 16 are still vectorized; byte rows are not)."""
    planes = []
    for p in (b & 0x0F, b >> 4):
        if offset:
            p = p.view(torch.int8).add_(offset)
        planes.append(p.float())
    return planes[0], planes[1]


def _q4_0(b, out):
    # Q4_0, 18 bytes / 32 values: d f16 [0:2] | qs[16] [2:18] (nibbles as Q4_0);  x = d * (q - 8)
    n = b.shape[0]
    d, o = _f16(b, 0).view(n, 1), out.view(n, 2, 16)
    for h, plane in enumerate(_nibble_planes(b, -8)):
        torch.mul(plane[:, 2:], d, out=o[:, h])


def _q4_1(b, out):
    # Q4_1, 20 bytes / 32 values: d f16 [0:2] | m f16 [2:4] | qs[16] [4:20] (nibbles as Q4_0);
    # x = (d * q) + m
    n = b.shape[0]
    d, o = _f16(b, 0).view(n, 1), out.view(n, 2, 16)
    for h, plane in enumerate(_nibble_planes(b)):
        torch.mul(plane[:, 4:], d, out=o[:, h])
    out.add_(_f16(b, 2).view(n, 1))


def _q5_0(b, out):
    # Q5_0, 22 bytes / 32 values: d f16 [0:2] | qh u32 [2:6] | qs[16] [6:22] (low 4 bits, nibbles
    # as Q4_0; bit j of the little-endian qh is bit 4 of value j);  x = d * (q - 16)
    q = _fields(b, 6, 22, 4, 2, (-1, 16), 1).view(-1, 32)
    q |= _expand_bits(b[:, 2:6], 4)
    _scale_q(q.view(torch.int8).sub_(16), _f16(b, 0), out)


def _q5_1(b, out):
    # Q5_1, 24 bytes / 32 values: d f16 [0:2] | m f16 [2:4] | qh u32 [4:8] | qs[16] [8:24]
    # (as Q5_0);  x = (d * q) + m
    q = _fields(b, 8, 24, 4, 2, (-1, 16), 1).view(-1, 32)
    q |= _expand_bits(b[:, 4:8], 4)
    _scale_q(q, _f16(b, 0), out).add_(_bcast(_f16(b, 2), 2))


def _q2_k(b, out):
    # Q2_K, 84 bytes / 256 values: scales[16] [0:16] (low nibble: scale, high nibble: min of
    # each 16-value group) | qs[64] [16:80] (2 bits; qs[32*h + l] holds values
    # 128*h + 32*k + l in bits 2k..2k+1) | d f16 [80:82] | dmin f16 [82:84];
    # x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    sc = b[:, :16]
    dl = _f16(b, 80).view(n, 1) * (sc & 0x0F).float()
    ml = _f16(b, 82).view(n, 1) * (sc >> 4).float()
    q = _fields(b, 16, 80, 2, 4, (-1, 2, 32), 2).view(n, 16, 16)
    _scale_q(q, dl, out).sub_(_bcast(ml, 3))


def _q3_k(b, out):
    # Q3_K, 110 bytes / 256 values: hmask[32] [0:32] (bit k of hmask[l]: high bit of value
    # 32*k + l) | qs[64] [32:96] (low 2 bits, laid out as Q2_K) | scales[12] [96:108] (16 6-bit
    # scales: low 4 bits = the nibbles of bytes 0..7 (all low nibbles first), high 2 bits = the
    # 2-bit fields of bytes 8..11 (field k of byte i: scale 4*k + i)) | d f16 [108:110];
    # x = (d * (sc - 32)) * (q_low - 4 * (1 - high bit))
    n = b.shape[0]
    sc = _fields(b, 96, 104, 4, 2, (-1, 8), 1).view(n, 16)
    sc |= _fields(b, 104, 108, 2, 4, (-1, 4), 1, lshift=4).view(n, 16)
    dl = _f16(b, 108).view(n, 1) * sc.view(torch.int8).sub_(32).float()
    ql = _fields(b, 32, 96, 2, 4, (-1, 2, 32), 2).view(n, 256)
    # ql - 4*(1 - h) == (ql | h << 2) - 4
    ql |= _fields(b, 0, 32, 1, 8, (-1, 32), 1, lshift=2).view(n, 256)
    q = ql.view(torch.int8).sub_(4).view(n, 16, 16)
    _scale_q(q, dl, out)


def _k_scale_min(b: torch.Tensor, off: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 scale bytes at `off` -> (sc, m) uint8 [n, 8], 6 bits each: bytes 0..3 hold
    sc0..3 (low 6 bits) and the top 2 bits of sc4..7; bytes 4..7 the same for m; bytes 8..11
    the low 4 bits of sc4..7 (low nibble) and m4..7 (high nibble).
    Done 4 bytes at a time on int32 words (SWAR; little-endian byte order)."""
    w = b.view(torch.int32)
    d, m, md = (w[:, off // 4 + i] for i in range(3))
    sc_hi = (md & 0x0F0F0F0F) | ((d >> 2) & 0x30303030)
    mn_hi = ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)
    sc = torch.stack([d & 0x3F3F3F3F, sc_hi], dim=1).view(torch.uint8)
    mn = torch.stack([m & 0x3F3F3F3F, mn_hi], dim=1).view(torch.uint8)
    return sc, mn


def _q4_k(b, out):
    # Q4_K, 144 bytes / 256 values: d f16 [0:2] | dmin f16 [2:4] | scales[12] [4:16] (8 6-bit
    # scale/min pairs, see _k_scale_min) | qs[128] [16:144] (32-byte chunk c holds value
    # 64*c + l in the low nibble of byte l, 64*c + 32 + l in the high nibble);
    # x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    sc, mn = _k_scale_min(b, 4)
    dl = _f16(b, 0).view(n, 1) * sc.float()
    ml = _f16(b, 2).view(n, 1) * mn.float()
    q = _fields(b, 16, 144, 4, 2, (-1, 4, 32), 2).view(n, 8, 32)
    _scale_q(q, dl, out).sub_(_bcast(ml, 3))


def _q5_k(b, out):
    # Q5_K, 176 bytes / 256 values: d f16 [0:2] | dmin f16 [2:4] | scales[12] [4:16] (as Q4_K) |
    # qh[32] [16:48] (bit k of qh[l]: bit 4 of value 32*k + l) | qs[128] [48:176] (low 4 bits, as
    # Q4_K);  x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    sc, mn = _k_scale_min(b, 4)
    dl = _f16(b, 0).view(n, 1) * sc.float()
    ml = _f16(b, 2).view(n, 1) * mn.float()
    q = _fields(b, 48, 176, 4, 2, (-1, 4, 32), 2).view(n, 8, 32)
    q |= _fields(b, 16, 48, 1, 8, (-1, 32), 1, lshift=4)
    _scale_q(q, dl, out).sub_(_bcast(ml, 3))


def _q6_k(b, out):
    # Q6_K, 210 bytes / 256 values: ql[128] [0:128] (low 4 bits: 64-byte half h holds value
    # 128*h + l in the low nibble of byte l, 128*h + 64 + l in the high nibble) | qh[64] [128:192]
    # (high 2 bits: 32-byte half h holds value 128*h + 32*k + l in bits 2k..2k+1 of byte l) |
    # scales int8[16] [192:208] (one per 16 values) | d f16 [208:210];
    # x = (d * sc) * (q - 32)
    n = b.shape[0]
    dl = _f16(b, 208).view(n, 1) * b[:, 192:208].view(torch.int8).float()
    q = _fields(b, 0, 128, 4, 2, (-1, 2, 64), 2).view(n, 256)
    q |= _fields(b, 128, 192, 2, 4, (-1, 2, 32), 2, lshift=4).view(n, 256)
    q = q.view(torch.int8).sub_(32).view(n, 16, 16)
    _scale_q(q, dl, out)


_IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@lru_cache(maxsize=None)
def _iq4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [256] each: the table value of a byte's low nibble, and of its high nibble."""
    kv, v = torch.tensor(_IQ4_KVALUES, dtype=torch.int8), torch.arange(256)
    return kv[v & 0x0F].to(device), kv[v >> 4].to(device)


def _iq4_values(qs: torch.Tensor) -> torch.Tensor:
    """uint8 qs [..., 16] (32 4-bit indices, nibbles as Q4_0) -> int8 [..., 2, 16] table values."""
    idx = qs.reshape(-1).int()
    lo, hi = (t.index_select(0, idx).view(qs.shape) for t in _iq4_tables(qs.device))
    return torch.stack((lo, hi), dim=-2)


def _iq4_nl(b, out):
    # IQ4_NL, 18 bytes / 32 values: d f16 [0:2] | qs[16] [2:18] (4-bit indices, nibbles as Q4_0)
    # into the fixed 16-entry non-linear table _IQ4_KVALUES;  x = d * table[q]
    _scale_q(_iq4_values(b[:, 2:]), _f16(b, 0), out)


def _iq4_xs(b, out):
    # IQ4_XS, 136 bytes / 256 values: d f16 [0:2] | scales_h u16 [2:4] (bits 2i..2i+1: high bits
    # of scale i) | scales_l[4] [4:8] (scale 2j in the low nibble of byte j, 2j+1 in the high) |
    # qs[128] [8:136] (16 bytes per 32 values, nibbles as Q4_0, indices into _IQ4_KVALUES);
    # x = (d * (sc - 32)) * table[q]
    n = b.shape[0]
    sl, sh = b[:, 4:8], b[:, 2:4]
    sc = torch.stack([sl & 0x0F, sl >> 4], dim=2).view(n, 8)
    sc |= torch.stack([(sh >> (2 * k)) & 0x03 for k in range(4)], dim=2).view(n, 8) << 4
    sc = sc.view(torch.int8).sub_(32)
    dl = _f16(b, 0).view(n, 1) * sc.float()
    _scale_q(_iq4_values(b[:, 8:].view(n, 8, 16)), dl, out)  # [n, 8, 2, 16]


_BLOCK_FNS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1,
    QT.Q2_K: _q2_k, QT.Q3_K: _q3_k, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k,
    QT.IQ4_NL: _iq4_nl, QT.IQ4_XS: _iq4_xs,
}
_DENSE = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DENSE) | frozenset(_BLOCK_FNS)


# ---------------------------------------------------------------------------------------------
# public API

def _as_qtype(qtype) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedTypeError(f"unknown GGML tensor type id {qtype!r}") from None


def check_supported(qtype) -> None:
    """Raise UnsupportedTypeError (a ValueError) naming `qtype` unless it can be dequantized."""
    qt = _as_qtype(qtype)
    if qt not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise UnsupportedTypeError(
            f"GGUF tensor type {qt.name} is not supported (supported types: {names})")


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of `n_cols` values (n_cols must be a multiple of the block size).
    Works for every GGML type, supported or not."""
    qt = _as_qtype(qtype)
    block, type_size = GGML_QUANT_SIZES[qt]
    if n_cols % block:
        raise ValueError(f"{qt.name} rows must hold a multiple of {block} values, got {n_cols}")
    return n_cols // block * type_size


def _dense(raw: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """F32/F16/BF16 bytes (flat uint8, 8-byte aligned) -> float32 into flat `out`. The
    conversion is exact; only F16 signalling-NaN payloads may come out quieted (see tests)."""
    out.copy_(raw.view(dtype))


def _dequantize_flat(raw: torch.Tensor, qt: GGMLQuantizationType, n: int,
                     out: torch.Tensor | None) -> torch.Tensor:
    """raw bytes of n values (any shape) -> float32 [n] (written into `out` if given)."""
    check_supported(qt)
    block, type_size = GGML_QUANT_SIZES[qt]
    if n % block:
        raise ValueError(f"{qt.name}: {n} values is not a multiple of the block size {block}")
    n_blocks = n // block
    if raw.numel() * raw.element_size() != n_blocks * type_size:
        raise ValueError(f"{qt.name}: {n} values need {n_blocks * type_size} bytes, "
                         f"got {raw.numel() * raw.element_size()}")
    raw = raw.reshape(-1)
    if raw.dtype != torch.uint8:
        raw = raw.view(torch.uint8)
    if raw.storage_offset() % 8:
        raw = raw.clone()  # blocks are viewed as int16/int32 words (and F32 as float32)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=raw.device)
    else:
        if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 tensor of {n} elements")
        out = out.view(n)
    if qt in _DENSE:
        _dense(raw, _DENSE[qt], out)
    elif n_blocks:
        _BLOCK_FNS[qt](raw.view(n_blocks, type_size), out.view(n_blocks, block))
    return out


def dequantize(raw: torch.Tensor, qtype, shape: tuple[int, ...], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF bytes (uint8, any shape) of a tensor of torch shape `shape` -> float32 `shape`,
    bit-identical to gguf.quants.dequantize. `out` (optional): a contiguous float32 buffer of
    prod(shape) elements to write into, avoiding an allocation."""
    shape = tuple(int(s) for s in shape)
    return _dequantize_flat(raw, _as_qtype(qtype), math.prod(shape), out).view(shape)


def dequantize_rows(raw_rows: torch.Tensor, qtype, n_cols: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [n_rows, row_bytes] -> float32 [n_rows, n_cols] (see `dequantize`). A 1-D
    `raw_rows` is taken as whole rows back to back."""
    qt = _as_qtype(qtype)
    check_supported(qt)
    if raw_rows.dim() >= 2:
        n_rows = raw_rows.shape[0]
    else:
        rb = row_bytes(qt, n_cols)
        n_rows = raw_rows.numel() * raw_rows.element_size() // rb if rb else 0
    return dequantize(raw_rows, qt, (n_rows, n_cols), out=out)


def weight_rows(raw: torch.Tensor, qtype, n_rows: int, n_cols: int) -> torch.Tensor:
    """A weight's GGUF bytes as uint8 [n_rows, row_bytes]; ValueError when their number is wrong."""
    qt = _as_qtype(qtype)
    rb = row_bytes(qt, n_cols)
    b = raw.reshape(-1)
    if b.dtype != torch.uint8:
        b = b.view(torch.uint8)
    if b.numel() != n_rows * rb:
        raise ValueError(f"{qt.name} [{n_rows}, {n_cols}] needs {n_rows * rb} bytes, got {b.numel()}")
    return b.view(n_rows, rb)


def quantized_matmul_ref(x: torch.Tensor, raw: torch.Tensor, qtype, n_out: int, n_in: int,
                         tile_rows: int = 4096) -> torch.Tensor:
    """x [M, n_in] float32 @ W.T -> [M, n_out], W = dequantize(raw, qtype, (n_out, n_in)),
    expanding at most `tile_rows` rows of W at a time (one reused float32 buffer)."""
    qt = _as_qtype(qtype)
    check_supported(qt)
    if x.shape[-1] != n_in:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight has {n_in}")
    buf = torch.empty(max(1, min(tile_rows, n_out)) * n_in, dtype=torch.float32, device=raw.device)
    return matmul_tiles(x, _tiles(raw, qt, n_out, n_in, tile_rows, buf), n_out)


def _tiles(raw: torch.Tensor, qt, n_out: int, n_in: int, tile_rows: int, buf: torch.Tensor | None = None):
    """W's rows dequantized tile_rows at a time: float32 [<= tile_rows, n_in] each (into buf if given,
    which each next tile overwrites)."""
    rows = weight_rows(raw, qt, n_out, n_in)
    tile_rows = max(1, min(tile_rows, n_out))
    for start in range(0, n_out, tile_rows):
        stop = min(start + tile_rows, n_out)
        out = None if buf is None else buf[:(stop - start) * n_in]
        yield dequantize_rows(rows[start:stop], qt, n_in, out=out)


def dequantized_tiles(raw: torch.Tensor, qtype, n_out: int, n_in: int, tile_rows: int = 4096) -> list[torch.Tensor]:
    """The tiles quantized_matmul_ref expands, kept: float32 [<= tile_rows, n_in] each."""
    return list(_tiles(raw, _as_qtype(qtype), n_out, n_in, tile_rows))


def matmul_tiles(x: torch.Tensor, tiles, n_out: int) -> torch.Tensor:
    """x [..., n_in] @ W.T -> float32 [..., n_out], W's rows given as successive tiles (kept ones from
    `dequantized_tiles`, or quantized_matmul_ref's expanded on the fly): each tile's product row-invariant."""
    y = torch.empty(x.shape[:-1] + (n_out,), dtype=torch.float32, device=x.device)
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, n_out)
    start = 0
    for w in tiles:
        y2[:, start:start + w.shape[0]] = matmul_row_invariant(x2, w)
        start += w.shape[0]
    return y


ROW_BLOCK = 16


def wide_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b; float32 operands are multiplied and summed in float64 (the products are exact there) and the
    result rounded back, so it hardly ever depends on the order BLAS sums in, which changes with the shapes
    and the CPU's instruction set (docs/ACCURACY.md)."""
    if a.dtype != torch.float32:
        return a @ b
    return (a.double() @ b.double()).float()


def wide_einsum(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum; on the CPU, float32 operands in float64 and the result rounded back, as wide_matmul
    (on a GPU as given: one kind of GPU gives one set of bits, and float64 there is slow)."""
    if a.device.type != "cpu" or a.dtype != torch.float32:
        return torch.einsum(eq, a, b)
    return torch.einsum(eq, a.double(), b.double()).float()


def matmul_row_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T (float32) with every row computed by the same [ROW_BLOCK, K] x [K, N] product, so a
    row's result does not depend on M or on the other rows (BLAS picks different kernels, and so
    different summation orders, for different M). This is what keeps a sequence's tokens the same
    whether it runs alone or beside others. The products are summed in float64 (wide_matmul), since BLAS
    also changes the summation order with the CPU's instruction set: in float32, a 2-core AVX2 machine moved SmolLM2's
    same-top-token rate against llama.cpp from 95.7 % to 94.6 % with the same code (docs/ACCURACY.md);
    it costs the demo model's CPU path ~13 %."""
    M, K = x.shape
    pad = (-M) % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, K)])
    y = wide_matmul(x.view(-1, ROW_BLOCK, K), w.T)
    return y.reshape(-1, w.shape[0])[:M]


# --- activation rounding as llama.cpp's CPU backend does it -------------------------------------
# llama.cpp multiplies quantized weights with activations that it first quantizes to 8 bits per
# value ("vec_dot_type"): Q8_0/Q8_1 blocks of 32 (fp16 scale) for the 32-value formats, Q8_K
# blocks of 256 (fp32 scale) for the K-quants and IQ4_XS. Its answers carry that rounding, so the
# CPU reference reproduces it to agree with llama.cpp's perplexities, not just its argmaxes.
_Q8_K_ACT_TYPES = frozenset({GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
                             GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_XS})
_Q8_0_ACT_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                             GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.IQ4_NL})


_Q8_1_MIN_TYPES = frozenset({GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1})


def block_mins(raw: torch.Tensor, qtype, n_rows: int, n_cols: int) -> torch.Tensor:
    """The fp16 minimum m of every block of a Q4_1 / Q5_1 weight, float32 [n_rows, n_cols / 32]."""
    b = weight_rows(raw, qtype, n_rows, n_cols).reshape(-1, GGML_QUANT_SIZES[_as_qtype(qtype)][1])
    return _f16(b, 2).view(n_rows, n_cols // 32)


def activations_like_llamacpp(x: torch.Tensor, qtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [M, K] float32 -> (the values llama.cpp's CPU matmul actually multiplies with, and for weights
    whose blocks have a minimum (Q4_1, Q5_1) the error of their block sums, else None). llama.cpp multiplies
    such a minimum m with the activation block's sum as its Q8_1 block stores it, fp16(d * sum(q)) with d
    the unrounded scale, where the rounded values sum to fp16(d) * sum(q): the error [M, K / 32] is the
    stored sum less that (add error @ block_mins.T to x @ W.T)."""
    qtype = GGMLQuantizationType(qtype)
    M, K = x.shape
    if qtype in _Q8_0_ACT_TYPES:
        b = x.reshape(M, K // 32, 32)
        d = b.abs().amax(-1, keepdim=True) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(b * inv)  # llama.cpp: roundf (half away from zero) vs torch half-to-even: ties are rare
        d16 = d.to(torch.float16).to(torch.float32)
        err = None
        if qtype in _Q8_1_MIN_TYPES:
            qsum = q.sum(-1)
            err = (qsum * d[..., 0]).to(torch.float16).to(torch.float32) - qsum * d16[..., 0]
        return (q * d16).reshape(M, K), err
    if qtype in _Q8_K_ACT_TYPES:
        b = x.reshape(M, K // 256, 256)
        idx = b.abs().argmax(-1, keepdim=True)
        mx = torch.gather(b, -1, idx)
        iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
        q = torch.round(b * iscale).clamp(max=127)
        d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale))
        return (q * d).reshape(M, K), None
    if qtype == GGMLQuantizationType.F16:
        return x.to(torch.float16).to(torch.float32), None
    return x, None
