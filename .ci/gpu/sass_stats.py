"""The decode matmul (kernels/quant/packed.py: _packed_mm_kernel) compiled for sm_90 on a machine without a
GPU (Triton's own compiler, ptxas and cuobjdump), and what its SASS does per weight value: registers,
shared-memory loads by width, and the integer / fp16 instructions of the inner loop. Run without
TRITON_INTERPRET; no GPU needed.

    python3 .ci/gpu/sass_stats.py [--type Q4_K] [--tile-n 128] [--tile-k 128] [--warps 4] [--stages 3]
                                  [--no-swap] [--block-m 16] [--sass FILE]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.pop("TRITON_INTERPRET", None)

from tests.kernels.sm90 import compile_decode_matmul, resource_usage, sass_of  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--tile-n", type=int, default=128)
    ap.add_argument("--tile-k", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--split", type=int, default=4)
    ap.add_argument("--no-swap", action="store_true")
    ap.add_argument("--block-m", type=int, default=16, help="rows of x per program (wide_decode_rows: up to 64)")
    ap.add_argument("--sass", help="write the whole SASS here")
    a = ap.parse_args()
    kern = compile_decode_matmul(a.type, a.tile_n, a.tile_k, num_warps=a.warps, num_stages=a.stages,
                                 swap_ab=not a.no_swap, split=a.split, block_m=a.block_m)
    sass = sass_of(kern.asm["cubin"])
    usage = " ".join(f"{k}:{v}" for k, v in resource_usage(kern.asm["cubin"]).items())
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
