"""On the GPU machine: the decode matmul (M = 1, 16) with and without SWAP_AB on the 27B's shapes.
    python3 .ci/gpu/sweep_swap.py [seconds]"""
import itertools
import json
import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as QT
from triton.testing import do_bench

from kernels.quant.packed import _sm_count, _split_for, pack_weight, packed_matmul, tuned_config

BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 100
t_end = time.time() + BUDGET
SIZES = {QT.Q4_K: (144, 256), QT.Q6_K: (210, 256)}


def weight(qt, n, k):
    bs, nb = SIZES[qt]
    raw = torch.randint(0, 256, (n * k // nb * bs,), dtype=torch.uint8, device="cuda").view(-1, bs)
    half = torch.tensor(0.001, dtype=torch.float16, device="cuda").view(torch.int16)
    if qt == QT.Q4_K:
        raw.view(torch.int16)[:, :2] = half
    else:
        raw[:, 208:210].view(torch.int16)[:] = half
    return pack_weight(raw.reshape(-1), qt, n, k)


n_sm = _sm_count(0)
out = []
for qt, n, k in [(QT.Q4_K, 17408, 5120), (QT.Q4_K, 5120, 17408), (QT.Q4_K, 6144, 5120), (QT.Q6_K, 5120, 17408),
                 (QT.Q6_K, 248320, 5120)]:
    p = weight(qt, n, k)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda")
        cfg = tuned_config(p, False, n_sm)
        cfg.pop("block_m")
        t0 = do_bench(lambda: packed_matmul(x, p, **cfg), warmup=5, rep=30)
        best = (t0, "tuned")
        for bn, bk, nw, ns, waves in itertools.product((64, 128), (128, 256), (4, 8), (2, 3, 4), (2, 4)):
            if time.time() > t_end:
                break
            steps = k // bk
            kw = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, swap_ab=True,
                      split_k=_split_for(-(-n // bn), steps, n_sm, waves))
            try:
                ms = do_bench(lambda: packed_matmul(x, p, **kw), warmup=3, rep=15)
            except Exception:
                continue
            if ms < best[0]:
                best = (ms, kw)
        r = dict(qtype=qt.name, n=n, k=k, m=m, tuned_ms=t0, tuned_tbps=p.nbytes / t0 / 1e9, best_ms=best[0],
                 best_tbps=p.nbytes / best[0] / 1e9, best=best[1])
        out.append(r)
        print(r, flush=True)
    del p
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_swap.json"), "w"), indent=1)
