"""The decode matmul with shorter tiles along K, on the 27B's shapes (H200). Compiled for sm_90 on the CPU
machine, the Q4_K decode kernel on 128 x 256-value tiles (the weight tile as the dot's first operand) needs 221 registers per thread: the whole dequantized fp16 tile is the wgmma's register operand,
so only two 4-warp programs fit an SM. Tiles of 128 values need 139 registers, of 64 values 80. Shorter
tiles cannot take their scales by TMA (a box row is at least 16 bytes), so they run with per-thread loads.
Each weight is cloned past the L2 and its matmuls timed in one CUDA graph (sweep_scales.py's time_it),
M = 1 and 16; every variant's output is checked against the engine's.
--hi: the weights with a high plane (Q6_K, the 27B's ffn_down of some layers and its output matrix) at
128-value tiles, warps x stages x swap_ab (how their settings were chosen).
--q4: the same settings for the Q4_K shapes (the 4-bit plane in fragment order).
--split: the engine's settings with other split-K counts and 64 / 128 / 256-row tiles.
--warps: 4 or 8 warps per program x 2-4 stages at 64- and 128-row tiles (the matmuls run
about 3.2-3.6 G values per ms whatever their bytes per value, so bound by the instructions per value and
the warps an SM holds to hide their latency, 12 at 140 registers).

--stages: the engine's settings with 2, 3 or 4 pipeline stages on every decode matrix of the 27B
(--warps found Q4_K 5120x17408 at 64-row tiles 8 % faster with 4 stages than with 3).

    python3 -u .ci/gpu/sweep_tile_k.py [--hi | --q4 | --split | --warps | --stages] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".ci/gpu")
from sweep_scales import clones, time_case  # noqa: E402
from test_packed import _random_weight  # noqa: E402

from kernels.quant.packed import _has_tma, _sm_count, packed_matmul, tuned_config  # noqa: E402
from kernels.quant.packing import pack_weight
from gguf import GGMLQuantizationType as QT  # noqa: E402

SHAPES = [("Q4_K", 34816, 5120), ("Q4_K", 5120, 17408), ("Q6_K", 5120, 17408)]
SETTINGS = [dict(swap_ab=s, num_stages=st) for s in (True, False) for st in (2, 3)]
HI_SHAPES = [("Q6_K", 5120, 17408), ("Q6_K", 248320, 5120)]
HI_SETTINGS = [dict(swap_ab=s, num_stages=st, num_warps=w) for s in (True, False) for st in (3, 4) for w in (4,)]
# the 27B's decode matrices (sweep_pdl.py's, without the 248320-row output matrix)
ALL_SHAPES = [("Q4_K", 34816, 5120), ("Q6_K", 5120, 17408), ("Q4_K", 5120, 17408), ("Q4_K", 16512, 5120),
              ("Q4_K", 5120, 6144), ("Q6_K", 10240, 5120), ("Q4_K", 6272, 5120), ("Q4_K", 14336, 5120),
              ("Q6_K", 1024, 5120)]
WARP_SETTINGS = [dict(num_warps=w, num_stages=st) for w in (4, 8) for st in (2, 3, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--hi", action="store_true", help="the high-plane weights' settings at 128-value tiles")
    ap.add_argument("--q4", action="store_true", help="those settings for the Q4_K shapes")
    ap.add_argument("--split", action="store_true", help="split-K counts and tile rows")
    ap.add_argument("--warps", action="store_true", help="warps and stages at 64- and 128-row tiles")
    ap.add_argument("--stages", action="store_true", help="2-4 stages on every decode matrix of the 27B")
    args = ap.parse_args()
    shapes, settings, tiles = (HI_SHAPES, HI_SETTINGS, (128,)) if args.hi else (SHAPES, SETTINGS, (128, 64))
    if args.q4:
        shapes, settings, tiles = SHAPES[:2], HI_SETTINGS, (128,)
    if args.stages:
        shapes = ALL_SHAPES
    n_sm, tma = _sm_count(0), _has_tma(0)
    rows = []
    for qt, n, k in shapes:
        raw = _random_weight(QT[qt], n, k, seed=1).cuda()
        base = pack_weight(raw, QT[qt], n, k)
        cfg0 = tuned_config(base, False, n_sm, tma=tma)
        xs = {m: torch.randn(m, k, device="cuda") for m in (1, 16)}
        ref = {m: packed_matmul(xs[m], base, **cfg0) for m in (1, 16)}
        cases = [("engine", base, cfg0)]
        for st in (2, 3, 4) if args.stages else ():
            cases.append((f"engine, {st} stages", base, dict(cfg0, num_stages=st)))
        # the previous default, 256-value tiles: by TMA on sm_90 for 128-row or coded-scale tiles; 64-row ones
        # with fp16 scales keep the tile in registers
        if base.tile_k != 256 and not args.stages:
            p = pack_weight(raw, QT[qt], n, k, tile_k=256)
            cases.append(("tile_k 256", p, tuned_config(p, False, n_sm, tma=tma)))
        for tn in (64, 128, 256) if args.split else ():
            p = pack_weight(raw, QT[qt], n, k, tile_n=tn)
            c = tuned_config(p, False, n_sm, tma=False)
            kt = k // p.tile_k
            for sp in sorted({d for d in (1, 2, 4, 5, 8, 10, 17, 20, 34, 40) if kt % d == 0} | {c["split_k"]}):
                cases.append((f"tile_n {tn} split {sp}" + (" (its own)" if sp == c["split_k"] else ""),
                              p, dict(c, split_k=sp)))
        for tn in (64, 128) if args.warps else ():
            p = pack_weight(raw, QT[qt], n, k, tile_n=tn)
            c = tuned_config(p, False, n_sm, tma=False)
            for st in WARP_SETTINGS:
                cases.append((f"tile_n {tn} {st}", p, dict(c, **st)))
        for tk in () if args.split or args.warps or args.stages else tiles:
            p = pack_weight(raw, QT[qt], n, k, tile_k=tk)
            c = tuned_config(p, False, n_sm, tma=False)
            for s in settings:
                cases.append((f"tile_k {tk} {s}", p, dict(c, **s)))
        for name, p, cfg in cases:
            ws = clones(p)
            rows += time_case(f"{qt} {n}x{k} {name:45s}", p, ws, xs, ref, cfg, type=qt, n=n, k=k, variant=name)
            del ws
            torch.cuda.empty_cache()
    if args.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
