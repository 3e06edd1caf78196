"""The many-row integer matmul's group dots in 8-bit integers on CPUs with AVX-512 VNNI (kernels/quant/intdot.py's
product, the same bits as its torch reference and as intdot_kernels.many_rows_parallel).

intdot_kernels.many_rows_parallel takes a group's dots in float32 FMAs (exact: every partial sum is an integer
below 2^24), 16 multiply-adds per vector instruction. `vpdpbusd` takes 64 (unsigned bytes times signed bytes, four
to a 32-bit lane, summed into it without saturation): the same integers, ~3.7x the multiply-adds per second on one
core of this machine's AMD EPYC (182 against ~48 G/s in /tmp microbenchmarks). The weights' integers are
shifted to unsigned bytes (`u8_tile`: the 4-bit formats' nibbles as they are, whose integer is the nibble less
`zero`; the others' q + 128), so each group's dot is sum(u x) - bias sum(x), exact in int32
(|sum| <= 32 * 255 * 127 < 2^21); the float64 combine that follows is
intdot_kernels.combine_group, unchanged. So the result does not depend on whether this kernel or the float32 one
ran (tests/kernels/test_intdot_vnni.py compares them bit for bit).

numba has no vector types, so `_dots4` writes its loop in LLVM IR (llvmlite, through numba's @intrinsic): four
activation rows times a tile of 64 outputs, 16 accumulators in vector registers, one group's quads of input
columns. It needs the avx512vnni feature of the CPU numba compiles for (`usable()`); elsewhere the float32 kernel
runs.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.quant.intdot_kernels import combine_group, store_rows, tile_scales
from kernels.quant.intdot_tile import TILE as tile

_I32 = ir.IntType(32)
_V16 = ir.VectorType(_I32, 16)   # one zmm register: 16 int32 lanes, each the dot of four byte pairs
_LANES = tile // 16              # zmm registers per tile row of outputs


def usable() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI here (its host CPU, or NUMBA_CPU_NAME /
    NUMBA_CPU_FEATURES where those are set)."""
    from numba.core import config
    if config.CPU_FEATURES is not None:
        return "+avx512vnni" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False   # a named CPU (a portable cache, `generic`): its features are not known here
    import llvmlite.binding as llvm
    return bool(llvm.get_host_cpu_features().get("avx512vnni", False))


