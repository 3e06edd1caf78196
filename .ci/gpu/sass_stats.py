"""The decode matmul (kernels/quant/packed.py: _packed_mm_kernel) compiled for sm_90 on a machine without a
GPU (Triton's own compiler, ptxas and cuobjdump), and what its SASS does per weight value: registers,
shared-memory loads by width, and the integer / fp16 instructions of the inner loop. Run without
TRITON_INTERPRET; no GPU needed.

    python3 .ci/gpu/sass_stats.py [--type Q4_K] [--tile-n 128] [--tile-k 128] [--warps 4] [--stages 3]
                                  [--no-swap] [--sass FILE]
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.quant.packed as packed  # noqa: E402
from kernels.packed_layout import PACKED_LAYOUT, scale_kind  # noqa: E402

PTRS = ("x_ptr", "lo_ptr", "hi_ptr", "s_ptr", "m_ptr", "sup_ptr", "part_ptr", "out_ptr", "add_ptr", "cnt_ptr")
PTR_TYPES = dict(x_ptr="*fp16", lo_ptr="*u8", hi_ptr="*u8", s_ptr="*fp16", m_ptr="*fp16", sup_ptr="*fp16",
                 part_ptr="*fp32", out_ptr="*fp32", add_ptr="*fp32", cnt_ptr="*i32")


def compile_kernel(qtype: str, tile_n: int, tile_k: int, warps: int, stages: int, swap: bool, split: int):
    group, hi_bits, _ = PACKED_LAYOUT[qtype]
    kind = scale_kind(qtype)
    fn = packed._packed_mm_kernel
    const = dict(KT=5120 // tile_k, HI_BITS=hi_bits, GROUP=group, CODES=0, OFFSET=0,
                 HAS_MINV=kind == "f16+min", BLOCK_M=16, BLOCK_N=tile_n, BLOCK_K=tile_k, SWAP_AB=swap,
                 FAST_CVT=True, TMA=False, SPLIT=split, SUM_HERE=split > 1, HAS_ADD=False)
    if qtype in ("Q4_0", "Q5_0", "Q6_K", "Q3_K"):
        const["OFFSET"] = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q3_K": 4}[qtype]
    sig = {n: "constexpr" if n in const else PTR_TYPES.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in PTRS or n == "stride_xm"}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def sass_of(cubin: bytes) -> tuple[str, str]:
    """(the SASS, cuobjdump's resource usage line: registers, shared memory)"""
    nvbin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tool = next(iter(glob.glob(os.path.join(nvbin, "cuobjdump"))), None) or "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        run = lambda flag: subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
        res = [ln.strip() for ln in run("-res-usage").splitlines() if "REG" in ln]
        return run("-sass"), (res[0] if res else "")
    finally:
        os.unlink(f.name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--tile-n", type=int, default=128)
    ap.add_argument("--tile-k", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--split", type=int, default=4)
    ap.add_argument("--no-swap", action="store_true")
    ap.add_argument("--sass", help="write the whole SASS here")
    a = ap.parse_args()
    k = compile_kernel(a.type, a.tile_n, a.tile_k, a.warps, a.stages, not a.no_swap, a.split)
    sass, usage = sass_of(k.asm["cubin"])
    if a.sass:
        open(a.sass, "w").write(sass)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1)] += 1
    per_thread = a.tile_n * a.tile_k // (32 * a.warps)
    print(f"{a.type} tile {a.tile_n}x{a.tile_k}, {a.warps} warps, {a.stages} stages, swap_ab={not a.no_swap}: "
          f"{per_thread} weight values per thread and tile\n  {usage}\n  instructions in the whole kernel "
          "(the pipelined loop body is most of it):")
    for op, n in sorted(ops.items(), key=lambda t: -t[1])[:40]:
        print(f"  {op:24s} {n}")


if __name__ == "__main__":
    main()
