"""On the GPU machine: the Gated DeltaNet decode kernel's settings (v-columns per program, warps) at
Qwen3.5-27B's sizes (Hk 16, Hv 48, D 128), 48 layers' distinct states (150 MB: not L2-resident, as in a
step), timed as one CUDA graph of the 48 layers' calls for B = 1, 4, 16 rows -> $OUT/sweep_gdn.json and
a pick (the setting with the least total time over the three row counts).
    python3 -u .ci/gpu/sweep_gdn.py"""
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from kernels.gdn.recurrent import gdn_decode  # noqa: E402

Hk, Hv, D, K, LAYERS = 16, 48, 128, 4, 48
C = (2 * Hk + Hv) * D
res = {}
for B in (1, 4, 16):
    gen = torch.Generator(device="cuda").manual_seed(B)
    states = [(torch.randn(C, K, device="cuda", generator=gen) * 0.5,
               torch.randn(B + 1, K - 1, C, device="cuda", generator=gen),
               torch.randn(B + 1, Hv, D, D, device="cuda", generator=gen) * 0.3) for _ in range(LAYERS)]
    proj = torch.randn(B, C + 2 * Hv, device="cuda", generator=gen)
    qkv, ax, bx = proj[:, :C], proj[:, C:C + Hv], proj[:, C + Hv:]
    dt, a = torch.randn(Hv, device="cuda", generator=gen), -torch.rand(Hv, device="cuda", generator=gen)
    slots = torch.arange(B, device="cuda")
    ref = None
    for bv, nw in itertools.product((None, 8, 16, 32, 64, 128), (None, 1, 2, 4, 8)):
        if (bv is None) != (nw is None):
            continue
        kw = {} if bv is None else dict(block_v=bv, num_warps=nw)
        try:
            for w, cs, S in states[:2]:
                gdn_decode(qkv, w, cs.clone(), S.clone(), slots, ax, bx, Hk, D, 1e-6, gate=(dt, a), **kw)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for w, cs, S in states:
                    gdn_decode(qkv, w, cs, S, slots, ax, bx, Hk, D, 1e-6, gate=(dt, a), **kw)
            g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(20):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            us = e0.elapsed_time(e1) * 1e3 / 20 / LAYERS
        except Exception as e:  # (a setting that does not compile: skipped)
            print(f"B={B} {kw}: {type(e).__name__}", flush=True)
            continue
        key = f"{bv}/{nw}"
        res.setdefault(key, {})[B] = us
        print(f"B={B:2d} block_v={bv} warps={nw}: {us:.2f} us per layer", flush=True)
        del g
tot = {k: sum(v.values()) for k, v in res.items() if len(v) == 3}
best = min(tot, key=tot.get)
print("pick", best, res[best], "default", res.get("None/None"), flush=True)
json.dump(dict(results=res, pick=best), open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_gdn.json"), "w"), indent=1)
bv, nw = best.split("/")
json.dump(dict(block_v=None if bv == "None" else int(bv), num_warps=None if nw == "None" else int(nw)),
          open("/tmp/gdn_pick.json", "w"))
