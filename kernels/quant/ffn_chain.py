"""A decode step's SwiGLU FFN as one launch: gate+up (one stacked packed weight), silu(gate) * up, and
down plus the residual, handed from stage to stage through L2 behind arrival counts instead of three
kernel boundaries (the launches' fixed cost is ~1.5 ms of a 27B step, docs/PERFORMANCE.md).

    out = add + (silu(x @ G.T) * (x @ U.T)).half() @ D.T        (x: fp16 decode rows, M <= BLOCK_M)

The work is a list of items, every gate+up item (row band, k-slice) before every down item (k-slice,
row band), each item the same tile loop as kernels/quant/packed.py's decode matmul. Programs claim items
in that order from a counter (an atomic add), so a program that waits is always waiting for items that
running programs have claimed, and those never wait: no deadlock, however many programs are resident.
  - gate+up item: its partial sums, then (the band's last slice) their sum in slice order, as the
    packed kernel's split-K does; the second band of a (gate, up) pair to be summed makes that pair's 128
    columns of h = fp16(silu(gate) * up) (the same math as kernels/fused.py's silu_mul) and marks the
    chunk ready.
  - down item: asks L2 for its weight tiles, waits until the chunks of h its slice reads are ready,
    then the tile loop over h; the band's last slice adds the partial sums in order to the residual.
The counts leave themselves at 0 (the last program out clears the chunk flags), so the launch can be
replayed in a CUDA graph. With the same split counts the result has the packed path's bits
(`ffn_unfused`: packed_matmul, silu_mul, packed_matmul with add).

Needs: gate and up stacked in one packed weight of 128-row (TILE_N) tiles, gate's rows first, F (the
hidden FFN size) a multiple of that tile, and down's K tiles as wide as gate's row bands (each chunk of
h one down K tile); `chain_supported` says whether a pair of weights qualifies.
"""
from __future__ import annotations

import os

import torch

from kernels.pdl import pdl_args
from kernels.quant.packed import PackedWeight, _pointers, kernel_constants, packed_matmul

try:
    import triton
    import triton.language as tl
    from kernels.pdl import pdl_trigger, pdl_wait
    from kernels.quant.packed import _dequant_tile, _prefetch_tiles
except ImportError:
    triton = None

__all__ = ["chain_supported", "ffn_chain", "ffn_unfused"]