@intrinsic
def _dots4(typingctx, wq, x32, q0, nq, p):
    """p[r, j] = sum over quads i in q0..q0+nq-1 of the dot of wq[i, 4j:4j+4] (uint8) and x32[r, i]'s four bytes
    (int8), r = 0..3, j over the tile: wq uint8 [k / 4, 4 tile] (input columns 4i..4i+3 of output j at
    4j..4j+3), x32 int32 [>= 4, k / 4] (four activation rows, their bytes as int32), p int32 [4, tile]."""
    sig = types.void(wq, x32, types.intp, types.intp, p)

    def codegen(context, builder, signature, args):
        wq_v, x_v, q0_v, nq_v, p_v = args
        arrays = [context.make_array(signature.args[i])(context, builder, v)
                  for i, v in ((0, wq_v), (1, x_v), (4, p_v))]
        i8p = ir.IntType(8).as_pointer()
        wbase, xbase, pbase = (builder.bitcast(a.data, i8p) for a in arrays)
        ws, xs, ps = (cgutils.unpack_tuple(builder, a.strides)[0] for a in arrays)   # row strides, bytes
        intp = ws.type

        def c(v):
            return ir.Constant(intp, v)
        dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
        zero = ir.Constant(_V16, None)
        splat = ir.Constant(ir.VectorType(_I32, 16), None)   # shuffle mask: lane 0 everywhere
        pre = builder.basic_block
        loop = builder.append_basic_block("dots4.loop")
        done = builder.append_basic_block("dots4.done")
        builder.cbranch(builder.icmp_signed(">", nq_v, c(0)), loop, done)

        builder.position_at_end(loop)
        i = builder.phi(intp)
        acc = [[builder.phi(_V16) for _ in range(_LANES)] for _ in range(4)]
        row = builder.add(q0_v, i)
        wrow = builder.gep(wbase, [builder.mul(row, ws)])
        w = [builder.load(builder.bitcast(builder.gep(wrow, [c(64 * k)]), _V16.as_pointer()), align=1)
             for k in range(_LANES)]
        xoff = builder.mul(row, c(4))
        new = []
        for r in range(4):
            xp = builder.gep(xbase, [builder.add(builder.mul(c(r), xs), xoff)])
            xi = builder.load(builder.bitcast(xp, _I32.as_pointer()), align=1)
            xv = builder.shuffle_vector(builder.insert_element(ir.Constant(_V16, ir.Undefined), xi,
                                                               ir.Constant(_I32, 0)),
                                        ir.Constant(_V16, ir.Undefined), splat)
            new.append([builder.call(dpbusd, [acc[r][k], w[k], xv]) for k in range(_LANES)])
        inext = builder.add(i, c(1))
        end = builder.basic_block
        i.add_incoming(c(0), pre)
        i.add_incoming(inext, end)
        for r in range(4):
            for k in range(_LANES):
                acc[r][k].add_incoming(zero, pre)
                acc[r][k].add_incoming(new[r][k], end)
        builder.cbranch(builder.icmp_signed("<", inext, nq_v), loop, done)

        builder.position_at_end(done)
        out = [[builder.phi(_V16) for _ in range(_LANES)] for _ in range(4)]
        for r in range(4):
            for k in range(_LANES):
                out[r][k].add_incoming(zero, pre)
                out[r][k].add_incoming(new[r][k], end)
        for r in range(4):
            for k in range(_LANES):
                pp = builder.gep(pbase, [builder.add(builder.mul(c(r), ps), c(64 * k))])
                builder.store(out[r][k], builder.bitcast(pp, _V16.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def u8_tile(q, nibbles, zero, t, wq):
    """Tile t of the repacked integers as unsigned bytes in quads, wq uint8 [k / 4, 4 tile]: wq[i, 4j + u] is the
    integer of input column 4i + u for output t tile + j plus the returned bias (the 4-bit formats: their nibble,
    bias = zero; the others: q + 128)."""
    wt = q[t]
    k = wq.shape[0] * 4
    if nibbles:
        for b in range(k // 32):
            for i in range(16):
                wr = wt[b * 16 + i]
                lo, hi = b * 32 + i, b * 32 + 16 + i
                wl, wh = wq[lo // 4], wq[hi // 4]
                ol, oh = lo % 4, hi % 4
                for j in range(tile):
                    v = wr[j]
                    wl[4 * j + ol] = v & 15
                    wh[4 * j + oh] = v >> 4
        return zero
    for i in range(k):
        wr = wt[i]
        wi = wq[i // 4]
        o = i % 4
        for j in range(tile):
            wi[4 * j + o] = np.uint8(np.int32(wr[j]) + 128)
    return 128


@njit(nogil=True, cache=True)
def many_rows_tile_vnni(wq, bias, a, c, xq, x32, dx, s, e, out, t):
    """Every row of xq (int8 [m, k]; x32 its int32 view) times tile t (wq: u8_tile's, bias its bias) into out
    [m, n] columns t tile.., four rows at a time: each group's dots by _dots4, less bias times the rows' group
    sums, combined in float64 by combine_group (intdot_kernels.many_rows_tile's order)."""
    k = xq.shape[1]
    n_groups = a.shape[0]
    g_size = k // n_groups
    gq = g_size // 4
    j0 = t * tile
    m = xq.shape[0]
    a64, c64 = tile_scales(a, c, j0)
    x4 = np.zeros((4, k // 4), np.int32)
    ps = np.empty((4, tile), np.int32)
    xsum = np.zeros(4, np.int32)
    acc = np.empty((4, tile), np.float64)
    acc2 = np.empty((4, tile), np.float64)
    for r0 in range(0, m, 4):
        nr = min(4, m - r0)
        if nr == 4:
            xr = x32[r0:r0 + 4]
        else:
            x4[:] = 0
            x4[:nr] = x32[r0:r0 + nr]
            xr = x4
        acc[:] = 0.0
        acc2[:] = 0.0
        for g in range(n_groups):
            _dots4(wq, xr, g * gq, gq, ps)
            for rr in range(nr):
                sm = np.int32(0)
                for i in range(g * g_size, (g + 1) * g_size):
                    sm += np.int32(xq[r0 + rr, i])
                xsum[rr] = sm * bias
            for rr in range(nr):
                pr = ps[rr]
                corr = xsum[rr]
                for j in range(tile):
                    pr[j] -= corr
            combine_group(ps, nr, a64[g], c64[g], dx, s, e, r0, g, acc, acc2)
        store_rows(acc, acc2, nr, out, r0, j0)


@njit(parallel=True, nogil=True, cache=True)
def many_rows_vnni_parallel(q, nibbles, zero, a, c, xq, x32, dx, s, e, out, row_chunk):
    """intdot_kernels.many_rows_parallel's work items (a tile of outputs times row_chunk rows) with the group dots
    in bytes: the tile's integers as unsigned bytes once per item, then its rows."""
    k, m = xq.shape[1], xq.shape[0]
    n_chunks = (m + row_chunk - 1) // row_chunk
    for item in prange(q.shape[0] * n_chunks):
        t = item // n_chunks
        r0 = (item % n_chunks) * row_chunk
        r1 = min(m, r0 + row_chunk)
        wq = np.empty((k // 4, 4 * tile), np.uint8)
        bias = u8_tile(q, nibbles, zero, t, wq)
        many_rows_tile_vnni(wq, bias, a, c, xq[r0:r1], x32[r0:r1], dx[r0:r1], s[r0:r1], e[r0:r1],
                            out[r0:r1], t)
