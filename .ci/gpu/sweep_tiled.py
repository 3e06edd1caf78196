"""On the GPU machine: the decode matmul's settings on the tiled layout, the 27B's Q4_K / Q6_K shapes, M = 1
and 16: tile rows (32 / 64 / 128; packed again for each), warps, pipeline stages, split-K (programs per
SM), SWAP_AB. Prints the best per case beside `tuned_config`'s, writes $OUT/sweep_tiled.json.
    python3 -u .ci/gpu/sweep_tiled.py [seconds]"""
import itertools
import json
import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as QT
from triton.testing import do_bench

from kernels.quant.packed import _sm_count, _split_for, pack_weight, packed_matmul, tuned_config

BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 240
SIZES = {QT.Q4_K: (144, 256), QT.Q6_K: (210, 256)}


def raw_weight(qt, n, k):
    bs, nb = SIZES[qt]
    raw = torch.randint(0, 256, (n * k // nb * bs,), dtype=torch.uint8, device="cuda").view(-1, bs)
    half = torch.tensor(0.001, dtype=torch.float16, device="cuda").view(torch.int16)
    if qt == QT.Q4_K:
        raw.view(torch.int16)[:, :2] = half
    else:
        raw[:, 208:210].view(torch.int16)[:] = half
    return raw.reshape(-1)


cases = [(QT.Q4_K, 17408, 5120), (QT.Q4_K, 5120, 17408), (QT.Q4_K, 6144, 5120), (QT.Q6_K, 5120, 17408)]
n_sm = _sm_count(0)
t_end = time.time() + BUDGET
results = []
for qt, n, k in cases:
    raw = raw_weight(qt, n, k)
    base = pack_weight(raw, qt, n, k)
    cfg = tuned_config(base, False, n_sm)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda")
        ref_ms = do_bench(lambda: packed_matmul(x, base, **cfg), warmup=5, rep=30)
        best = (ref_ms, dict(tile_n=base.tile_n, **cfg))
        for tn in (32, 64, 128):
            p = base if tn == base.tile_n else pack_weight(raw, qt, n, k, tile_n=tn)
            for nw, ns, waves, swap in itertools.product((4, 8), (2, 3, 4), (1, 2, 4, 8), (False, True)):
                if time.time() > t_end:
                    break
                kw = dict(block_m=16, num_warps=nw, num_stages=ns, swap_ab=swap,
                          split_k=_split_for(p.n_pad // p.tile_n, p.k // p.tile_k, n_sm, waves))
                try:
                    ms = do_bench(lambda: packed_matmul(x, p, **kw), warmup=3, rep=15)
                except Exception:   # out of shared memory / registers
                    continue
                if ms < best[0]:
                    best = (ms, dict(tile_n=tn, **kw))
            if p is not base:
                del p
        gb = base.nbytes / 1e9
        results.append(dict(qtype=qt.name, n=n, k=k, m=m, tuned_ms=ref_ms, tuned_tbps=gb / ref_ms,
                            best_ms=best[0], best_tbps=gb / best[0], best=best[1]))
        print(f"{qt.name} {n}x{k} M={m}: tuned {gb / ref_ms:.2f} TB/s, best {gb / best[0]:.2f} TB/s {best[1]}",
              flush=True)
    del base, raw
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep_tiled.json"), "w"), indent=1)
