"""On the GPU machine: the decode matmul of the 4-bit-plane types (Q4_K ...) as _nibble_mm_kernel (each
byte's two nibbles against the even / odd columns of x, no interleave; optionally the inline-PTX
conversion) against _packed_mm_kernel with tuned_config, on the 27B's Q4_K shapes, M = 1, 4, 16, 64.
Writes $OUT/sweep_nibbles.json and the pick for all shapes to $OUT/nibble_pick.json (and /tmp).
    python3 -u .ci/gpu/sweep_nibbles.py [seconds]"""
import itertools
import json
import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as QT
from triton.testing import do_bench

from kernels.quant.packed import _sm_count, _split_for, pack_weight, packed_matmul, tuned_config

BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 200


def raw_q4k(n, k):
    raw = torch.randint(0, 256, (n * k // 256, 144), dtype=torch.uint8, device="cuda")
    raw.view(torch.int16)[:, :2] = torch.tensor(0.001, dtype=torch.float16).view(torch.int16).item()
    return raw.reshape(-1)


shapes = [(17408, 5120), (5120, 17408), (10240, 5120), (6144, 5120)]
n_sm = _sm_count(0)
grid = [dict(asm=a, num_warps=w, num_stages=st, waves=wv, swap_ab=sw)
        for a, w, st, wv, sw in itertools.product((True, False), (4, 8), (3, 4), (2, 4), (False, True))]


def nib_kw(p, c):
    c = dict(c)
    return dict(block_m=16, nibbles=True, split_k=_split_for(p.n_pad // p.tile_n, p.k // p.tile_k, n_sm,
                                                             c.pop("waves")), **c)


score = [0.0] * len(grid)    # each setting's time summed over the shapes at M = 1 and 16 (None: failed)
results, t_end = [], time.time() + BUDGET
packed_w = {}
for n, k in shapes:
    p = packed_w[n, k] = pack_weight(raw_q4k(n, k), QT.Q4_K, n, k)
    gb = p.nbytes / 1e9
    cfg = tuned_config(p, False, n_sm)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda")
        ref = packed_matmul(x, p, **cfg)
        tuned = gb / do_bench(lambda: packed_matmul(x, p, **cfg), warmup=5, rep=40)
        best = (0.0, None)
        for i, c in enumerate(grid):
            if score[i] is None or time.time() > t_end:
                score[i] = None
                continue
            kw = nib_kw(p, c)
            try:
                out = packed_matmul(x, p, **kw)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                t = do_bench(lambda: packed_matmul(x, p, **kw), warmup=3, rep=20)
            except Exception as e:  # out of resources
                print("fail", c, repr(e)[:200], flush=True)
                score[i] = None
                continue
            if err > 1e-2:
                print("WRONG", c, err, flush=True)
                score[i] = None
                continue
            score[i] += t
            best = max(best, (gb / t, i))
        results.append(dict(n=n, k=k, m=m, tuned_tbps=tuned, best_tbps=best[0],
                            best=grid[best[1]] if best[1] is not None else None))
        print(f"{n}x{k} M={m}: tuned {tuned:.2f} TB/s, best nibble {best[0]:.2f} TB/s "
              f"{grid[best[1]] if best[1] is not None else ''}", flush=True)
ok = [i for i, v in enumerate(score) if v]
pick = grid[min(ok, key=lambda i: score[i])] if ok else None
print("pick", pick, flush=True)
check = []
if pick:
    for (n, k), p in packed_w.items():
        gb = p.nbytes / 1e9
        cfg, kw = tuned_config(p, False, n_sm), nib_kw(p, pick)
        for m in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(m, k, device="cuda")
            a = gb / do_bench(lambda: packed_matmul(x, p, **cfg), warmup=3, rep=20)
            b = gb / do_bench(lambda: packed_matmul(x, p, **kw), warmup=3, rep=20)
            check.append(dict(n=n, k=k, m=m, tuned_tbps=a, pick_tbps=b))
            print(f"pick {n}x{k} M={m}: tuned {a:.2f}, pick {b:.2f} TB/s", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(dict(results=results, grid=grid, score=score, pick=pick, check=check),
          open(os.path.join(out, "sweep_nibbles.json"), "w"), indent=1)
for d in {out, "/tmp"}:
    json.dump(pick, open(os.path.join(d, "nibble_pick.json"), "w"))
