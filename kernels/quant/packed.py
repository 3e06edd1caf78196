"""The Triton matmul over the packed layout of every quantized GGUF weight type (kernels/quant/packing.py: the
layout, its packer and torch reference): M rows against each weight tile while the tile is on chip (decode tokens
and drafts, or a prefill chunk), its launch settings per GPU family, the fp16 dequantization of a whole matrix for
cuBLAS prefill, and a row gather for embedding tables.

The matmul kernel is split-K like q4_matmul: program (m-block, n-tile, k-slice) loads each
[TILE_N, TILE_K] tile of the planes and scales once, dequantizes it in registers (in fp32,
rounded once to fp16) and multiplies it with a [BLOCK_M = 16, BLOCK_K] block of x (fp16) with
tl.dot (grid axes 0, 1, 2 = m-block, n-tile, k-slice: the m-blocks vary fastest, so when M > 16
the programs that share a weight tile run together and all but the first find it in L2),
accumulating fp32; each k-slice writes its own partial sums, which are added afterwards in a
fixed order (no atomics). On sm_90+ the engine's decode settings bring each tile in by TMA (its
planes, scales and mins as tensor descriptors, `_descriptors`): the same values, 4 % off a 27B
step. Block sizes and the split come from the weight's shape only, never from M, so a row's result
is bit-identical whatever the other rows are (batch invariance), and nothing reads tensor values on
the host, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache

import torch

from kernels.family import FAMILIES, Family, by_family, device_family
from kernels.pdl import pdl_args
from kernels.quant.packing import PackedWeight, _dequant

try:
    import triton
    import triton.language as tl
    from kernels._interpreter_compat import apply as _fix_interpreter
    from kernels.pdl import pdl_enter, pdl_trigger, pdl_wait, prefetch_l2
    _fix_interpreter()   # (the matmul's loop bound is a runtime value)
except ImportError:  # CPU-only installs use the torch reference instead
    triton = None

__all__ = ["dequant_packed", "packed_matmul", "prefill_matmul", "prefill_rows", "packed_rows", "packed_rows_triton",
           "matmul_tuned", "tuned_config"]


def packed_rows(p: PackedWeight, ids: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Dequantize only rows `ids` (an integer tensor of any shape, on p's device) -> float32
    ids.shape + (K,): an embedding lookup from a packed table. Same values as
    dequant_packed_ref(p)[ids], no host synchronisation. impl "auto": one Triton launch on CUDA (a decode
    step's embedding was some twenty torch kernels), torch ops elsewhere; "triton" / "torch" force one."""
    flat = ids.reshape(-1).to(device=p.device, dtype=torch.long)
    if impl == "triton" or (impl == "auto" and triton is not None and flat.is_cuda):
        return packed_rows_triton(p, flat).view(*ids.shape, p.k)
    return _dequant(p, flat).view(*ids.shape, p.k)


# ---------------------------------------------------------------------------------------------
# Triton matmul

