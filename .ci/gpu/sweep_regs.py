"""The decode matmul with a cap on its registers per thread (ptxas's .maxnreg through Triton's `maxnreg`), on
every decode matrix of the 27B (H200). Compiled for sm_90 on the CPU machine, the Q4_K kernel takes 138
registers at 128-row tiles (3 programs of 4 warps per SM) and 87 at 64-row tiles (5 programs); capped at
128 the first needs no spill (4 programs per SM). Nsight Compute found
the kernel latency-bound (0.83 eligible warps per scheduler), so more resident warps is what a cap buys.
Each cap is timed with the engine's split-K and with a split sized for the programs the cap lets an SM
hold (two waves); every variant's output is checked against the engine's (the same bits: a register cap
changes no arithmetic).

    python3 -u .ci/gpu/sweep_regs.py [--json OUT] [--shapes N]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".ci/gpu")
sys.path.insert(0, "tests/kernels")
from sweep_scales import clones, time_case  # noqa: E402
from sweep_tile_k import ALL_SHAPES  # noqa: E402
from test_packed import _random_weight  # noqa: E402

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kernels.quant.packed import _has_tma, _sm_count, _split_for, packed_matmul, tuned_config  # noqa: E402
from kernels.quant.packing import pack_weight

# register caps worth trying per tile rows, as (programs of 128 threads an SM then holds, the most registers
# per thread that allows; registers are given out 8 per thread at a time). Uncapped, Q4_K holds 3 programs
# at 128-row tiles and 5 at 64-row tiles.
CAPS = {128: ((4, 128), (5, 96)), 64: ((6, 80), (7, 72), (8, 64))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", type=int, default=len(ALL_SHAPES), help="only the first N shapes")
    args = ap.parse_args()
    n_sm, tma = _sm_count(0), _has_tma(0)
    rows = []
    for qt, n, k in ALL_SHAPES[:args.shapes]:
        raw = _random_weight(QT[qt], n, k, seed=1).cuda()
        p0 = pack_weight(raw, QT[qt], n, k)
        cfg0 = tuned_config(p0, False, n_sm, tma=tma)
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.float16) for m in (1, 16)}
        ref = {m: packed_matmul(xs[m], p0, **cfg0) for m in (1, 16)}
        cases = [("engine", p0, cfg0)]
        # the 128-row shapes also at 64-row tiles (5 programs per SM uncapped, up to 8 capped)
        for p in (p0, pack_weight(raw, QT[qt], n, k, tile_n=64)) if p0.tile_n >= 128 else (p0,):
            c = tuned_config(p, False, n_sm, tma=tma)
            if p is not p0:
                cases.append(("tile_n 64", p, c))
            for progs, cap in CAPS[p.tile_n]:
                tag = f"tile_n {p.tile_n} maxnreg {cap}"
                cases.append((tag, p, dict(c, maxnreg=cap)))
                split = _split_for(p.n_pad // p.tile_n, p.k // p.tile_k, n_sm, 2 * progs)
                if split != c["split_k"]:
                    cases.append((f"{tag} split {split}", p, dict(c, maxnreg=cap, split_k=split)))
        clone_sets = {}
        for name, p, cfg in cases:
            ws = clone_sets.setdefault(p.tile_n, clones(p))
            rows += time_case(f"{qt} {n}x{k} {name:32s} (split {cfg['split_k']:2d})", p, ws, xs, ref, cfg, type=qt,
                              n=n, k=k, tile_n=p.tile_n, variant=name, split=cfg["split_k"])
        del clone_sets
        torch.cuda.empty_cache()
        if args.json:
            json.dump(dict(device=torch.cuda.get_device_name(0), results=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
