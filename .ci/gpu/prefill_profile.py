"""On the GPU machine: where a 512-token prompt chunk's time goes on the 27B (wall time vs the CUDA time
of its kernels, top kernels), at depth 0 and 23000 -> $OUT/prefill_profile.json (or N tokens cut at
multiples of CHUNK: prefill_profile_N.json; 32 256 is a small prompt chunk's 64-row graph).
    python3 -u .ci/gpu/prefill_profile.py /tmp/m27.gguf [N CHUNK]"""
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from engine.models import open_model  # noqa: E402
from engine.runner import Runner  # noqa: E402

model = open_model(sys.argv[1])
runner = Runner(model, device="cuda", n_slots=1, max_ctx=24000)
V = model.spec.vocab_size
N, CHUNK = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (512, 512)
toks = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(0))
res = {}
for depth in (0, 23000):
    for _ in range(2):
        runner.prefill(0, toks, start=depth, chunk=CHUNK)
    torch.cuda.synchronize()
    walls = []
    for _ in range(3):
        t = time.perf_counter()
        runner.prefill(0, toks, start=depth, chunk=CHUNK)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        runner.prefill(0, toks, start=depth, chunk=CHUNK)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.device_type.name == "CUDA":
            kernels[e.key] = (e.device_time_total / 1e3, e.count)
    cuda_ms = sum(v[0] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    res[depth] = dict(wall_ms=[w * 1e3 for w in walls], cuda_ms=cuda_ms, n_kernels=sum(v[1] for v in kernels.values()),
                      top=[(k[:90], round(ms, 3), n) for k, (ms, n) in top])
    print(f"depth {depth}: wall {min(walls) * 1e3:.1f} ms, kernels {cuda_ms:.1f} ms in "
          f"{res[depth]['n_kernels']} launches", flush=True)
    for k, ms, n in res[depth]["top"][:15]:
        print(f"  {ms:9.3f} ms {n:6d}x  {k}", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefill_profile.json" if N == 512 else f"prefill_profile_{N}.json"), "w"), indent=1)