if triton is not None:
    # the 4-bit and 2-bit planes' fields to fp16 by PTX (_nibbles_f16, _crumbs_f16) on the GPU; the plain
    # Triton extraction (the same values) only under the interpreter, which runs no PTX
    # (docs/decisions/fragment-order-planes.md)
    ASM4 = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

    @triton.jit
    def _load_tile(ptr, tile, W: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False):
        """Tile `tile` of one of a weight's tiled tensors (a plane, scales, mins), [BLOCK_N, W]: one
        contiguous run of BLOCK_N * W elements. TMA: ptr is a tensor descriptor of the tensor as
        [tiles * BLOCK_N, W] (a Hopper bulk copy into shared memory instead of per-thread loads)."""
        # (an if/else with one return: with an early return Triton still compiled the pointer load for a
        # descriptor and failed)
        if TMA:
            b = ptr.load([(tile * BLOCK_N).to(tl.int32), 0])
        else:
            b = tl.load(ptr + tile * (BLOCK_N * W) + tl.arange(0, BLOCK_N)[:, None] * W + tl.arange(0, W)[None, :])
        return b

    @triton.jit
    def _nibbles_f16(b):
        """uint8 bytes -> join(low nibble, high nibble) as exact fp16, 4 bytes per instance: PRMT
        spreads bytes to 16-bit lanes, LOP3 puts a nibble under fp16 1024's bits (0x6400 | q = 1024 + q,
        0x6400 | q << 4 = 1024 + 16 q), one HADD2 / HFMA2 takes the 1024 off (x / 16 - 64: exact)."""
        # (bytes 0, 1 of a word give the fp16 pair of low nibbles, bytes 2, 3 the next: with the
        # interleaved order that is the pair of K-consecutive values a tensor-core fragment register holds)
        lo, hi = tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t0, t1, c0, c1, c2;
            mov.b32 c0, 0x64006400;
            mov.b32 c1, 0x2C002C00;
            mov.b32 c2, 0xD400D400;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 $2, t0, 0x00F000F0, 0x64006400, 0xEA;
            lop3.b32 $3, t1, 0x00F000F0, 0x64006400, 0xEA;
            sub.f16x2 $0, $0, c0;
            sub.f16x2 $1, $1, c0;
            fma.rn.f16x2 $2, $2, c1, c2;
            fma.rn.f16x2 $3, $3, c1, c2;
            }
            """,
            "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        return tl.join(lo, hi)

    @triton.jit
    def _crumbs_f16(b):
        """uint8 bytes of the 2-bit plane -> its four fields (f = 0..3, bits 2f, 2f+1) times 16 as exact fp16,
        4 bytes per instance: PRMT spreads bytes to 16-bit lanes, a shift brings field f to bits 4, 5, LOP3
        masks it under fp16 1024's bits (0x6400 | 16 h = 1024 + 16 h), HSUB2 takes the 1024 off."""
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            """
            {
            .reg .b32 u0, u1, s;
            .reg .b32 c0;
            mov.b32 c0, 0x64006400;
            prmt.b32 u0, $8, 0, 0x4140;
            prmt.b32 u1, $8, 0, 0x4342;
            shl.b32 s, u0, 4;
            lop3.b32 $0, s, 0x00300030, 0x64006400, 0xEA;
            shl.b32 s, u1, 4;
            lop3.b32 $1, s, 0x00300030, 0x64006400, 0xEA;
            shl.b32 s, u0, 2;
            lop3.b32 $2, s, 0x00300030, 0x64006400, 0xEA;
            shl.b32 s, u1, 2;
            lop3.b32 $3, s, 0x00300030, 0x64006400, 0xEA;
            lop3.b32 $4, u0, 0x00300030, 0x64006400, 0xEA;
            lop3.b32 $5, u1, 0x00300030, 0x64006400, 0xEA;
            shr.b32 s, u0, 2;
            lop3.b32 $6, s, 0x00300030, 0x64006400, 0xEA;
            shr.b32 s, u1, 2;
            lop3.b32 $7, s, 0x00300030, 0x64006400, 0xEA;
            sub.f16x2 $0, $0, c0;
            sub.f16x2 $1, $1, c0;
            sub.f16x2 $2, $2, c0;
            sub.f16x2 $3, $3, c0;
            sub.f16x2 $4, $4, c0;
            sub.f16x2 $5, $5, c0;
            sub.f16x2 $6, $6, c0;
            sub.f16x2 $7, $7, c0;
            }
            """,
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=4)
        return f0, f1, f2, f3

    @triton.jit
    def _load_high2(ptr, tile, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr = False,
                    AS_F16: tl.constexpr = False):
        """Tile `tile` of the 2-bit high plane (fragment order, _interleave_crumbs) in value order,
        [BLOCK_N, BLOCK_K]: fp16 16 * h when AS_F16, else uint8 h."""
        b = _load_tile(ptr, tile, BLOCK_K // 4, BLOCK_N, TMA)
        if AS_F16:
            f0, f1, f2, f3 = _crumbs_f16(b)
        else:
            f0, f1, f2, f3 = b & 3, (b >> 2) & 3, (b >> 4) & 3, b >> 6
        # join(join(f0, f1), join(f2, f3))[..., chunk, high] = field chunk + 2 * high; the bytes are
        # [.., t, run, parity] -> value 32 * run + 16 * chunk + 8 * high + 2 * t + parity
        f = tl.join(tl.join(f0, f1), tl.join(f2, f3))
        f = tl.permute(tl.reshape(f, (BLOCK_N, 4, BLOCK_K // 32, 2, 2, 2)), (0, 2, 4, 5, 1, 3))
        return tl.reshape(f, (BLOCK_N, BLOCK_K))

    @triton.jit
    def _load_fields(ptr, tile, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TMA: tl.constexpr = False, AS_F16: tl.constexpr = False):
        """Tile `tile` of a plane of BITS-bit fields (8 // BITS per byte, least significant first; the
        4-bit plane in fragment order), in value order, uint8 [BLOCK_N, BLOCK_K] (the 4-bit plane as
        exact fp16 when AS_F16)."""
        b = _load_tile(ptr, tile, BLOCK_K * BITS // 8, BLOCK_N, TMA)
        # tl.join (new last axis of 2) rather than shifting by a broadcast arange: ptxas needs
        # about half the registers (sm_90: 140 vs 255 + spills at 4 warps for the 4-bit plane)
        # join(a, b)[..., i, j] = (a, b)[j][..., i]: nested joins take the fields in bit-reversed
        # order so that the flattened index is the field number
        if BITS == 8:   # the int8 plane: the values themselves
            f = b
        elif BITS == 4:
            # the nibble order of `_interleave_nibbles`: [.., t, run, chunk, parity, (low, high)] ->
            # value 32 * run + 16 * chunk + 8 * high + 2 * t + parity
            if AS_F16:
                f = _nibbles_f16(b)
            else:
                f = tl.join(b & 0x0F, b >> 4)
            f = tl.permute(tl.reshape(f, (BLOCK_N, 4, BLOCK_K // 32, 2, 2, 2)), (0, 2, 3, 5, 1, 4))
        else:   # BITS == 1 (the 2-bit plane is _load_high2's)
            f = tl.join(tl.join(tl.join(b & 1, (b >> 4) & 1), tl.join((b >> 2) & 1, (b >> 6) & 1)),
                        tl.join(tl.join((b >> 1) & 1, (b >> 5) & 1), tl.join((b >> 3) & 1, b >> 7)))
        return tl.reshape(f, (BLOCK_N, BLOCK_K))

    @triton.jit
    def _as_f16(qi, SIGNED: tl.constexpr):
        """Small integers (uint8 0..255, or int8 -128..127 when SIGNED) -> exact fp16 without an
        integer-to-float conversion: the fp16 bits 0x6400 | q are 1024 + q for 0 <= q < 1024, so q is
        one subtraction away (sm_90 converts 16 values per clock per SM, against 64-128 for the bit and
        fp16 ops used here)."""
        if SIGNED:
            return (qi.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
        return (qi.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0

    @triton.jit
    def _tile_scales(s_ptr, m_ptr, sup_ptr, tile, CODES: tl.constexpr, OFFSET: tl.constexpr,
                     HAS_MINV: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TMA: tl.constexpr = False):
        """Tile `tile`'s group scales and mins, fp16 [BLOCK_N, BLOCK_K // GROUP] each (the min is the
        scale again when the type has none: the caller does not use it). CODES 0: fp16 scales (and fp16
        mins when HAS_MINV, else OFFSET * scale); 1: int8 codes times the row's d; 2: (sc, mn) code pairs
        times the row's (d, dmin). d and dmin are one per tile row, loaded per thread (4 bytes a row are
        under what a TMA box takes); the products are exact in float32 and rounded once, like the
        reference's."""
        G: tl.constexpr = BLOCK_K // GROUP
        W: tl.constexpr = 2 * G if CODES == 2 else G
        rows = tl.arange(0, BLOCK_N)
        sc = _load_tile(s_ptr, tile, W, BLOCK_N, TMA)
        if CODES == 0:
            s = sc
            if HAS_MINV:
                mv = _load_tile(m_ptr, tile, G, BLOCK_N, TMA)
            else:
                mv = (s.to(tl.float32) * OFFSET).to(tl.float16)
        elif CODES == 1:
            d = tl.load(sup_ptr + tile * BLOCK_N + rows).to(tl.float32)
            s = (d[:, None] * sc.to(tl.float32)).to(tl.float16)
            mv = (s.to(tl.float32) * OFFSET).to(tl.float16)
        else:
            dd = tl.load(sup_ptr + tile * (BLOCK_N * 2) + rows[:, None] * 2 + tl.arange(0, 2)[None, :])
            d, dmin = tl.split(dd.to(tl.float32))
            code, mcode = tl.split(tl.reshape(sc, (BLOCK_N, G, 2)))
            s = (d[:, None] * code.to(tl.float32)).to(tl.float16)
            mv = (dmin[:, None] * mcode.to(tl.float32)).to(tl.float16)
        return s, mv

    @triton.jit
    def _dequant_tile(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, tile, HI_BITS: tl.constexpr, GROUP: tl.constexpr,
                      CODES: tl.constexpr, OFFSET: tl.constexpr, HAS_MINV: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_CVT: tl.constexpr,
                      TMA: tl.constexpr = False, F32: tl.constexpr = False):
        """Tile `tile` (= row band * K tiles + K tile) as fp16 [BLOCK_N, BLOCK_K]: scale * q - minv.
        FAST_CVT: q through _as_f16 and one fp16 fma (the exact value rounded once); else float32 math
        rounded to fp16 (the same value except where float32 itself rounded, which needs |minv| and
        |scale * q| 2^13 apart). F32 (without FAST_CVT): the float32 values, not rounded."""
        AS_F16: tl.constexpr = ASM4 and HI_BITS != 8     # the 4-bit plane comes as exact fp16 values
        if HI_BITS == 8:
            qi = _load_fields(lo_ptr, tile, 8, BLOCK_N, BLOCK_K, TMA)
        else:
            qi = _load_fields(lo_ptr, tile, 4, BLOCK_N, BLOCK_K, TMA, AS_F16)
            if HI_BITS == 2:
                hi = _load_high2(hi_ptr, tile, BLOCK_N, BLOCK_K, TMA, AS_F16)
                if AS_F16:
                    qi = hi + qi                            # 16 h + low bits: exact, q < 64
                else:
                    qi = qi | (hi << 4)
            elif HI_BITS > 0:
                hi = _load_fields(hi_ptr, tile, HI_BITS, BLOCK_N, BLOCK_K, TMA)
                if AS_F16:
                    qi = _as_f16(hi, False) * 16.0 + qi     # exact: q < 32
                else:
                    qi = qi | (hi << 4)
        G: tl.constexpr = BLOCK_K // GROUP
        HAS_MIN: tl.constexpr = CODES == 2 or HAS_MINV or OFFSET != 0
        s, mv = _tile_scales(s_ptr, m_ptr, sup_ptr, tile, CODES, OFFSET, HAS_MINV, GROUP, BLOCK_N, BLOCK_K, TMA)
        if FAST_CVT:
            if AS_F16:
                q = tl.reshape(qi, (BLOCK_N, G, GROUP))
            else:
                q = tl.reshape(_as_f16(qi, HI_BITS == 8), (BLOCK_N, G, GROUP))
            if HAS_MIN:
                w = tl.fma(q, s[:, :, None], -mv[:, :, None])
            else:
                w = q * s[:, :, None]
        else:
            w = tl.reshape(qi.to(tl.float32), (BLOCK_N, G, GROUP)) * s.to(tl.float32)[:, :, None]
            if HAS_MIN:
                w = w - mv.to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        if not F32:
            w = w.to(tl.float16)
        return w

    @triton.jit
    def _prefetch_run(ptr, first, n, TILE: tl.constexpr):
        """Tiles first .. first + n - 1 of one tiled tensor (TILE elements a tile) into L2."""
        BYTES: tl.constexpr = TILE * (ptr.dtype.element_ty.primitive_bitwidth // 8)
        prefetch_l2(ptr + first * TILE, (n * BYTES).to(tl.int32))

    @triton.jit
    def _prefetch_tiles(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, first, n, HI_BITS: tl.constexpr,
                        GROUP: tl.constexpr, CODES: tl.constexpr, HAS_MINV: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Tiles first .. first + n - 1 of every tensor of the weight into L2 (one contiguous run each;
        a tile row's elements as _load_fields, _load_high2 and _tile_scales read them)."""
        G: tl.constexpr = BLOCK_K // GROUP
        _prefetch_run(lo_ptr, first, n, BLOCK_N * (BLOCK_K if HI_BITS == 8 else BLOCK_K // 2))
        if HI_BITS == 1 or HI_BITS == 2:
            _prefetch_run(hi_ptr, first, n, BLOCK_N * BLOCK_K * HI_BITS // 8)
        _prefetch_run(s_ptr, first, n, BLOCK_N * (2 * G if CODES == 2 else G))
        if HAS_MINV:
            _prefetch_run(m_ptr, first, n, BLOCK_N * G)
        if CODES > 0:
            _prefetch_run(sup_ptr, first, n, BLOCK_N * CODES)

    @triton.jit
    def _packed_mm_kernel(x_ptr, lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, part_ptr, out_ptr, add_ptr, cnt_ptr,
                          M, N, stride_xm, TILES,
                          KT: tl.constexpr, HI_BITS: tl.constexpr, GROUP: tl.constexpr,
                          CODES: tl.constexpr, OFFSET: tl.constexpr, HAS_MINV: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SWAP_AB: tl.constexpr = False, FAST_CVT: tl.constexpr = True,
                          TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
                          SUM_HERE: tl.constexpr = False, HAS_ADD: tl.constexpr = False,
                          PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
        """Program (m-block, row band, k-slice): the slice's TILES consecutive tiles of the band, each
        one contiguous run of bytes, against a [BLOCK_M, BLOCK_K] block of x per tile.
        SPLIT == 1: the result goes to out (plus add's block when HAS_ADD). SPLIT > 1: each k-slice
        writes its partial sums to part[k-slice]; SUM_HERE: the slice that finishes last (an arrival
        count per output block in cnt, left at 0 again) adds part[0] + part[1] + ... in that order into
        out, so the bits do not depend on which one it is; else _sum_parts_kernel adds them afterwards.
        PDL (kernels/pdl.py): launched before the previous kernel ends; the program first asks for its
        first PREFETCH tiles in L2 (weights: never written, so before the wait), then waits. It lets the
        next kernel launch when its tiles are done, not at its start (a split-K matrix with many waves lost
        ~10 % with the next kernel's programs beside its last wave: docs/decisions/programmatic-dependent-launch.md)."""
        # m-blocks vary fastest, so the programs that share a weight tile run back to back and
        # all but the first read it from L2
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if PDL and PREFETCH > 0 and not TMA:
            _prefetch_tiles(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, pid_n.to(tl.int64) * KT + pid_k * TILES,
                            tl.minimum(TILES, PREFETCH), HI_BITS, GROUP, CODES, HAS_MINV, BLOCK_N, BLOCK_K)
        pdl_wait(PDL)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        # SWAP_AB: the weight tile is the dot's first operand (out^T = W x^T), the usual layout for
        # skinny products: the few activation rows become the small N side of the MMA
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(0, TILES):
            kt = pid_k * TILES + t
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None],
                        other=0.0).to(tl.float16)
            w16 = _dequant_tile(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, pid_n.to(tl.int64) * KT + kt,
                                HI_BITS, GROUP, CODES, OFFSET, HAS_MINV, BLOCK_N, BLOCK_K, FAST_CVT, TMA)
            if SWAP_AB:
                acc += tl.dot(w16, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w16))
        pdl_trigger(PDL)
        if SWAP_AB:
            acc = tl.trans(acc)
        offs_out = offs_m[:, None].to(tl.int64) * N + cols[None, :]
        mask_out = mask_m[:, None] & (cols[None, :] < N)
        if SPLIT == 1:
            if HAS_ADD:
                acc = tl.load(add_ptr + offs_out, mask=mask_out, other=0.0) + acc
            tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
        else:
            MN = (pid_k.to(tl.int64) * 0 + M) * N   # (M may be a constexpr 1: no .to on it)
            tl.store(part_ptr + pid_k * MN + offs_out, acc, mask=mask_out)
            if SUM_HERE:
                # every thread's partial is stored before the count says so (the barrier), and the
                # count's acquire/release makes the other slices' partials visible to the last one
                tl.debug_barrier()
                count = cnt_ptr + pid_m * tl.num_programs(1) + pid_n
                if tl.atomic_add(count, 1, sem="acq_rel") == SPLIT - 1:
                    tot = tl.load(part_ptr + offs_out, mask=mask_out, other=0.0, cache_modifier=".cg")
                    for i in tl.static_range(1, SPLIT):
                        tot += tl.load(part_ptr + i * MN + offs_out, mask=mask_out, other=0.0,
                                       cache_modifier=".cg")
                    if HAS_ADD:
                        tot = tl.load(add_ptr + offs_out, mask=mask_out, other=0.0) + tot
                    tl.store(out_ptr + offs_out, tot.to(out_ptr.dtype.element_ty), mask=mask_out)
                    tl.atomic_xchg(count, 0)   # ready for the next launch (and graph replay)

    @triton.jit
    def _sum_parts_kernel(part_ptr, out_ptr, add_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_ADD: tl.constexpr = False, PDL: tl.constexpr = False):
        """out = part[0] + part[1] + ... + part[SPLIT-1], added in that order (then add + that)."""
        pdl_enter(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        offs_i = offs  # int64: part[i] starts at i * MN (scalar args may be constexpr, no .to)
        for i in tl.static_range(1, SPLIT):
            offs_i = offs_i + MN
            acc += tl.load(part_ptr + offs_i, mask=mask, other=0.0)
        if HAS_ADD:
            acc = tl.load(add_ptr + offs, mask=mask, other=0.0) + acc
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, out_ptr, N, K, KT: tl.constexpr,
                        HI_BITS: tl.constexpr, GROUP: tl.constexpr, CODES: tl.constexpr, OFFSET: tl.constexpr,
                        HAS_MINV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[n, k] = fp16(scale * q - minv) for one tile, row-major (float32 math, as the reference)."""
        band, kt = tl.program_id(0), tl.program_id(1)
        w = _dequant_tile(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, band.to(tl.int64) * KT + kt, HI_BITS, GROUP,
                          CODES, OFFSET, HAS_MINV, BLOCK_N, BLOCK_K, False)
        rows = band.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rows[:, None] * K + offs_k[None, :], w, mask=rows[:, None] < N)


    @triton.jit
    def _rows_kernel(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, ids_ptr, out_ptr, N, K, KT: tl.constexpr,
                     HI_BITS: tl.constexpr, GROUP: tl.constexpr, CODES: tl.constexpr, OFFSET: tl.constexpr,
                     HAS_MINV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr = False):
        """out[i, kt's columns] = row ids[i] of K tile kt in float32, scale * q - minv as the reference
        computes it (launched without FMA contraction): the tile is dequantized whole and the row picked
        out (a tile row's values are not contiguous in the fragment-ordered planes). An id outside 0..N-1
        gives zeros (the engine checks ids first; this only keeps the kernel from reading past the table)."""
        pdl_enter(PDL)
        i, kt = tl.program_id(0), tl.program_id(1)
        row = tl.load(ids_ptr + i).to(tl.int64)
        ok = (row >= 0) & (row < N)
        row = tl.where(ok, row, 0)
        w = _dequant_tile(lo_ptr, hi_ptr, s_ptr, m_ptr, sup_ptr, (row // BLOCK_N) * KT + kt, HI_BITS, GROUP,
                          CODES, OFFSET, HAS_MINV, BLOCK_N, BLOCK_K, False, False, True)
        pick = (tl.arange(0, BLOCK_N) == row % BLOCK_N) & ok
        v = tl.sum(tl.where(pick[:, None], w, 0.0), axis=0)     # (exact: one value and zeros; -0 becomes 0)
        tl.store(out_ptr + i.to(tl.int64) * K + kt * BLOCK_K + tl.arange(0, BLOCK_K), v)


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_for(n_tiles: int, steps: int, n_sm: int, waves: int) -> int:
    """The smallest divisor of `steps` that makes n_tiles * split >= waves * n_sm programs."""
    want = max(1, -(-waves * n_sm // max(n_tiles, 1)))
    for s in range(1, steps + 1):
        if steps % s == 0 and s >= want:
            return s
    return max(steps, 1)


def tuned_config(p: PackedWeight, prefill: int, n_sm: int, tma: bool = False, waves: dict | None = None,
                 family: Family | None = None) -> dict:
    """Launch settings from the weight's shape only (never from M: batch invariance), measured on the
    H200 (docs/decisions/tiled-weight-layout.md). The tile is the weight's (tile_n x tile_k).
    prefill: the rows a prompt chunk is padded to (0: decode rows); a small prompt chunk (at most
    SMALL_PROMPT_ROWS rows) takes the decode settings with all its rows in one block of x (small_prompt).
    decode rows (M <= 64): memory-bound; 4 warps (8 with a high plane: registers), 4 pipeline stages
    (3 with a high plane: shared memory) and split-K to at least `waves` programs per SM (the tiles
    below change these).
    tma (a GPU with TMA, sm_90+): the 4-bit types and those with a high plane in 256-value tiles (but for
    64-row ones with fp16 scales, which keep the tile in registers) take their tiles by tensor
    descriptors with TMA_CONFIG's settings (measured end to end on the 27B: a 1-row step 18.2 instead of
    19.0 ms, docs/PERFORMANCE.md); the int8-plane types keep per-thread loads (not measured).
    prefill rows (the Triton path, when PREFILL_CUBLAS is off): 128-row blocks of x, 8 warps, no split.
    waves: split-K's target in programs per SM by tile rows (default DECODE_WAVES; small prompt chunks
    SMALL_PROMPT_WAVES). family (kernels/family.py; default sm90): its row of PACKED_SETTINGS; tma is
    taken only where that row allows it."""
    fam = by_family(PACKED_SETTINGS, family or FAMILIES["sm90"])
    tma = tma and fam["tma"]
    if small_prompt_rows(prefill):
        return small_prompt(p, tuned_config(p, 0, n_sm, tma, waves=SMALL_PROMPT_WAVES, family=family))
    if prefill:
        return dict(block_m=128, num_warps=8, num_stages=3, split_k=1)
    # (with per-thread loads SWAP_AB won a noisy kernel sweep by ~10 % but lost ~5 % end to end on the
    # 27B: not used there; the TMA settings were picked end to end)
    hi = p.hi_bits in (1, 2)
    # the weight tile in registers as the dot's first operand: tiles under 256 values, and 256-value ones of at
    # most 64 rows with fp16 scales (the registers of a 128 x 128 tile; pack_weight(tile_k=256) only)
    in_registers = p.hi_bits in (0, 1, 2) and (p.tile_k < 256 or (p.tile_n <= 64 and p.codes == 0))
    # TMA boxes need rows of at least 16 bytes: a tile's scale row (tile_k / group fp16 values) has them
    # only for 256-value tiles
    tma = tma and p.tile_k >= 256 and not in_registers
    by_tma = (TMA_CONFIG or {}).get(weight_class(p)) if tma else None
    if by_tma:
        c = dict(by_tma)
        split = _split_for(p.n_pad // p.tile_n, p.k // p.tile_k, n_sm, c.pop("waves", 4))
        return dict(block_m=16, tma=True, split_k=split, **c)
    # at least DECODE_WAVES programs per SM (8 for 128-row tiles, of which 4 fit on an SM at once; 8 for
    # 64-row ones: docs/PERFORMANCE.md)
    split = _split_for(p.n_pad // p.tile_n, p.k // p.tile_k, n_sm, (waves or DECODE_WAVES).get(p.tile_n, 4))
    if in_registers:
        # tiles in registers (measured for tiles under 256 values, .ci/gpu/sweep_tile_k.py on the H200; the
        # 64 x 256 ones end to end only, slower: docs/decisions/tiles-64x256.md): 4 warps, 3 stages, the
        # weight tile as the dot's first operand, in registers: with the 4-bit plane in fragment order that
        # holds for the high-plane types too (Q6_K 5120x17408 50.4 us against 79.4 with the tile in shared
        # memory, 248320x5120 591 against 831; Q4_K 34816x5120 54.1 against 124;
        # docs/perf/sweep_fragment_order_hi_h200.json, sweep_fragment_order_q4_h200.json; Q5_K not measured).
        # 4 stages for the 4-bit-only types' projections
        # back to a hidden size of at most DEEP_PIPELINE_MAX_N (the split-K'd ones streaming long runs of K:
        # Q4_K 5120x17408 30.7 -> 28.4 us, 5120x6144 13.4 -> 12.7; on 6272x5120 and 16512x5120, and with a
        # high plane, 3 stages measured faster; docs/perf/sweep_stages_h200.json, same bits either way)
        deep = p.hi_bits == 0 and p.n <= DEEP_PIPELINE_MAX_N
        cfg = dict(block_m=16, num_warps=4, num_stages=4 if deep else 3, swap_ab=True, split_k=split)
        cap = fam["maxnreg"].get(p.tile_n)
        if cap:
            cfg["maxnreg"] = cap
        return cfg
    return dict(block_m=16, num_warps=8 if hi else 4, num_stages=3 if hi else 4, split_k=split)


def weight_class(p: PackedWeight) -> str:
    """The kind of weight settings are kept by: the 4-bit plane alone ("plain"), with a high plane ("hi"),
    an int8 plane ("int8")."""
    return "hi" if p.hi_bits in (1, 2) else "plain" if p.hi_bits == 0 else "int8"


def small_prompt_rows(rows: int) -> bool:
    """Whether a prompt chunk padded to `rows` rows (PREFILL_ROWS; 0: decode rows) is a small one, whose
    matmuls take the packed kernel (small_prompt) instead of dequantize + cuBLAS."""
    return 0 < rows <= SMALL_PROMPT_ROWS


def small_prompt(p: PackedWeight, decode: dict) -> dict:
    """A small prompt chunk's settings from the weight's decode settings: every row in one block of x
    (each weight tile dequantized once for all of them, where decode's 16-row blocks would dequantize it
    once per 16 rows), SMALL_PROMPT_CONFIG's changes for the weight's class, no register cap (the cap was
    set for 16-row blocks; a 64-row accumulator needs more)."""
    cfg = rows_in_blocks(decode, SMALL_PROMPT_ROWS)
    cfg.update(SMALL_PROMPT_CONFIG.get(weight_class(p), {}))
    return cfg


def rows_in_blocks(cfg: dict, block_m: int) -> dict:
    """Settings made for 16-row blocks of x, with block_m rows instead and no register cap (the cap was set
    for 16-row accumulators)."""
    wide = {k: v for k, v in cfg.items() if k != "maxnreg"}
    wide["block_m"] = block_m
    return wide


def packed_matmul(x: torch.Tensor, p: PackedWeight, out_dtype: torch.dtype = torch.float32, *,
                  block_m: int = 16, split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int = 3, swap_ab: bool = False, fast_cvt: bool = True,
                  tma: bool = False, add: torch.Tensor | None = None,
                  sum_here: bool | None = None, maxnreg: int | None = None, partials: bool = False) -> torch.Tensor:
    """x [..., K] (any float dtype; rounded to fp16) @ W.T -> out_dtype [..., N], W packed; plus `add`
    ([..., N], float32, e.g. the residual stream) when given: add + x @ W.T, the same bits as adding
    afterwards, without a launch of its own.
    tma: the weight's tiles come by TMA (tensor descriptors; CUDA sm_90+, or Triton's interpreter), the
    same values as per-thread loads, so the same result.
    sum_here (default SPLIT_SUM_HERE): with split-K, the last k-slice of each output block adds the
    partial sums (in k-slice order, so the same bits) instead of a second kernel; p keeps a small
    arrival count per output block for it (made on the first such call, not while a CUDA graph is
    being captured: then the second kernel is used).
    maxnreg: a cap on the registers per thread (ptxas's .maxnreg; CUDA only), so that more programs share
    an SM.
    partials: return split-K's partial sums unadded, float32 [split_k, ..., N] (the product is their sum
    in k-slice order, part[0] + part[1] + ...: what the consumer adds, as kernels.fused.gated_sum_parts
    does, for the same bits without the slices' arrival counts); no `add`.

    Triton (CUDA, or the interpreter with TRITON_INTERPRET=1), one program per (block of block_m rows
    of x, tile_n outputs, K slice); split_k (a divisor of the K tiles, else the next one up) from the
    weight's shape and the SM count (4 SMs assumed off CUDA) unless given; num_warps 8 with a high plane
    (sm_90 ptxas: ~120 registers, vs 255 at 4 warps), else 4. Batch invariance holds for any fixed
    settings: never choose them from M. No host synchronisation: usable inside CUDA graph capture (the
    SM count is cached per device; call once before capturing)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    K = x.shape[-1]
    if K != p.k:
        raise ValueError(f"x has {K} columns, the weight has {p.k}")
    if block_m < 16:
        raise ValueError("block_m must be at least 16")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], p.n
    bands, kt = p.n_pad // p.tile_n, p.k // p.tile_k
    if split_k is None:
        n_sm = _sm_count(x2.device.index if x2.device.index is not None else torch.cuda.current_device()) \
            if x2.is_cuda else 4
        split_k = _split_for(bands, kt, n_sm, 2)  # from the weight's shape only, never M
    split_k = next(s for s in range(max(1, min(split_k, kt)), kt + 1) if kt % s == 0)
    if add is not None:
        add = add.reshape(-1, N)
        if add.shape[0] != M or add.dtype != torch.float32 or not add.is_contiguous():
            raise ValueError(f"add must be contiguous float32 [{M}, {N}], got {add.dtype} {tuple(add.shape)}")
    if partials and (add is not None or out_dtype != torch.float32):
        raise ValueError("partial sums are float32 and take no `add`")
    if M == 0 or N == 0:
        out = torch.zeros((*lead, N), dtype=out_dtype, device=x.device)
        if partials:
            return out.view(1, *lead, N)
        return out if add is None else out + add.view(*lead, N)
    part = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else None
    # (partial sums returned as they are: no output of their sum to make)
    out = part if partials and part is not None else torch.empty((M, N), dtype=out_dtype, device=x.device)
    part = out if part is None else part
    m_blocks = -(-M // block_m)
    counts = _arrival_counts(p, m_blocks) if split_k > 1 and not partials \
        and (SPLIT_SUM_HERE if sum_here is None else sum_here) else None
    if num_warps is None:
        num_warps = 8 if p.hi_bits in (1, 2) else 4
    weight = _descriptors(p) if tma and (x2.is_cuda or _INTERPRETER) else None
    if weight is None:
        tma = False
        weight = _pointers(p)
    grid = (m_blocks, bands, split_k)
    pdl = pdl_args(x2)
    launch = dict(num_warps=num_warps, num_stages=num_stages) if x2.is_cuda else {}   # (not under the interpreter)
    if maxnreg and x2.is_cuda:
        launch["maxnreg"] = maxnreg
    _packed_mm_kernel[grid](
        x2, *weight, part, out, out if add is None else add, part if counts is None else counts, M, N, x2.stride(0), kt // split_k,
        **kernel_constants(p), BLOCK_M=block_m, SWAP_AB=swap_ab, FAST_CVT=fast_cvt, TMA=tma, SPLIT=split_k,
        SUM_HERE=counts is not None, HAS_ADD=add is not None, **pdl,
        **(dict(PREFETCH=prefetch_tiles(block_m)) if pdl else {}),
        **launch)
    if partials:
        return part.view(split_k, *lead, N)
    if split_k > 1 and counts is None:
        block = 1024
        _sum_parts_kernel[(-(-(M * N) // block),)](part, out, out if add is None else add, M * N,
                                                   SPLIT=split_k, BLOCK=block, HAS_ADD=add is not None, **pdl)
    return out.view(*lead, N)


def prefetch_tiles(block_m: int) -> int:
    """How many tiles each program of the packed matmul asks L2 for before its PDL wait: PREFETCH_TILES for
    16-row blocks of x (decode rows of up to 16, the only setting whose results under PDL were measured the same
    bits as without), none for wider blocks. On the H100 (.ci/gpu/pdl_isolate.py at commit bd0ae1b,
    docs/perf/pdl_isolate_h100.json) the
    small prompt's 64-row blocks, compiled with the prefetch, give a different result nearly every run (up to
    60 apart), launched with PDL or not, and the same bits every run without the prefetch: with it a 27B
    prefill differs between runs with PDL on. The prefetch only reads weights,
    so this looks like a miscompile of the spilling 64-row kernel with the bulk prefetch, not a missing wait."""
    return PREFETCH_TILES if block_m <= 16 else 0


def _arrival_counts(p: PackedWeight, m_blocks: int) -> torch.Tensor | None:
    """p's int32 arrival counts, one per (m-block, row band), all 0 between launches; grown to m_blocks
    on demand (never while a CUDA graph is being captured: None then, and the caller sums separately).
    Outgrown counts stay alive in p.old_counts: a graph captured before holds their address, and were they
    freed, its replays would count in memory another tensor owns (an eager step of more rows, e.g. a Q8_0
    model's 16-row blocks past 64 rows, grows them after the decode graphs were captured)."""
    bands = p.n_pad // p.tile_n
    c = p.counts
    if c is None or c.numel() < m_blocks * bands:
        if p.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if c is not None:
            p.old_counts.append(c)
        # (to a power of two of m-blocks: few regrowths, so few buffers kept)
        c = p.counts = torch.zeros(max(1 << (m_blocks - 1).bit_length(), 4) * bands, dtype=torch.int32,
                                   device=p.device)
    return c


def kernel_constants(p: PackedWeight) -> dict:
    """The compile-time arguments a weight's layout gives the packed kernels (tiles, bits, scale kind)."""
    return dict(KT=p.k // p.tile_k, HI_BITS=p.hi_bits, GROUP=p.group, CODES=p.codes, OFFSET=p.offset,
                HAS_MINV=p.minv is not None, BLOCK_N=p.tile_n, BLOCK_K=p.tile_k)


def _pointers(p: PackedWeight) -> tuple:
    """p's 4-bit (or int8) plane, high plane, scales, mins and per-row d (dmin) as the kernel's pointer
    arguments (a tensor it never reads where p has no such part)."""
    lo = p.planes[0]
    return (lo, p.planes[1] if p.hi_bits in (1, 2) else lo, p.scale, p.scale if p.minv is None else p.minv,
            p.scale if p.supers is None else p.supers)


def _descriptors(p: PackedWeight) -> tuple | None:
    """_pointers(p) with tensor descriptors (Hopper TMA) for p's planes, scales and mins (the per-row d,
    dmin stay a pointer: loaded per thread), each viewed as [tiles * tile_n, bytes or groups per tile row],
    one tile's rows per block; made once per weight and kept on it (their base addresses never change, so
    CUDA graphs may hold them). None when a tile row of one of them is not a multiple of 16 bytes or over
    256 values (what a TMA box allows)."""
    d = p.tma
    if d is None:
        from triton.tools.tensor_descriptor import TensorDescriptor
        ts = [t for t in (*p.planes, p.scale, p.minv) if t is not None]
        if any(t.shape[-1] * t.element_size() % 16 or t.shape[-1] > 256 for t in ts):
            d = ()
        else:
            descs = {id(t): TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), [p.tile_n, t.shape[-1]])
                     for t in ts}
            *tiled, sup = _pointers(p)
            d = (*(descs[id(t)] for t in tiled), sup)
        p.tma = d
    return d or None


def dequant_packed(p: PackedWeight) -> torch.Tensor:
    """The whole weight as fp16 [N, K] (Triton): each value fp16(scale * q - minv), computed in
    float32 as the reference does (one program per tile)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    out = torch.empty((p.n, p.k), dtype=torch.float16, device=p.device)
    kt = p.k // p.tile_k
    _dequant_kernel[(p.n_pad // p.tile_n, kt)](*_pointers(p), out, p.n, p.k, **kernel_constants(p))
    return out


def packed_rows_triton(p: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """packed_rows' kernel: ids int64 [n] -> float32 [n, K] (one program per id and K tile)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    out = torch.empty((ids.numel(), p.k), dtype=torch.float32, device=p.device)
    if ids.numel():
        extra = dict(enable_fp_fusion=False) if p.device.type == "cuda" else {}
        _rows_kernel[(ids.numel(), p.k // p.tile_k)](*_pointers(p), ids, out, p.n, p.k, **kernel_constants(p),
                                                     **pdl_args(out), **extra)
    return out


def prefill_rows(x: torch.Tensor, k: int, pad_rows: int = 0) -> torch.Tensor:
    """x's rows as the fp16 [max(m, pad_rows), k] operand of prefill products, zero-padded (weights that
    read the same x share one: StackedWeights)."""
    x2 = x.reshape(-1, k).to(torch.float16)
    m = x2.shape[0]
    return torch.cat([x2, x2.new_zeros(pad_rows - m, k)]) if m < pad_rows else x2


def prefill_matmul(x: torch.Tensor, p: PackedWeight, pad_rows: int = 0,
                   rows16: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt rows: dequantize the weight to fp16 once, then one cuBLAS product with fp32 results.
    A prefill chunk is compute-bound, and cuBLAS's tensor-core kernels run about 3.5x the fused
    Triton kernel's TFLOP/s on the H200 (docs/PERFORMANCE.md); the fp16 copy costs one pass over the
    weight and its 2-byte values, freed after the product. cuBLAS picks its kernel from M, so a row's
    result depends on its chunk's length, which depends only on the prompt and the fixed chunk
    boundaries, not on other sequences. pad_rows: fewer rows are zero-padded to this many, so that every
    chunk of a prompt runs the same cuBLAS kernel and a row's result does not depend on how the prompt
    was cut into chunks either (a kernel reduces each output over K in its own fixed order, whatever
    the other rows hold). rows16: prefill_rows(x, p.k, pad_rows), when the caller has it already."""
    w = dequant_packed(p)
    m = x.numel() // p.k
    x2 = prefill_rows(x, p.k, pad_rows) if rows16 is None else rows16
    try:
        out = torch.mm(x2, w.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):   # torch without mm(out_dtype=): fp16 results, widened
        out = torch.mm(x2, w.t()).float()
    return out[:m].view(*x.shape[:-1], p.n)


def matmul_tuned(x: torch.Tensor, p: PackedWeight, prefill: int = 0, add: torch.Tensor | None = None,
                 partials: bool = False) -> torch.Tensor:
    """What the engine's GPU path calls. prefill > SMALL_PROMPT_ROWS: the rows are prompt rows (a chunk
    of at most `prefill` rows, padded to that many): dequantize + cuBLAS (`prefill_matmul`); a smaller
    prefill: a small prompt chunk, packed_matmul with all its rows in one block (`small_prompt`); else
    decode/draft rows: packed_matmul with `tuned_config` (fixed per weight shape), so a decode row's
    result does not depend on the other rows. add: add + x @ W.T (float32, x's rows by p.n), the same bits
    as adding after. partials: split-K's partial sums unadded (packed_matmul's `partials`; the prompt rows'
    product as the only one), no `add`."""
    if add is not None and (add.dtype != torch.float32 or not add.is_contiguous()):
        return add + matmul_tuned(x, p, prefill)
    if not x.is_cuda:
        return packed_matmul(x, p, add=add, partials=partials)
    if prefill and not small_prompt_rows(prefill) and PREFILL_CUBLAS:
        y = prefill_matmul(x, p, pad_rows=int(prefill))
        if partials:
            return y.unsqueeze(0)
        return y if add is None else add + y
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (p.n, p.k, p.tile_n, p.tile_k, p.hi_bits, p.group, p.codes, prefill, dev)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = _checked_config(x, p, prefill, _sm_count(dev), _has_tma(dev), device_family(dev))
    if not prefill:
        cfg = wide_decode_rows(cfg, x.numel() // x.shape[-1])
    return packed_matmul(x, p, add=add, partials=partials, **cfg)


def wide_decode_rows(cfg: dict, m: int) -> dict:
    """Decode settings for m rows: past 16 rows, blocks of up to DECODE_BLOCK_M rows of x (each weight tile
    dequantized once per block: with 16-row blocks a 64-row step dequantized every tile four times and
    cost 3.9x a 1-row step), the split, warps and stages kept (the same K slices, so the same sums: a
    row's result does not depend on the rows beside it), no register cap (set for 16-row accumulators).
    Only for the settings with the weight tile as the dot's first operand (swap_ab), where x's rows are
    the MMA's N side: measured on the H200 to give every row the bits it gets alone (Q4_K, Q5_K, Q6_K).
    Not for x as the first operand (the int8-plane types: rows one rounding apart at 64-row blocks) nor
    for TMA's 256-value tiles (past the shared memory): those keep 16-row blocks."""
    if m <= 16 or cfg.get("block_m", 16) != 16 or not cfg.get("swap_ab") or cfg.get("tma"):
        return cfg
    return rows_in_blocks(cfg, min(DECODE_BLOCK_M, 1 << (m - 1).bit_length()))


def _checked_config(x: torch.Tensor, p: PackedWeight, prefill: int, n_sm: int, tma: bool,
                    family: Family | None = None) -> dict:
    """tuned_config, its TMA settings tried once on x: where they do not compile or launch (a Triton or
    driver without tensor descriptors), a warning and the per-thread loads instead of a dead engine."""
    cfg = tuned_config(p, prefill, n_sm, tma=tma, family=family)
    if cfg.get("tma"):
        try:
            packed_matmul(x, p, **cfg)
        except Exception as e:  # (CompilationError, RuntimeError, ImportError, ...: whatever stopped it)
            warnings.warn(f"the decode matmul's TMA loads failed ({type(e).__name__}: {e}); "
                          "using per-thread loads", RuntimeWarning, stacklevel=3)
            cfg = tuned_config(p, prefill, n_sm, tma=False, family=family)
    return cfg


def _has_tma(device_index: int) -> bool:
    """Whether the decode matmul may take its tiles by TMA there: the sm90 family only (kernels/family.py;
    sm_100/sm_120 have TMA, but the path was measured and tested on sm_90 alone)."""
    return device_family(device_index).hopper_paths


_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_CONFIGS: dict = {}
# decode settings with TMA loads per kind of weight: the 4-bit plane alone ("plain"), with a high plane
# ("hi"); picked by .ci/gpu/sweep_tma.py on the H200 (docs/perf/sweep_tma_h200.json); None: no TMA.
# (Only 256-value tiles load by TMA: weights that keep their scale codes, pack_weight(coded=True), and
# pack_weight(tile_k=256); 64-row ones with fp16 scales keep the tile in registers, tuned_config. With the planes
# in fragment order, "hi" with the tile in shared memory runs Q6_K 5120x17408 in 87 us against 37 at the default
# 128-value tiles, docs/perf/sweep_fragment_order_q6_high_plane_h200.json; the tile in registers was not measured
# at 128 x 256 values, where it needs ~220 registers.)
TMA_CONFIG: dict | None = {"plain": dict(num_warps=4, num_stages=2, waves=4, swap_ab=True),
                           "hi": dict(num_warps=4, num_stages=3, waves=4, swap_ab=False)}
# split-K partial sums added by the last k-slice of each output block (True) rather than by a second kernel:
# the same bits either way, one launch fewer (docs/decisions/split-k-sums-polled-by-last-slice.md). The second
# kernel stays for launches made while a CUDA graph is being captured before the arrival counts exist
# (_arrival_counts) and for packed_matmul(sum_here=False).
SPLIT_SUM_HERE = True
# with PDL (kernels/pdl.py), how many of its tiles each decode-matmul program asks L2 for before it waits
# for the previous kernel: one (2, 4 and 8 make the 27B's step 0.13-0.76 ms longer: the prefetches slow the
# predecessor's last programs, which the wait is for; docs/decisions/l2-prefetch-before-wait.md); in 16-row
# blocks only: prefetch_tiles
PREFETCH_TILES = 1
PREFILL_CUBLAS = True   # False: prompt rows through packed_matmul's prefill configuration (benchmarks)
# Prompt chunks of at most this many rows (a power of two, at least 16): a short request, a follow-up's new
# tokens, a prompt's tail. They take the packed kernel with all rows in one block of x (small_prompt), not
# dequantize + cuBLAS: cuBLAS needs an fp16 copy of every weight first, one pass over ~54 GB on the 27B whatever
# the rows (a 32-token prompt padded to 256 rows took 53-68 ms there), where the packed kernel reads each weight
# once (docs/decisions/small-prompt-chunks.md).
SMALL_PROMPT_ROWS = 64
# what small prompt chunks change in the decode settings, per weight class (weight_class): picked by
# .ci/gpu/small_prompt.py (at commit bd0ae1b) on the H200 over the 27B's matrices at 64 rows
# (docs/perf/small_prompt_chunks_h200.json:
# 4 warps, 3 stages, the weight tile as the dot's first operand; a chunk's matmuls 15.7 ms against 40.1 for
# dequantize + cuBLAS padded to 256 rows, 21.8 with the decode rows' 16-row blocks); "int8" (Q8_0) was not
# measured and keeps its decode settings.
SMALL_PROMPT_CONFIG: dict[str, dict] = {
    "plain": dict(num_warps=4, num_stages=3, swap_ab=True), "hi": dict(num_warps=4, num_stages=3, swap_ab=True)}
# the most rows of x one decode program multiplies with its weight tiles (wide_decode_rows: steps of 17-64 rows
# in one block of their power of two, with the weight's decode warps: docs/decisions/wide-decode-blocks.md; 8
# warps kept each row's bits but made 32- and 64-row steps ~30 % slower on the H200,
# docs/decisions/wide-decode-block-warps.md)
DECODE_BLOCK_M = 64
# the most output rows of a 4-bit-only decode matmul that takes 4 pipeline stages (tuned_config;
# docs/decisions/deep-pipeline-projections.md)
DEEP_PIPELINE_MAX_N = 5120
# split-K's target for decode rows, in programs per SM, by tile rows (tuned_config: the smallest split that
# gives at least this many). 64-row tiles at 8 rather than 4: a 27B decode step on the H200 8.35 -> 8.21 ms
# at one row, 9.07 -> 8.61 at four (docs/decisions/split-k-target-8-programs-per-sm.md).
DECODE_WAVES = {128: 8, 64: 8}
# the same for small prompt chunks (small_prompt): the targets SMALL_PROMPT_CONFIG was picked with (64-row tiles
# at 4 programs per SM); the larger decode target was not measured on them (docs/decisions/small-prompt-chunks.md).
SMALL_PROMPT_WAVES = {128: 8, 64: 4}
# a cap on the decode matmul's registers per thread by tile rows (packed_matmul's maxnreg), so that more
# programs share an SM: 128-row tiles need ~141 (3 programs of 4 warps per SM), capped at 128 without a spill
# (4 programs): the Q4_K gate+up stack 40.2 -> 38.1 us on the H200 (docs/perf/sweep_register_cap_h200.json,
# docs/decisions/register-cap-decode-matmul.md); 64-row tiles gained nothing from caps of 80 / 72 / 64.
DECODE_MAXNREG = {128: 128}


# the decode matmul's settings by GPU family (kernels/family.py; docs/GPU_FAMILIES.md). tma: 256-value tiles by
# TMA (TMA_CONFIG; measured on sm_90 only). maxnreg: DECODE_MAXNREG's register cap by tile rows, where it holds
# without a spill: compiled for sm_86 (tests/kernels/test_aot_families.py), the 16-row blocks of 128-row tiles
# capped at 128 registers spill 48-184 bytes a thread, where sm_90's wgmma keeps its accumulator apart and does
# not; the other families take them uncapped (no spill, and fewer programs per SM: not timed on such a card).
PACKED_SETTINGS: dict[str, dict] = {
    "sm80": dict(tma=False, maxnreg={}),
    "sm86": dict(tma=False, maxnreg={}),
    "sm90": dict(tma=True, maxnreg=DECODE_MAXNREG),
    "sm100": dict(tma=False, maxnreg={}),
    "sm120": dict(tma=False, maxnreg={}),
}
