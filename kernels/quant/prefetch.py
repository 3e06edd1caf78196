"""A packed weight brought into L2 ahead of its matmul, while small kernels run.

Between a Gated DeltaNet layer's input projection and its output projection a 1-row decode step runs three
small kernels (convolution, delta rule, output norm with its gate: ~17-21 us on the H200, twenty-eighth
session's trace), and an attention layer's rope/K-V write, attention and merge (~30 us). They read little
memory, so the HBM mostly idles while they run, and then the output projection (17.7 MB on the 27B) streams
its weights. `prefetch_weight` launches one kernel, right after the input projection, that asks L2 for the
output projection's bytes (`cp.async.bulk.prefetch.L2`: a hint, nothing is loaded into registers or shared
memory, so no result can change), and the output projection then finds them there (the H200's L2 holds 50 MB).

The kernel launches with PDL like the step's others (kernels/pdl.py): it lets the next kernel launch, issues
its prefetches, then waits for its predecessor before it ends, so every kernel still completes after the ones
before it. Off on GPUs before sm_90 (no bulk prefetch), under Triton's interpreter (no PTX) and on the CPU.
"""
from __future__ import annotations

import os

import torch

from kernels.pdl import pdl_args, pdl_on

try:
    import triton
    import triton.language as tl
    from kernels.pdl import pdl_trigger, pdl_wait
except ImportError:   # CPU-only installs: nothing to prefetch
    triton = None

# bytes one prefetch instruction asks for, and prefetches per program (one per thread of 4 warps)
PIECE = int(os.environ.get("HIVEJET_PREFETCH_PIECE", "1024"))
LANES = 128
MAX_TENSORS = 5     # a packed weight's planes (2), scales, mins, super-block factors


def ranges(tensors) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor as bytes, first byte, bytes) per contiguous tensor: its bytes with the start rounded up and
    the end rounded down to 16 (the bulk prefetch's alignment)."""
    out = []
    for t in tensors:
        if not t.is_contiguous():
            continue
        b = t.reshape(-1).view(torch.uint8)
        first = -b.data_ptr() % 16
        n = b.numel() - first
        n -= n % 16
        if n > 0:
            out.append((b, first, n))
    return out


if triton is not None:
    @triton.jit
    def _prefetch_kernel(p0, f0, n0, p1, f1, n1, p2, f2, n2, p3, f3, n3, p4, f4, n4,
                         PIECE: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr = False):
        """Program p asks L2 for pieces p * LANES .. p * LANES + LANES - 1 (PIECE bytes each) of every
        tensor (byte f of tensor i onwards, n bytes), one piece per thread, then waits for its predecessor."""
        pdl_trigger(PDL)
        piece = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
        _prefetch_pieces(p0, f0, n0, piece, PIECE)
        _prefetch_pieces(p1, f1, n1, piece, PIECE)
        _prefetch_pieces(p2, f2, n2, piece, PIECE)
        _prefetch_pieces(p3, f3, n3, piece, PIECE)
        _prefetch_pieces(p4, f4, n4, piece, PIECE)
        pdl_wait(PDL)

    @triton.jit
    def _prefetch_pieces(ptr, first, n, piece, PIECE: tl.constexpr):
        start = piece * PIECE
        size = tl.minimum(n - start, PIECE).to(tl.int32)    # <= 0 past the end: nothing asked
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + first + start, size], dtype=tl.int32, is_pure=False, pack=1)


def can_prefetch(t: torch.Tensor) -> bool:
    """Whether weights on t's device can be prefetched: a CUDA device of sm_90+ (the bulk prefetch) with
    PDL on (the kernel keeps the step's order through it), not under Triton's interpreter."""
    return triton is not None and pdl_on(t)


_SIDE: dict[int, "torch.cuda.Stream"] = {}     # per device: the stream prefetches run on beside the step
_FORKED: list = []                             # (side stream, the stream it forked from) not joined yet


def prefetch_weight(tensors, aside: bool = False) -> None:
    """Ask L2 for a weight's tensors (a PackedWeight's `tensors`) in one launch that does not hold up the
    kernels after it. Nothing on devices that cannot (can_prefetch). aside: on a side stream forked from the
    current one (join_prefetches joins it back, as a CUDA graph capture requires), so the kernels after it do
    not wait for the prefetch kernel at all; else in the stream, with PDL."""
    tensors = [t for t in tensors if t is not None]
    if not tensors or not can_prefetch(tensors[0]):
        return
    if aside:
        main = torch.cuda.current_stream(tensors[0].device)
        side = _SIDE.setdefault(tensors[0].device.index, torch.cuda.Stream(tensors[0].device))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _launch(tensors, pdl=False)
        _FORKED.append((side, main))
        return
    _launch(tensors, pdl=True)


def join_prefetches() -> None:
    """Make the streams prefetches forked from wait for them (cheap: they ended long before)."""
    while _FORKED:
        side, main = _FORKED.pop()
        main.wait_stream(side)


def _launch(tensors, pdl: bool) -> None:
    rs = ranges(tensors)[:MAX_TENSORS]
    if not rs:
        return
    longest = max(n for _, _, n in rs)
    args = []
    for i in range(MAX_TENSORS):
        b, first, n = rs[i] if i < len(rs) else (rs[0][0], 0, 0)
        args += [b, first, n]
    grid = (-(-longest // (PIECE * LANES)),)
    _prefetch_kernel[grid](*args, PIECE=PIECE, LANES=LANES, num_warps=LANES // 32,
                           **(pdl_args(rs[0][0]) if pdl else {}))
