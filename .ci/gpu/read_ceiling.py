"""How fast one launch can merely read a decode matrix's bytes (H200): the ceiling of any one-launch-per-matrix
decode matmul, beside the packed matmul's own time on the same machine. For each matrix a 27B decode step
multiplies (matmul_shapes.decode_configs: the model's packed weights, stacks as one), buffers of its bytes past
the L2 are read back to back in one CUDA graph (PDL on, as the engine launches) by
  - a Triton kernel: P programs (a whole number per SM), each XOR-ing a contiguous run of blocks of WORDS int32
    (the loop software-pipelined to STAGES loads in flight), one word out per program;
  - a Gluon kernel (--gluon): the same runs, each program's blocks brought into a ring of shared-memory buffers
    by TMA from a one-warp loader partition (warp specialization) while four warps XOR them: the bytes in
    flight per SM no longer wait on the compute warps' progress. It launches without PDL.
and the packed matmul with the engine's settings at one row is timed the same way (matmul_shapes.py's timing).
Prints, per matrix, the matmul and each reader's best time with its settings (settings whose whole blocks cover
under 90 % of a matrix are skipped; the time is scaled to all its bytes), and the step's sums (each matrix times
its count per step).

    python3 -u .ci/gpu/read_ceiling.py /tmp/m27.gguf [--gluon] [--json OUT]
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
from kernels.pdl import pdl_args, pdl_trigger, pdl_wait  # noqa: E402
from kernels.quant.packed import packed_matmul  # noqa: E402
from matmul_shapes import decode_configs  # noqa: E402
from sweep_scales import clones, graph_time  # noqa: E402

_fix_interpreter()   # (a runtime loop bound, for a check under TRITON_INTERPRET)

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
    per = gluon_rows(buf, programs, rows)
    t = buf[:per * programs * 64].view(-1, 64)          # the rows read, 256 bytes each
    layout = gl.NVMMASharedLayout.get_default_for([rows, 64], gl.int32)
    desc = TensorDescriptor.from_tensor(t, [rows, 64], layout)
    _ws_read_kernel[(programs,)](desc, out, per, NB=stages, num_warps=4, maxnreg=128)


def readers(bufs: list, out: torch.Tensor, n_sm: int, gluon_too: bool):
    """(kind, settings, bytes read per call, fn(buf)) for each reader setting, all reading bufs[0]'s size."""
    for per_sm, words, stages in itertools.product((4, 8, 16), (1024, 2048), (3, 6)):
        progs = per_sm * n_sm
        yield ("triton", dict(per_sm=per_sm, words=words, stages=stages), 4 * triton_words(bufs[0], progs, words),
               lambda b, progs=progs, words=words, stages=stages: triton_read(b, out, progs, words, stages))
    if gluon_too:
        for per_sm, rows, stages in itertools.product((1, 2, 4), (16, 32), (4, 8)):
            progs = per_sm * n_sm
            yield ("gluon", dict(per_sm=per_sm, rows=rows, stages=stages), 256 * progs * gluon_rows(bufs[0], progs, rows),
                   lambda b, progs=progs, rows=rows, stages=stages: gluon_read(b, out, progs, rows, stages))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gluon", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.gluon and gluon is None:
        raise SystemExit("this Triton has no Gluon")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(16 * n_sm, dtype=torch.int32, device="cuda")     # (one word per program, at most 16 per SM)
    rows, step = [], {}
    for key, p, per_step, cfg in decode_configs(a.model):
        nbytes = p.nbytes
        x = torch.randn(1, p.k, device="cuda", dtype=torch.float16)
        ws = clones(p)
        best = {"matmul": dict(settings=dict(split_k=cfg["split_k"]),
                               us=graph_time(lambda w: packed_matmul(x, w, **cfg), ws) * 1e6)}
        # as many buffers of its bytes as the weight's copies (past the L2 alike)
        bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in ws]
        del ws
        for kind, settings, read, fn in readers(bufs, out, n_sm, a.gluon):
            if read < 0.9 * nbytes:      # (blocks too coarse for this size)
                continue
            try:
                t = graph_time(fn, bufs)
            except Exception as e:   # (a setting that does not fit shared memory or registers)
                print(f"  {kind} {settings}: {type(e).__name__} {str(e)[:100]}")
                continue
            r = dict(type=key[0], n=key[1], k=key[2], mb=nbytes / 1e6, kind=kind, settings=settings,
                     read_mb=read / 1e6, us=t * 1e6 * nbytes / read, tbps=read / t / 1e12)
            rows.append(r)
            if kind not in best or r["us"] < best[kind]["us"]:
                best[kind] = r
        rows.append(dict(type=key[0], n=key[1], k=key[2], mb=nbytes / 1e6, kind="matmul", **best["matmul"]))
        for kind, r in best.items():
            step[kind] = step.get(kind, 0.0) + per_step * r["us"] / 1e3
            print(f"{key[0]} {key[1]:6d} x {key[2]:5d} x{per_step:2d}/step {nbytes / 1e6:7.1f} MB  {kind:6s} "
                  f"{r['us']:7.1f} us {nbytes / r['us'] / 1e6:.2f} TB/s  {r['settings']}", flush=True)
        del bufs
        torch.cuda.empty_cache()
    for kind, v in step.items():
        print(f"the step's matrices, {kind}: {v:.3f} ms")
    if a.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows, step_ms=step), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
