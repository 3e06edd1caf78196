"""The CPU path's quantized matmul as llama.cpp's CPU backend computes it: exact integer dot products per
block, their scales combined in float64 in a fixed order.

llama.cpp rounds the activations to 8-bit integers times a per-block scale (Q8_0 blocks of 32 with an fp16
scale for Q4_0/Q4_1/Q5_x/Q8_0/IQ4_NL weights, Q8_K blocks of 256 with a float32 scale for the K-quants and
IQ4_XS), and every weight type here is small integers times a per-group scale, plus a per-group offset:
w = a * q + c, groups of G = 16 or 32 values along a row. So each group's dot product is an exact integer,
and a row of the result is

    y[r, j] = float32(sum over groups g, in order: (a[j, g] * dx[r, g]) * isum[r, j, g] + c[j, g] * s[r, g])
              + float32(sum over groups g, in order: c[j, g] * e[r, g])

with isum the integer dot of the group's weight and activation integers, dx the activation scale of the
group, s its activation sum (dx times the sum of its integers, exact in float64) and e, for Q4_1 / Q5_1, the
sum as llama.cpp's Q8_1 block stores it, fp16(d * sum), less s (else 0). The minimum times e is rounded on its
own and added in float32, as the float path adds `activations_like_llamacpp`'s error term (kernels/quant/ref.py),
so the two paths' results agree closely (docs/decisions/cpu-matmul.md). The integers are exact whatever the order or the vector width, and
the float64 combine runs in the same order in every implementation (no reassociation, no fused
multiply-add), so the result does not depend on the CPU's instruction set, on the batch a row is in, or on
which implementation ran: by construction, not by luck (docs/decisions/cpu-matmul.md).

This file holds the torch side: the weights repacked once (`IntWeight`: integers int8, the output rows in
tiles of TILE, a and c float32), the activations as integers (`int_activations`), and the two steps in
torch (`block_dots_ref`: the integer dots as a float32 batched matmul, exact since every partial sum is an
integer below 2^24; `combine_ref`). kernels/quant/intdot_numba.py compiles the same two steps with numba, fused into
one kernel for a few rows (decode) and one for many rows (prompts); `int_matmul` picks them.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.quant import intdot_numba
from kernels.quant.intdot_tile import TILE   # output rows per tile of the repacked integers
from kernels.quant.ref import (_as_qtype, _expand_bits, _f16, _fields, _iq4_values, _k_scale_min, check_supported,
                               weight_rows)

QT = GGMLQuantizationType
FEW_ROWS = 4         # up to this many rows take the fused numba kernel (reads the int8 weights once per row)
P_BYTES = 32 << 20   # the float32 block dots of one column tile of a many-row product stay under this

_Q8_K_ACTS = frozenset({QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS})
_Q8_1_SUMS = frozenset({QT.Q4_1, QT.Q5_1})


# ---------------------------------------------------------------------------------------------
# weights: w = a * q + c per group, as gguf-py's dequantization computes it (the same float32 bits)

def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] (nibbles as Q4_0) -> uint8 [n, 32] in value order."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1).view(qs.shape[0], 32)


def _i8(q: torch.Tensor, offset: int = 0) -> torch.Tensor:
    q = q.contiguous().view(torch.int8)
    return q.sub_(offset) if offset else q


def _int_blocks(b: torch.Tensor, qt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Blocks uint8 [n, type_size] -> (q int8 [n, block], a float32 [n, groups], c float32 [n, groups] or
    None, group size G): each value is float32(a * q) + c, bit-identical to dequantize()."""
    n = b.shape[0]
    if qt == QT.Q8_0:
        return b[:, 2:].contiguous().view(torch.int8), _f16(b, 0).view(n, 1), None, 32
    if qt in (QT.Q4_0, QT.Q4_1):
        off = 2 if qt == QT.Q4_0 else 4
        q = _i8(_nibbles(b[:, off:off + 16]), 8 if qt == QT.Q4_0 else 0)
        return q, _f16(b, 0).view(n, 1), (_f16(b, 2).view(n, 1) if qt == QT.Q4_1 else None), 32
    if qt in (QT.Q5_0, QT.Q5_1):
        off = 6 if qt == QT.Q5_0 else 8
        q = _fields(b, off, off + 16, 4, 2, (-1, 16), 1).view(-1, 32)
        q |= _expand_bits(b[:, off - 4:off], 4)
        q = _i8(q, 16 if qt == QT.Q5_0 else 0)
        return q, _f16(b, 0).view(n, 1), (_f16(b, 2).view(n, 1) if qt == QT.Q5_1 else None), 32
    if qt == QT.IQ4_NL:
        return _iq4_values(b[:, 2:]).reshape(n, 32), _f16(b, 0).view(n, 1), None, 32
    if qt == QT.Q2_K:
        sc = b[:, :16]
        a = _f16(b, 80).view(n, 1) * (sc & 0x0F).float()
        c = -(_f16(b, 82).view(n, 1) * (sc >> 4).float())
        return _i8(_fields(b, 16, 80, 2, 4, (-1, 2, 32), 2).view(n, 256)), a, c, 16
    if qt == QT.Q3_K:
        sc = _fields(b, 96, 104, 4, 2, (-1, 8), 1).view(n, 16)
        sc |= _fields(b, 104, 108, 2, 4, (-1, 4), 1, lshift=4).view(n, 16)
        a = _f16(b, 108).view(n, 1) * sc.view(torch.int8).sub_(32).float()
        ql = _fields(b, 32, 96, 2, 4, (-1, 2, 32), 2).view(n, 256)
        ql |= _fields(b, 0, 32, 1, 8, (-1, 32), 1, lshift=2).view(n, 256)
        return _i8(ql, 4), a, None, 16
    if qt in (QT.Q4_K, QT.Q5_K):
        sc, mn = _k_scale_min(b, 4)
        a = _f16(b, 0).view(n, 1) * sc.float()
        c = -(_f16(b, 2).view(n, 1) * mn.float())
        if qt == QT.Q4_K:
            q = _fields(b, 16, 144, 4, 2, (-1, 4, 32), 2).view(n, 256)
        else:
            q = _fields(b, 48, 176, 4, 2, (-1, 4, 32), 2).view(n, 8, 32)
            q |= _fields(b, 16, 48, 1, 8, (-1, 32), 1, lshift=4)
        return _i8(q.view(n, 256)), a, c, 32
    if qt == QT.Q6_K:
        a = _f16(b, 208).view(n, 1) * b[:, 192:208].view(torch.int8).float()
        q = _fields(b, 0, 128, 4, 2, (-1, 2, 64), 2).view(n, 256)
        q |= _fields(b, 128, 192, 2, 4, (-1, 2, 32), 2, lshift=4).view(n, 256)
        return _i8(q, 32), a, None, 16
    if qt == QT.IQ4_XS:
        sl, sh = b[:, 4:8], b[:, 2:4]
        sc = torch.stack([sl & 0x0F, sl >> 4], dim=2).view(n, 8)
        sc |= torch.stack([(sh >> (2 * k)) & 0x03 for k in range(4)], dim=2).view(n, 8) << 4
        a = _f16(b, 0).view(n, 1) * sc.view(torch.int8).sub_(32).float()
        return _iq4_values(b[:, 8:].view(n, 8, 16)).reshape(n, 256), a, None, 32
    raise ValueError(f"{GGMLQuantizationType(qt).name} has no integer form (float weights take matmul_row_invariant)")


