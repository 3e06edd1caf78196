"""One decode matrix multiplied a few times with the engine's settings, for Nsight Compute to profile (H200):

    ncu --clock-control none -k regex:_packed_mm --launch-skip 4 --launch-count 1 --section ... \\
        python3 .ci/gpu/ncu_matmul.py Q4_K 34816 5120 [--rows 1] [--maxnreg 128]

(`profile.sh ncu|stalls|source` runs it with the sections that say where the warps wait.)
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "tests/kernels")
from test_packed import _random_weight  # noqa: E402

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kernels.quant.packed import _has_tma, _sm_count, packed_matmul, tuned_config  # noqa: E402
from kernels.quant.packing import pack_weight


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("type")
    ap.add_argument("n", type=int)
    ap.add_argument("k", type=int)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--maxnreg", type=int, default=0)
    ap.add_argument("--x32", action="store_true", help="float32 x (the engine hands x over in fp16)")
    a = ap.parse_args()
    qt = QT[a.type]
    p = pack_weight(_random_weight(qt, a.n, a.k, seed=1).cuda(), qt, a.n, a.k)
    cfg = tuned_config(p, False, _sm_count(0), tma=_has_tma(0))
    if a.maxnreg:
        cfg["maxnreg"] = a.maxnreg
    x = torch.randn(a.rows, a.k, device="cuda", dtype=torch.float32 if a.x32 else torch.float16)
    for _ in range(8):
        packed_matmul(x, p, **cfg)
    torch.cuda.synchronize()
    print(a.type, a.n, a.k, cfg, flush=True)


if __name__ == "__main__":
    main()