if triton is not None:
    @triton.jit
    def _slice_product(x_ptr, stride_xm, offs_m, mask_m, lo, hi, s, m, sup, band, k_first, tiles,
                       X_CG: tl.constexpr, KT: tl.constexpr, HI_BITS: tl.constexpr, GROUP: tl.constexpr,
                       CODES: tl.constexpr, OFFSET: tl.constexpr, HAS_MINV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """sum over the slice's tiles of x_block @ W_tile.T, float32 [BLOCK_M, BLOCK_N] (the weight tile as
        the dot's first operand, as the packed kernel's decode settings do). X_CG: x is written during
        this launch by other programs: read it from L2."""
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for t in range(0, tiles):
            kt = k_first + t
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            xp = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            if X_CG:
                x = tl.load(xp, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
            else:
                x = tl.load(xp, mask=mask_m[:, None], other=0.0)
            w16 = _dequant_tile(lo, hi, s, m, sup, band.to(tl.int64) * KT + kt, HI_BITS, GROUP, CODES, OFFSET,
                                HAS_MINV, BLOCK_N, BLOCK_K, True)
            acc += tl.dot(w16, tl.trans(x.to(tl.float16)))
        return tl.trans(acc)

    @triton.jit
    def _poll(flag_ptr, POLL: tl.constexpr):
        """A flag's value with acquire semantics. POLL 0: an atomic add of 0; 1: ld.acquire after a 200 ns
        sleep (the polls of many waiting programs kept off L2's atomic units)."""
        if POLL == 0:
            v = tl.atomic_add(flag_ptr, 0, sem="acquire")
        else:
            v = tl.inline_asm_elementwise("nanosleep.u32 200; ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                                          [flag_ptr], dtype=tl.int32, is_pure=False, pack=1)
        return v

    @triton.jit
    def _sum_slices(part_ptr, MN, offs, mask, SPLIT: tl.constexpr):
        """part[0] + part[1] + ... + part[SPLIT - 1] at offs, added in that order (read from L2)."""
        tot = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for i in tl.static_range(1, SPLIT):
            tot += tl.load(part_ptr + i * MN + offs, mask=mask, other=0.0, cache_modifier=".cg")
        return tot

    @triton.jit
    def _gate_up_done(acc, gu_ptr, h_ptr, pair_cnt, ready_ptr, offs, offs_m, mask_m, p, half, F: tl.constexpr,
                      PAIRS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Band `half` (0 gate, 1 up) of pair p is summed (acc): store it; the pair's second makes its chunk
        of h = fp16(silu(gate) * up) and marks it ready."""
        mask = mask_m[:, None]
        tl.store(gu_ptr + offs, acc, mask=mask)
        tl.debug_barrier()
        if tl.atomic_add(pair_cnt + p, 1, sem="acq_rel") == 1:
            other_cols = (p + (1 - half) * PAIRS) * BLOCK_N + tl.arange(0, BLOCK_N)
            other = tl.load(gu_ptr + offs_m[:, None].to(tl.int64) * (2 * F) + other_cols[None, :], mask=mask,
                            other=0.0, cache_modifier=".cg")
            g = tl.where(half == 0, acc, other)
            u = tl.where(half == 0, other, acc)
            hv = g / (1.0 + tl.exp(-g)) * u        # (kernels/fused.py's silu_mul, rounded once to fp16)
            h_cols = p * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(h_ptr + offs_m[:, None].to(tl.int64) * F + h_cols[None, :], hv.to(tl.float16), mask=mask)
            tl.atomic_xchg(pair_cnt + p, 0)
            tl.debug_barrier()
            tl.atomic_xchg(ready_ptr + p, 1, sem="release")

    @triton.jit
    def _gate_up_item(item, x_ptr, stride_xm, offs_m, mask_m, a_lo, a_hi, a_s, a_m, a_sup, part_a, gu_ptr, h_ptr,
                      cnt_a, pair_cnt, ready_ptr, MN_A, F: tl.constexpr, PAIRS: tl.constexpr,
                      A_KT: tl.constexpr, A_HI_BITS: tl.constexpr, A_GROUP: tl.constexpr, A_CODES: tl.constexpr,
                      A_OFFSET: tl.constexpr, A_HAS_MINV: tl.constexpr, A_BLOCK_N: tl.constexpr,
                      A_BLOCK_K: tl.constexpr, A_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
        """A gate+up item: pair p, half 0 (gate) / 1 (up), k-slice s."""
        p = item // (2 * A_SPLIT)
        half = (item // A_SPLIT) % 2
        s = item % A_SPLIT
        band = p + half * PAIRS
        k_first = s * A_KT // A_SPLIT
        acc = _slice_product(x_ptr, stride_xm, offs_m, mask_m, a_lo, a_hi, a_s, a_m, a_sup, band, k_first,
                             (s + 1) * A_KT // A_SPLIT - k_first, False, A_KT, A_HI_BITS, A_GROUP,
                             A_CODES, A_OFFSET, A_HAS_MINV, BLOCK_M, A_BLOCK_N, A_BLOCK_K)
        cols = band * A_BLOCK_N + tl.arange(0, A_BLOCK_N)
        offs = offs_m[:, None].to(tl.int64) * (2 * F) + cols[None, :]
        if A_SPLIT == 1:
            _gate_up_done(acc, gu_ptr, h_ptr, pair_cnt, ready_ptr, offs, offs_m, mask_m, p, half,
                          F, PAIRS, A_BLOCK_N)
        else:
            tl.store(part_a + s * MN_A + offs, acc, mask=mask_m[:, None])
            tl.debug_barrier()
            if tl.atomic_add(cnt_a + band, 1, sem="acq_rel") == A_SPLIT - 1:
                tot = _sum_slices(part_a, MN_A, offs, mask_m[:, None], A_SPLIT)
                tl.atomic_xchg(cnt_a + band, 0)
                _gate_up_done(tot, gu_ptr, h_ptr, pair_cnt, ready_ptr, offs, offs_m, mask_m, p, half,
                              F, PAIRS, A_BLOCK_N)

    @triton.jit
    def _down_item(j, h_ptr, offs_m, mask_m, b_lo, b_hi, b_s, b_m, b_sup, part_b, out_ptr, add_ptr, cnt_b,
                   ready_ptr, MN_B, F: tl.constexpr, N_OUT: tl.constexpr, B_BANDS: tl.constexpr,
                   B_KT: tl.constexpr, B_HI_BITS: tl.constexpr, B_GROUP: tl.constexpr, B_CODES: tl.constexpr,
                   B_OFFSET: tl.constexpr, B_HAS_MINV: tl.constexpr, B_BLOCK_N: tl.constexpr,
                   B_BLOCK_K: tl.constexpr, B_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   PREFETCH: tl.constexpr, POLL: tl.constexpr):
        """A down item: k-slice s (the slower index: the first slices' chunks of h are ready first), band."""
        s = j // B_BANDS
        band = j % B_BANDS
        k_first = s * B_KT // B_SPLIT
        tiles = (s + 1) * B_KT // B_SPLIT - k_first
        if PREFETCH:     # (weights: never written, so before the wait)
            _prefetch_tiles(b_lo, b_hi, b_s, b_m, b_sup, band.to(tl.int64) * B_KT + k_first, tiles,
                            B_HI_BITS, B_GROUP, B_CODES, B_HAS_MINV, B_BLOCK_N, B_BLOCK_K)
        for t in range(0, tiles):
            flag = _poll(ready_ptr + k_first + t, POLL)
            while flag == 0:
                flag = _poll(ready_ptr + k_first + t, POLL)
        acc = _slice_product(h_ptr, F, offs_m, mask_m, b_lo, b_hi, b_s, b_m, b_sup, band, k_first, tiles,
                             True, B_KT, B_HI_BITS, B_GROUP, B_CODES, B_OFFSET, B_HAS_MINV, BLOCK_M,
                             B_BLOCK_N, B_BLOCK_K)
        cols = band * B_BLOCK_N + tl.arange(0, B_BLOCK_N)
        offs = offs_m[:, None].to(tl.int64) * N_OUT + cols[None, :]
        mask = mask_m[:, None] & (cols[None, :] < N_OUT)
        if B_SPLIT == 1:
            tl.store(out_ptr + offs, tl.load(add_ptr + offs, mask=mask, other=0.0) + acc, mask=mask)
        else:
            tl.store(part_b + s * MN_B + offs, acc, mask=mask)
            tl.debug_barrier()
            if tl.atomic_add(cnt_b + band, 1, sem="acq_rel") == B_SPLIT - 1:
                tot = _sum_slices(part_b, MN_B, offs, mask, B_SPLIT)
                tl.store(out_ptr + offs, tl.load(add_ptr + offs, mask=mask, other=0.0) + tot, mask=mask)
                tl.atomic_xchg(cnt_b + band, 0)

    @triton.jit
    def _ffn_chain_kernel(x_ptr, a_lo, a_hi, a_s, a_m, a_sup, b_lo, b_hi, b_s, b_m, b_sup,
                          part_a, gu_ptr, h_ptr, part_b, out_ptr, add_ptr,
                          cnt_a, pair_cnt, ready_ptr, cnt_b, work_ptr, exit_ptr,
                          M, stride_xm,
                          F: tl.constexpr, N_OUT: tl.constexpr,
                          A_KT: tl.constexpr, A_HI_BITS: tl.constexpr, A_GROUP: tl.constexpr,
                          A_CODES: tl.constexpr, A_OFFSET: tl.constexpr, A_HAS_MINV: tl.constexpr,
                          A_BLOCK_N: tl.constexpr, A_BLOCK_K: tl.constexpr, A_SPLIT: tl.constexpr,
                          B_KT: tl.constexpr, B_HI_BITS: tl.constexpr, B_GROUP: tl.constexpr,
                          B_CODES: tl.constexpr, B_OFFSET: tl.constexpr, B_HAS_MINV: tl.constexpr,
                          B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr, B_SPLIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, PREFETCH: tl.constexpr = False, POLL: tl.constexpr = 0,
                          ONE_ITEM: tl.constexpr = False, PDL: tl.constexpr = False):
        PAIRS: tl.constexpr = F // A_BLOCK_N                   # gate's row bands (= up's = h's chunks)
        NA: tl.constexpr = 2 * PAIRS * A_SPLIT                 # gate+up items
        B_BANDS: tl.constexpr = (N_OUT + B_BLOCK_N - 1) // B_BLOCK_N
        TOTAL: tl.constexpr = NA + B_BANDS * B_SPLIT
        READY_P2: tl.constexpr = triton.next_power_of_2(B_KT)
        pdl_wait(PDL)
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        zero = tl.program_id(0).to(tl.int64) * 0              # (M may be a constexpr 1: no .to on it)
        MN_A = (zero + M) * (2 * F)
        MN_B = (zero + M) * N_OUT
        item = tl.atomic_add(work_ptr, 1, sem="relaxed")
        if ONE_ITEM:     # a program per item (the grid is TOTAL): no loop keeps a tile's addresses live
            if item < NA:
                _gate_up_item(item, x_ptr, stride_xm, offs_m, mask_m, a_lo, a_hi, a_s, a_m, a_sup, part_a, gu_ptr,
                              h_ptr, cnt_a, pair_cnt, ready_ptr, MN_A, F, PAIRS, A_KT, A_HI_BITS, A_GROUP,
                              A_CODES, A_OFFSET, A_HAS_MINV, A_BLOCK_N, A_BLOCK_K, A_SPLIT, BLOCK_M)
            else:
                _down_item(item - NA, h_ptr, offs_m, mask_m, b_lo, b_hi, b_s, b_m, b_sup, part_b, out_ptr, add_ptr,
                           cnt_b, ready_ptr, MN_B, F, N_OUT, B_BANDS, B_KT, B_HI_BITS, B_GROUP, B_CODES, B_OFFSET,
                           B_HAS_MINV, B_BLOCK_N, B_BLOCK_K, B_SPLIT, BLOCK_M, PREFETCH, POLL)
        else:
            # claims only grow, so a program's gate+up items all come before its down items: two loops (one
            # loop with both kinds kept both kinds' tile addresses live: 255 registers and spills, sm_90)
            while item < NA:
                nxt = tl.atomic_add(work_ptr, 1, sem="relaxed")     # (its latency hidden behind this item)
                _gate_up_item(item, x_ptr, stride_xm, offs_m, mask_m, a_lo, a_hi, a_s, a_m, a_sup, part_a, gu_ptr,
                              h_ptr, cnt_a, pair_cnt, ready_ptr, MN_A, F, PAIRS, A_KT, A_HI_BITS, A_GROUP,
                              A_CODES, A_OFFSET, A_HAS_MINV, A_BLOCK_N, A_BLOCK_K, A_SPLIT, BLOCK_M)
                item = nxt
            while item < TOTAL:
                nxt = tl.atomic_add(work_ptr, 1, sem="relaxed")
                _down_item(item - NA, h_ptr, offs_m, mask_m, b_lo, b_hi, b_s, b_m, b_sup, part_b, out_ptr, add_ptr,
                           cnt_b, ready_ptr, MN_B, F, N_OUT, B_BANDS, B_KT, B_HI_BITS, B_GROUP, B_CODES, B_OFFSET,
                           B_HAS_MINV, B_BLOCK_N, B_BLOCK_K, B_SPLIT, BLOCK_M, PREFETCH, POLL)
                item = nxt
        pdl_trigger(PDL)
        # the last program out: every item is done and no one reads the flags any more; clear them
        tl.debug_barrier()
        if tl.atomic_add(exit_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            r = tl.arange(0, READY_P2)
            tl.store(ready_ptr + r, tl.zeros((READY_P2,), tl.int32), mask=r < B_KT)
            tl.atomic_xchg(work_ptr, 0)
            tl.atomic_xchg(exit_ptr, 0)


def chain_supported(gate_up: PackedWeight, down: PackedWeight, f: int) -> bool:
    """Whether ffn_chain can take this stacked gate+up weight (gate's f rows first, then up's) and down."""
    return (gate_up.n == 2 * f and f % gate_up.tile_n == 0 and down.k == f and down.tile_k == gate_up.tile_n
            and gate_up.k % gate_up.tile_k == 0)


class _Counts:
    """A chain's arrival counts and flags (int32, all 0 between launches), kept per (gate_up, down)."""

    def __init__(self, gate_up: PackedWeight, down: PackedWeight, device):
        z = lambda n: torch.zeros(n, dtype=torch.int32, device=device)   # noqa: E731
        self.cnt_a = z(gate_up.n_pad // gate_up.tile_n)
        self.pair = z(gate_up.n // 2 // gate_up.tile_n)
        self.ready = z(down.k // down.tile_k)
        self.cnt_b = z(down.n_pad // down.tile_n)
        self.work = z(1)
        self.exit = z(1)


_COUNTS: dict = {}
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def _prefixed(prefix: str, consts: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in consts.items()}


def ffn_chain(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, add: torch.Tensor, *,
              split_a: int, split_b: int, programs: int, block_m: int = 16, num_warps: int = 4,
              num_stages: int = 3, maxnreg: int | None = None, poll: int = 0) -> torch.Tensor:
    """add + silu_mul(x @ gate.T, x @ up.T) @ down.T for decode rows x (fp16 [M, K], M <= block_m), in
    one launch of `programs` programs (any number: they claim the items; 0: one program per item).
    add: float32 [M, down.n]."""
    f = gate_up.n // 2
    if not chain_supported(gate_up, down, f):
        raise ValueError("these weights do not fit the FFN chain (chain_supported)")
    m = x.shape[0]
    if m > block_m:
        raise ValueError(f"at most {block_m} rows, got {m}")
    if add.dtype != torch.float32 or add.shape != (m, down.n) or not add.is_contiguous():
        raise ValueError(f"add must be contiguous float32 [{m}, {down.n}]")
    if x.dtype != torch.float16 or x.stride(-1) != 1:
        x = x.to(torch.float16).contiguous()
    dev = x.device
    key = (id(gate_up.planes[0]), id(down.planes[0]), dev)
    counts = _COUNTS.get(key)
    if counts is None:
        counts = _COUNTS[key] = _Counts(gate_up, down, dev)
    kt_a, kt_b = gate_up.k // gate_up.tile_k, down.k // down.tile_k
    split_a, split_b = max(1, min(split_a, kt_a)), max(1, min(split_b, kt_b))
    part_a = torch.empty((split_a, m, 2 * f), dtype=torch.float32, device=dev)
    gu = torch.empty((m, 2 * f), dtype=torch.float32, device=dev)
    h = torch.empty((m, f), dtype=torch.float16, device=dev)
    part_b = torch.empty((split_b, m, down.n), dtype=torch.float32, device=dev)
    out = torch.empty((m, down.n), dtype=torch.float32, device=dev)
    ka, kb = kernel_constants(gate_up), kernel_constants(down)
    launch = dict(num_warps=num_warps, num_stages=num_stages) if x.is_cuda else {}
    if maxnreg and x.is_cuda:
        launch["maxnreg"] = maxnreg
    one_item = programs == 0
    if one_item:
        programs = 2 * (f // gate_up.tile_n) * split_a + (down.n_pad // down.tile_n) * split_b
    _ffn_chain_kernel[(programs,)](
        x, *_pointers(gate_up), *_pointers(down), part_a, gu, h, part_b, out, add,
        counts.cnt_a, counts.pair, counts.ready, counts.cnt_b, counts.work, counts.exit,
        m, x.stride(0), F=f, N_OUT=down.n, **_prefixed("A", ka), A_SPLIT=split_a, **_prefixed("B", kb),
        B_SPLIT=split_b, BLOCK_M=block_m, PREFETCH=x.is_cuda and not _INTERPRETER,
        POLL=poll if x.is_cuda and not _INTERPRETER else 0, ONE_ITEM=one_item, **pdl_args(x), **launch)
    return out


def ffn_unfused(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight, add: torch.Tensor, *,
                split_a: int, split_b: int, **cfg) -> torch.Tensor:
    """The same product as three launches (the engine's path): packed_matmul, silu_mul, packed_matmul with
    add; cfg: packed_matmul's other settings for both."""
    from kernels.fused import silu_mul
    f = gate_up.n // 2
    gu = packed_matmul(x, gate_up, split_k=split_a, **cfg)
    h = silu_mul(gu[:, :f], gu[:, f:], torch.float16)
    return packed_matmul(h, down, split_k=split_b, add=add, **cfg)
