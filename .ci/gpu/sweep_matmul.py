"""On the GPU machine: time packed_matmul configurations on the 27B model's shapes (Q4_K and
Q6_K), decode rows (M = 1, 16) and a prefill chunk (M = 512), and print the best per case.
    python3 .ci/gpu/sweep_matmul.py [seconds]"""
import itertools
import json
import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as QT
from triton.testing import do_bench

from kernels.quant.packed import _default_split_k, pack_weight, packed_matmul

BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 240
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


cases = [(QT.Q4_K, 17408, 5120), (QT.Q4_K, 5120, 17408), (QT.Q4_K, 6144, 5120), (QT.Q6_K, 5120, 17408)]
results = []
n_sm = torch.cuda.get_device_properties(0).multi_processor_count
for qt, n, k in cases:
    p = weight(qt, n, k)
    for m in (1, 16, 512):
        x = torch.randn(m, k, device="cuda")
        base_ms = do_bench(lambda: packed_matmul(x, p), warmup=5, rep=30)
        best = (base_ms, "default")
        if m < 64:
            space = itertools.product((32, 64, 128), (128, 256, 512), (4, 8), (2, 3, 4), (1, 2))
        else:
            space = itertools.product((64, 128), (64, 128), (4, 8), (3, 4), (0,))
        for bn, bk, nw, ns, sk_mult in space:
            if time.time() > t_end:
                break
            kw = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            if m < 64:
                steps = k // bk
                kw["split_k"] = min(steps, _default_split_k(-(-n // bn), steps, n_sm) * sk_mult)
            else:
                kw.update(block_m=bn, split_k=1)
            try:
                ms = do_bench(lambda: packed_matmul(x, p, **kw), warmup=3, rep=15)
            except Exception as e:  # out of resources etc.
                continue
            if ms < best[0]:
                best = (ms, kw)
        tbps = p.nbytes / (best[0] * 1e-3) / 1e12
        tflops = 2 * m * n * k / (best[0] * 1e-3) / 1e12
        results.append(dict(qtype=qt.name, n=n, k=k, m=m, default_ms=base_ms, best_ms=best[0], best=best[1],
                            tbps=tbps, tflops=tflops))
        print(f"{qt.name} {n}x{k} M={m}: default {base_ms:.4f} ms, best {best[0]:.4f} ms ({tbps:.2f} TB/s, "
              f"{tflops:.1f} TFLOP/s) {best[1]}", flush=True)
    if m == 512:
        w16 = torch.randn(n, k, device="cuda", dtype=torch.float16)
        x16 = torch.randn(512, k, device="cuda", dtype=torch.float16)
        ms = do_bench(lambda: x16 @ w16.T, warmup=5, rep=30)
        print(f"   cuBLAS fp16 {n}x{k} M=512: {ms:.4f} ms ({2 * 512 * n * k / ms / 1e9:.1f} TFLOP/s)", flush=True)
    del p
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep.json"), "w"), indent=1)
