"""The decode matmul's split-K and pipeline stages again, after the eighteenth session's changes (planes read
without bank conflicts, fp16 x, 128-row tiles capped at 128 registers so four programs share an SM), on the
27B's largest decode matrices (H200): each shape's engine settings against other split counts and 3 / 4
stages, timed like sweep_tile_k.py (clones past the L2, one CUDA graph, fp16 x at 1 and 16 rows); every
variant checked against the engine's output.

    python3 -u .ci/gpu/sweep_split_stages.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".ci/gpu")
sys.path.insert(0, "tests/kernels")
from sweep_scales import clones, time_case  # noqa: E402
from test_packed import _random_weight  # noqa: E402

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kernels.quant.packed import _has_tma, _sm_count, pack_weight, packed_matmul, tuned_config  # noqa: E402

SHAPES = [("Q4_K", 34816, 5120), ("Q6_K", 5120, 17408), ("Q4_K", 5120, 17408), ("Q4_K", 5120, 6144)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    n_sm, tma = _sm_count(0), _has_tma(0)
    rows = []
    for qt, n, k in SHAPES:
        p = pack_weight(_random_weight(QT[qt], n, k, seed=1).cuda(), QT[qt], n, k)
        cfg0 = tuned_config(p, False, n_sm, tma=tma)
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.float16) for m in (1, 16)}
        ref = {m: packed_matmul(xs[m], p, **cfg0) for m in (1, 16)}
        kt = k // p.tile_k
        splits = sorted({s for s in (2, 4, 5, 8, 10, 16) if kt % s == 0 and s != cfg0["split_k"]})
        cases = [("engine", cfg0)]
        cases += [(f"stages {st}", dict(cfg0, num_stages=st)) for st in (3, 4) if st != cfg0["num_stages"]]
        cases += [(f"split {s}", dict(cfg0, split_k=s)) for s in splits]
        ws = clones(p)
        for name, cfg in cases:
            label = f"{qt} {n}x{k} {name:12s} (split {cfg['split_k']:2d}, {cfg['num_stages']} stages)"
            rows += time_case(label, p, ws, xs, ref, cfg, type=qt, n=n, k=k, variant=name, split=cfg["split_k"],
                              stages=cfg["num_stages"])
        del ws
        torch.cuda.empty_cache()
        if args.json:
            json.dump(dict(device=torch.cuda.get_device_name(0), results=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
