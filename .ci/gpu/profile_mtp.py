"""Where the MTP block's time goes on the GPU path (issue #7): one catch-up after a verify step of k
accepted drafts (k + 1 rows, k - 1 chained drafts), as engine/bench_spec.py's mtp_costs times it, under
torch.profiler: CUDA time per kernel and the host's time. Usage: profile_mtp.py MODEL.gguf [k]."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.kv.pool import KVPool
from engine.models import open_model
from engine.runner import Runner
from engine.spec.mtp import CatchUp, MtpState, catch_up

model, k = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
pos = 256
m = open_model(model)
dev = torch.device("cuda")
r = Runner(m, device=dev, n_slots=1, max_ctx=pos + 32)
toks = [1 + (7 * j) % 100 for j in range(pos + 8)]
r.prefill(0, toks[:pos + 6], hidden=True)
hid = r.hidden.clone()
st = MtpState(m.new_mtp_kv(pool=KVPool(block_size=16, device=dev)))
catch_up(m, [CatchUp(st, toks[:pos + 1], 0, hid[:pos], pos, 0)])


def step():
    st.valid = pos + 1
    catch_up(m, [CatchUp(st, toks[:pos + k + 2], pos, hid[pos:pos + k + 1], k + 1, k)])


for _ in range(3):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(10):
    step()
torch.cuda.synchronize()
print(f"k={k}: {(time.perf_counter() - t0) / 10 * 1e3:.2f} ms per catch-up")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