INT_TYPES = frozenset({QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL, QT.Q2_K, QT.Q3_K, QT.Q4_K,
                       QT.Q5_K, QT.Q6_K, QT.IQ4_XS})


# 4-bit formats whose integers are a nibble minus a constant: kept two to a byte (half the memory traffic of a
# decode step, which reads every weight once)
_NIBBLE_ZERO = {QT.Q4_0: 8, QT.Q4_1: 0, QT.Q4_K: 0}


class IntWeight:
    """A quantized matrix [n_out, n_in] repacked once for the integer matmul. `q` holds the integers with the
    output rows in tiles of TILE (rows past n_out are 0), each input column's TILE values contiguous: int8
    [n_tiles, n_in, TILE], or for the 4-bit formats uint8 [n_tiles, n_in / 2, TILE] with the value of column
    32 g + i in the low nibble of byte 16 g + i and that of column 32 g + 16 + i in its high nibble, the integer
    being the nibble less `zero`. `a`, `c` float32 [groups, n_pad] (c zero where the format has no offset),
    `group` G. ~0.75 bytes per value for the 4-bit formats, 1.25 for the others (1.5 where G = 16)."""

    def __init__(self, raw: torch.Tensor, qtype, n_out: int, n_in: int):
        qt = _as_qtype(qtype)
        check_supported(qt)
        if qt not in INT_TYPES:
            raise ValueError(f"{qt.name} has no integer form")
        block, type_size = GGML_QUANT_SIZES[qt]
        blocks = weight_rows(raw, qt, n_out, n_in).reshape(-1, type_size)
        if blocks.storage_offset() % 8:
            blocks = blocks.clone()   # fields are read as int16 / int32 words
        q, a, c, g = _int_blocks(blocks, qt)
        self.qtype, self.n_out, self.n_in, self.group = qt, n_out, n_in, g
        self.zero = _NIBBLE_ZERO.get(qt)
        self.q8_k, self.q8_1 = qt in _Q8_K_ACTS, qt in _Q8_1_SUMS   # how the activations are rounded
        n_tiles = -(-n_out // TILE)
        self.n_pad = n_tiles * TILE
        pad = self.n_pad - n_out
        q = q.reshape(n_out, n_in)
        if pad:
            q = torch.cat([q, q.new_zeros(pad, n_in)])
        if self.zero is not None:   # two nibbles to a byte
            nib = (q + self.zero).view(torch.uint8).view(self.n_pad, n_in // 32, 2, 16)
            q = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(self.n_pad, n_in // 2)
        self.q = q.view(n_tiles, TILE, -1).transpose(1, 2).contiguous()
        n_groups = n_in // g

        def cols(t):
            t = t.reshape(n_out, n_groups)
            if pad:
                t = torch.cat([t, t.new_zeros(pad, n_groups)])
            return t.T.contiguous()
        self.a = cols(a)
        self.has_offset = c is not None
        self.c = cols(c) if c is not None else torch.zeros_like(self.a)

    def integers(self, t0: int = 0, t1: int | None = None) -> torch.Tensor:
        """Tiles t0..t1 of the integers as int8 [(t1 - t0) * TILE, n_in] (output rows first)."""
        q = self.q[t0:t1]
        if self.zero is not None:
            lo, hi = (q & 0x0F), (q >> 4)
            q = torch.stack((lo.view(q.shape[0], -1, 16, TILE), hi.view(q.shape[0], -1, 16, TILE)), dim=2)
            q = q.reshape(q.shape[0], self.n_in, TILE).view(torch.int8) - self.zero
        return q.transpose(1, 2).reshape(-1, self.n_in)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * (self.a.numel() + self.c.numel())

    def dequantized(self) -> torch.Tensor:
        """float32 [n_out, n_in]: float32(a * q) + c, the bits dequantize() gives (for tests)."""
        g = self.group
        q = self.integers()[:self.n_out].float()
        a = self.a.T[:self.n_out].repeat_interleave(g, dim=1)
        w = q * a
        return w + self.c.T[:self.n_out].repeat_interleave(g, dim=1) if self.has_offset else w

    def float_columns(self, t0: int, t1: int) -> torch.Tensor:
        """Tiles t0..t1 of the integers as float32 [groups, G, (t1 - t0) * TILE] (exact), for block_dots_ref."""
        k = self.n_in
        w = self.integers(t0, t1).T.float()
        return w.reshape(k // self.group, self.group, -1)


def stack_int_weights(parts: list[IntWeight]) -> tuple[IntWeight, list[int]]:
    """Matrices of one type and input size that multiply the same input, as one IntWeight whose outputs are the
    parts' padded outputs one after another (tiles concatenated; every output column is computed alone, so a part's
    columns of the stack's product are its own product, the same bits), and each part's first column in it. One
    activation rounding and one kernel call for the whole stack."""
    first = parts[0]
    if any((w.qtype, w.n_in) != (first.qtype, first.n_in) for w in parts):
        raise ValueError("stacked integer weights need one type and one input size")
    st = object.__new__(IntWeight)
    st.qtype, st.n_in, st.group, st.zero = first.qtype, first.n_in, first.group, first.zero
    st.q8_k, st.q8_1, st.has_offset = first.q8_k, first.q8_1, first.has_offset
    st.q = torch.cat([w.q for w in parts])
    st.a = torch.cat([w.a for w in parts], dim=1)
    st.c = torch.cat([w.c for w in parts], dim=1)
    st.n_pad = st.n_out = sum(w.n_pad for w in parts)
    cols, col = [], 0
    for w in parts:
        cols.append(col)
        col += w.n_pad
    return st, cols


# ---------------------------------------------------------------------------------------------
# activations: the integers and scales llama.cpp's CPU backend quantizes them to

def int_activations(x: torch.Tensor, qtype, group: int, fast: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (integers int8 [M, K], scale dx, sum s and Q8_1 sum error e, float64 [M, K / group]) as
    llama.cpp rounds activations for `qtype` weights (kernels/quant/ref.py: activations_like_llamacpp, whose values
    are these integers times dx). s is dx times the group's integer sum (exact in float64); e, for Q4_1 / Q5_1, the
    block sum llama.cpp's Q8_1 block stores, fp16(d * sum) with d the unrounded scale, less s (else 0).
    fast: the numba loop (the same bits)."""
    qt = _as_qtype(qtype)
    M, K = x.shape
    if fast:   # the same bits, from one numba loop instead of some fifteen torch ops
        xq = torch.empty(M, K, dtype=torch.int8)
        dx, s, e = torch.empty(3, M, K // group, dtype=torch.float64)
        intdot_numba.activations(x, qt in _Q8_K_ACTS, qt in _Q8_1_SUMS, group, xq, dx, s, e)
        return xq, dx, s, e
    if qt in _Q8_K_ACTS:
        b = x.reshape(M, K // 256, 256)
        idx = b.abs().argmax(-1, keepdim=True)
        mx = torch.gather(b, -1, idx)
        iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
        q = torch.round(b * iscale).clamp(max=127)
        d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale)).double()
        dx = d.expand(M, K // 256, 256 // group).reshape(M, K // group)
        qsum = q.view(M, K // group, group).sum(-1, dtype=torch.float64)
        return q.to(torch.int8).view(M, K), dx.contiguous(), dx * qsum, torch.zeros_like(dx)
    b = x.reshape(M, K // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv)
    d = d[..., 0]
    dx = d.to(torch.float16).double()
    qsum = q.sum(-1)   # exact: integers below 2^13
    s = dx * qsum.double()
    if qt in _Q8_1_SUMS:
        e = (qsum * d).to(torch.float16).double() - s
    else:
        e = torch.zeros_like(s)
    return q.to(torch.int8).view(M, K), dx, s, e


# ---------------------------------------------------------------------------------------------
# the two steps in torch (the reference; the many-row path where numba is present)

def block_dots_ref(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xq int8 [M, K], w float32 [groups, G, N] integers -> float32 [groups, M, N]: each group's integer dot.
    Exact (every partial sum is an integer below 2^24), so BLAS's order does not matter."""
    groups, g, _ = w.shape
    x = xq.float().view(-1, groups, g).transpose(0, 1)
    return torch.bmm(x, w)


def combine_ref(p: torch.Tensor, a: torch.Tensor, c: torch.Tensor, dx: torch.Tensor, s: torch.Tensor,
                e: torch.Tensor) -> torch.Tensor:
    """p float32 [groups, M, N], a / c float32 [groups, N], dx / s / e float64 [M, groups] -> float32 [M, N]:
    float32(sum over groups in order of (a * dx) * p + c * s) + float32(sum over groups in order of c * e), the
    sums in float64."""
    acc = torch.zeros(p.shape[1:], dtype=torch.float64)
    acc2 = torch.zeros(p.shape[1:], dtype=torch.float64)
    for g in range(p.shape[0]):
        cg = c[g].double()[None, :]
        t = (a[g].double()[None, :] * dx[:, g:g + 1]) * p[g].double()
        acc = acc + (t + cg * s[:, g:g + 1])
        acc2 = acc2 + cg * e[:, g:g + 1]
    return acc.float() + acc2.float()


def _column_tiles(w: IntWeight, m: int) -> int:
    """Tiles per column chunk of a many-row product: its block dots under P_BYTES."""
    per_tile = (w.n_in // w.group) * m * TILE * 4
    return max(1, P_BYTES // max(1, per_tile))


def int_matmul(x: torch.Tensor, w: IntWeight, fast: bool | None = None) -> torch.Tensor:
    """x float32 [M, n_in] @ W.T -> float32 [M, n_out], x rounded as llama.cpp rounds it. fast: the numba kernels
    (default: when numba imports); False: torch alone (the reference). Both give the same bits."""
    if fast is None:
        fast = intdot_numba.available()
    M = x.shape[0]
    if fast:
        out = intdot_numba.few_rows_matmul(w, x) if M <= FEW_ROWS else intdot_numba.many_rows_matmul(w, x)
    else:
        xq, dx, s, e = int_activations(x, w.qtype, w.group)
        out = torch.empty(M, w.n_pad, dtype=torch.float32)
        n_tiles = w.q.shape[0]
        step = _column_tiles(w, M)
        for t0 in range(0, n_tiles, step):
            t1 = min(t0 + step, n_tiles)
            lo, hi = t0 * TILE, t1 * TILE
            p = block_dots_ref(xq, w.float_columns(t0, t1))
            out[:, lo:hi] = combine_ref(p, w.a[:, lo:hi], w.c[:, lo:hi], dx, s, e)
    return out[:, :w.n_out] if w.n_pad != w.n_out else out
