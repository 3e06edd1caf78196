"""Where a DFlash drafter's time goes on the GPU path (issue #7): engine/bench_spec.py's dflash_costs (a
random 5-layer drafter on the target's layers), then one more step under torch.profiler.
Usage: profile_dflash.py MODEL.gguf"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from engine import bench_spec
from engine.spec import dflash

model = sys.argv[1]
print(bench_spec.dflash_costs(model, "cuda", reps=5))
real_propose = dflash.propose
prof_box = {}


def profiled(*a, **kw):   # (dflash_costs' warm-up step runs first, then the timed ones: profile the last)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        real_propose(*a, **kw)
        torch.cuda.synchronize()
    prof_box["p"] = prof


dflash.propose = profiled
print(bench_spec.dflash_costs(model, "cuda", reps=1))
p = prof_box["p"]
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50))
