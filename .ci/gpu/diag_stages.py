"""Where the decode matmul's time goes, stage by stage, on the 27B's Q4_K / Q6_K shapes (H200): the same
grid, tiles and TMA loads as the engine's decode matmul (`tuned_config`), with the work after the loads cut
short. Kernels (one program per row band and k-slice, its tiles in order, one number written per program):
  load     the tile's planes, scales and mins loaded, their bytes summed (nothing converted)
  dequant  the tile dequantized to fp16 (`_dequant_tile`), summed
  dot      the full kernel (`packed_matmul` with the engine's settings), one row of x
Each weight is cloned past the 50 MB L2 several times over; one CUDA graph runs the copies one after the
other, its replays timed by CUDA events: microseconds per weight and TB/s of its bytes. Against these, the
card's copy bandwidth (torch, read + write) is printed first.

    python3 -u .ci/gpu/diag_stages.py [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".ci/gpu")
sys.path.insert(0, "tests/kernels")
from sweep_scales import clones, graph_time  # noqa: E402
from test_packed import _random_weight  # noqa: E402

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kernels.quant.packed import (  # noqa: E402
    _descriptors, _dequant_tile, _has_tma, _sm_count, pack_weight, packed_matmul, tuned_config,
)

SHAPES = [("Q4_K", 34816, 5120), ("Q4_K", 5120, 17408), ("Q6_K", 5120, 17408), ("Q6_K", 248320, 5120)]


@triton.jit
def _stage_kernel(lo_ptr, hi_ptr, s_ptr, m_ptr, out_ptr, TILES, KT: tl.constexpr, HI_BITS: tl.constexpr,
                  GROUP: tl.constexpr, OFFSET: tl.constexpr, HAS_MINV: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DEQUANT: tl.constexpr):
    band, pid_k = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    G: tl.constexpr = BLOCK_K // GROUP
    for t in range(0, TILES):
        tile = band.to(tl.int64) * KT + pid_k * TILES + t
        if DEQUANT:
            w = _dequant_tile(lo_ptr, hi_ptr, s_ptr, m_ptr, s_ptr, tile, HI_BITS, GROUP, 0, OFFSET, HAS_MINV,
                              BLOCK_N, BLOCK_K, True, True)
            acc += tl.sum(w.to(tl.float32), axis=1)
        else:
            b = lo_ptr.load([(tile * BLOCK_N).to(tl.int32), 0])
            acc += tl.sum(b.to(tl.float32), axis=1)
            if HI_BITS > 0:
                h = hi_ptr.load([(tile * BLOCK_N).to(tl.int32), 0])
                acc += tl.sum(h.to(tl.float32), axis=1)
            s = s_ptr.load([(tile * BLOCK_N).to(tl.int32), 0])
            acc += tl.sum(s.to(tl.float32), axis=1)
            if HAS_MINV:
                mv = m_ptr.load([(tile * BLOCK_N).to(tl.int32), 0])
                acc += tl.sum(mv.to(tl.float32), axis=1)
    tl.store(out_ptr + (band * tl.num_programs(1) + pid_k) * BLOCK_N + tl.arange(0, BLOCK_N), acc)


def run_stage(p, cfg, dequant: bool, out: torch.Tensor):
    lo, hi, sc, mn, _ = _descriptors(p)
    bands, kt = p.n_pad // p.tile_n, p.k // p.tile_k
    split = cfg["split_k"]
    _stage_kernel[(bands, split)](lo, hi, sc, mn, out, kt // split, KT=kt, HI_BITS=p.hi_bits, GROUP=p.group,
                                  OFFSET=p.offset, HAS_MINV=p.minv is not None, BLOCK_N=p.tile_n,
                                  BLOCK_K=p.tile_k, DEQUANT=dequant, num_warps=cfg["num_warps"],
                                  num_stages=cfg["num_stages"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        dst.copy_(src)
    b.record()
    torch.cuda.synchronize()
    copy_tbps = 2 * src.numel() * 5 / (a.elapsed_time(b) * 1e-3) / 1e12
    del src, dst
    print(f"copy bandwidth (read + write): {copy_tbps:.2f} TB/s", flush=True)
    n_sm, tma = _sm_count(0), _has_tma(0)
    rows = []
    for qt, n, k in SHAPES:
        p = pack_weight(_random_weight(QT[qt], n, k, seed=1).cuda(), QT[qt], n, k)
        cfg = tuned_config(p, False, n_sm, tma=tma)
        ws = clones(p)
        out = torch.empty((p.n_pad // p.tile_n) * cfg["split_k"] * p.tile_n, device="cuda")
        x = torch.randn(1, k, device="cuda")
        for stage, fn in (("load", lambda w: run_stage(w, cfg, False, out)),
                          ("dequant", lambda w: run_stage(w, cfg, True, out)),
                          ("dot", lambda w: packed_matmul(x, w, **cfg))):
            t = graph_time(fn, ws)
            r = dict(type=qt, n=n, k=k, stage=stage, us=t * 1e6, tbps=p.nbytes / t / 1e12, split=cfg["split_k"],
                     programs=(p.n_pad // p.tile_n) * cfg["split_k"])
            rows.append(r)
            print(f"{qt} {n}x{k} {stage:8s} {r['us']:8.1f} us  {r['tbps']:.2f} TB/s  ({r['programs']} programs)",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), copy_tbps=copy_tbps, results=rows),
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
