"""How fast one launch can merely read a decode matrix's bytes (H200): the ceiling of any one-launch-per-matrix
decode matmul, against which the packed matmul's times (matmul_shapes.py) show what a better kernel could still
win. For each of the 27B's decode matrices (its packed bytes, `packed_bytes`), buffers of that size past the
L2 are read back to back in one CUDA graph (PDL on, as the engine launches) by
  - a Triton kernel: P programs (a whole number per SM), each XOR-ing a contiguous run of BLOCK-byte blocks
    (the loop software-pipelined to STAGES loads in flight), one word out per program;
  - a Gluon kernel (--gluon): the same runs, each program's blocks brought into a ring of shared-memory buffers
    by TMA from a one-warp loader partition (warp specialization) while four warps XOR them: the bytes in
    flight per SM no longer wait on the compute warps' progress.
Prints, per matrix, the best time of each kind with its settings (settings whose whole blocks cover under 90 %
of a matrix are skipped; the time is scaled to all its bytes), and the step's sum (each matrix times its count
per step) beside the matmuls' 7.09 ms (twenty-third session). The Gluon reader launches without PDL.

    python3 -u .ci/gpu/read_ceiling.py [--gluon] [--json OUT]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, ".ci/gpu")
from kernels._interpreter_compat import apply as _fix_interpreter  # noqa: E402
from kernels.packed_layout import packed_bytes  # noqa: E402
from kernels.pdl import pdl_args, pdl_trigger, pdl_wait  # noqa: E402

_fix_interpreter()   # (a runtime loop bound, for a check under TRITON_INTERPRET)

# the 27B's decode matrices: (type, rows, K, per step); the gate+up and QKV stacks as one
MATRICES = [("Q4_K", 34816, 5120, 64), ("Q6_K", 5120, 17408, 32), ("Q4_K", 5120, 17408, 32),
            ("Q4_K", 16512, 5120, 24), ("Q4_K", 5120, 6144, 64), ("Q6_K", 248320, 5120, 1),
            ("Q6_K", 10240, 5120, 24), ("Q4_K", 6272, 5120, 24), ("Q4_K", 14336, 5120, 8),
            ("Q4_K", 13312, 5120, 8), ("Q6_K", 1024, 5120, 8)]


@triton.jit
def _read_kernel(buf_ptr, out_ptr, n_words, WORDS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Program p XORs words [p * per, (p + 1) * per) of buf, WORDS int32 at a time (per: n_words / programs,
    a multiple of WORDS), and writes the result."""
    pdl_wait(PDL)
    p = tl.program_id(0)
    per = n_words // tl.num_programs(0)
    base = buf_ptr + p.to(tl.int64) * per
    acc = tl.zeros((WORDS,), tl.int32)
    for i in tl.range(0, per // WORDS, num_stages=STAGES):
        acc ^= tl.load(base + i * WORDS + tl.arange(0, WORDS))
    pdl_trigger(PDL)
    tl.store(out_ptr + p, tl.xor_sum(acc, 0))


def triton_words(buf: torch.Tensor, programs: int, words: int) -> int:
    """The words the Triton reader covers: whole blocks, the same number per program."""
    return buf.numel() // (programs * words) * programs * words


def triton_read(buf: torch.Tensor, out: torch.Tensor, programs: int, words: int, stages: int) -> None:
    _read_kernel[(programs,)](buf, out, triton_words(buf, programs, words), WORDS=words, STAGES=stages,
                              num_warps=4, **pdl_args(buf))


try:   # Gluon (Triton 3.5+): the warp-specialized reader
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
except ImportError:
    gluon = None

if gluon is not None:
    @gluon.jit
    def _load(desc, empty, ready, bufs, row0, n_iter):
        rows: gl.constexpr = desc.block_type.shape[0]
        nb: gl.constexpr = bufs.type.shape[0]
        for i in range(n_iter):
            idx = i % nb
            mbarrier.wait(empty.index(idx), (i // nb & 1) ^ 1)
            mbarrier.expect(ready.index(idx), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row0 + i * rows, 0], ready.index(idx), bufs.index(idx))

    @gluon.jit
    def _consume(empty, ready, bufs, n_iter, out_ptr, p, ROWS: gl.constexpr, COLS: gl.constexpr,
                 layout: gl.constexpr):
        nb: gl.constexpr = bufs.type.shape[0]
        acc = gl.zeros([ROWS, COLS], gl.int32, layout)
        for i in range(n_iter):
            idx = i % nb
            mbarrier.wait(ready.index(idx), i // nb & 1)
            acc ^= bufs.index(idx).load(layout)
            mbarrier.arrive(empty.index(idx), count=1)
        gl.store(out_ptr + p, gl.xor_sum(gl.xor_sum(acc, 1), 0))

    @gluon.jit
    def _ws_read_kernel(desc, out_ptr, rows_per_program, NB: gl.constexpr, num_warps: gl.constexpr):
        """Program p reads rows [p * rows_per_program, ...) of desc's [rows, 64] int32 view: a one-warp
        loader partition brings box after box into a ring of NB shared-memory buffers by TMA, the default
        partition's warps XOR them."""
        rows: gl.constexpr = desc.block_type.shape[0]
        cols: gl.constexpr = desc.block_type.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
        bufs = gl.allocate_shared_memory(desc.dtype, [NB, rows, cols], desc.layout)
        empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NB):
            mbarrier.init(empty.index(i), count=1)
            mbarrier.init(ready.index(i), count=1)
        p = gl.program_id(0)
        n_iter = rows_per_program // rows
        gl.warp_specialize([(_consume, (empty, ready, bufs, n_iter, out_ptr, p, rows, cols, layout)),
                            (_load, (desc, empty, ready, bufs, p * rows_per_program, n_iter))], [1], [24])


def gluon_rows(buf: torch.Tensor, programs: int, rows: int) -> int:
    """The 256-byte rows each program of the Gluon reader covers (whole boxes)."""
    return buf.numel() // 64 // (programs * rows) * rows


def gluon_read(buf: torch.Tensor, out: torch.Tensor, programs: int, rows: int, stages: int) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    t = buf.view(-1)[:buf.numel() // 64 * 64].view(-1, 64)          # 256-byte rows
    per = gluon_rows(buf, programs, rows)
    layout = gl.NVMMASharedLayout.get_default_for([rows, 64], gl.int32)
    desc = TensorDescriptor.from_tensor(t[:per * programs], [rows, 64], layout)
    _ws_read_kernel[(programs,)](desc, out, per, NB=stages, num_warps=4, maxnreg=128)


def main():
    from sweep_scales import graph_time
    ap = argparse.ArgumentParser()
    ap.add_argument("--gluon", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    if a.gluon and gluon is None:
        raise SystemExit("this Triton has no Gluon")
    rows, step = [], {"triton": 0.0, "gluon": 0.0}
    for qt, n, k, per_step in MATRICES:
        nbytes = packed_bytes(qt, n, k)
        copies = max(2, int(600e6 // nbytes) + 1)
        bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        out = torch.empty(16 * n_sm * 16, dtype=torch.int32, device="cuda")
        best = {}
        for per_sm, words, stages in itertools.product((4, 8, 16), (1024, 2048), (3, 6)):
            read = 4 * triton_words(bufs[0], per_sm * n_sm, words)
            if read < 0.9 * nbytes:      # (blocks too coarse for this size)
                continue
            t = graph_time(lambda b: triton_read(b, out, per_sm * n_sm, words, stages), bufs)
            r = dict(type=qt, n=n, k=k, mb=nbytes / 1e6, kind="triton", per_sm=per_sm, words=words, stages=stages,
                     read_mb=read / 1e6, us=t * 1e6 * nbytes / read, tbps=read / t / 1e12)
            rows.append(r)
            if "triton" not in best or r["us"] < best["triton"]["us"]:
                best["triton"] = r
        if a.gluon:
            for per_sm, box_rows, stages in itertools.product((1, 2, 4), (16, 32), (4, 8)):
                read = 256 * per_sm * n_sm * gluon_rows(bufs[0], per_sm * n_sm, box_rows)
                if read < 0.9 * nbytes:
                    continue
                try:
                    t = graph_time(lambda b: gluon_read(b, out, per_sm * n_sm, box_rows, stages), bufs)
                except Exception as e:   # (a setting that does not fit shared memory or registers)
                    print(f"  gluon {per_sm}/SM rows {box_rows} stages {stages}: {type(e).__name__} {str(e)[:100]}")
                    continue
                r = dict(type=qt, n=n, k=k, mb=nbytes / 1e6, kind="gluon", per_sm=per_sm, rows=box_rows,
                         stages=stages, read_mb=read / 1e6, us=t * 1e6 * nbytes / read, tbps=read / t / 1e12)
                rows.append(r)
                if "gluon" not in best or r["us"] < best["gluon"]["us"]:
                    best["gluon"] = r
        for kind, r in best.items():
            step[kind] += per_step * r["us"] / 1e3
            print(f"{qt} {n:6d} x {k:5d} x{per_step:2d}/step {nbytes / 1e6:7.1f} MB  {kind:6s} "
                  f"{r['us']:7.1f} us {r['tbps']:.2f} TB/s  ({ {x: r[x] for x in r if x in ('per_sm', 'words', 'rows', 'stages')} })",
                  flush=True)
        del bufs
        torch.cuda.empty_cache()
    for kind, v in step.items():
        if v:
            print(f"the step's matrices, read only ({kind}): {v:.3f} ms (the packed matmuls: 7.09 ms at one row)")
    if a.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows, step_ms=step), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
