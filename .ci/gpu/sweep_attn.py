"""On the GPU machine: the paged decode attention's launch settings (kernels/attention/paged.py) on the 27B's
attention shape (24 query heads, 4 KV heads, head size 256, blocks of 16), every setting over every case,
timed as the engine runs it: inside a CUDA graph (timed alone, a one-row call measures the host's launch, not
the GPU), over copies of the cache that together exceed the L2, as the runner launches it (64 split-K programs at most per row and KV head, fp16 dots). Cases: one and four
sequences at depth 23,000, one at 131,072, one and sixteen at 4,096. Then the best settings for the float
rows again on the coded cache types, against the settings those use now. K/V are random bytes kept small (no
NaNs); the speed does not depend on them. Prints one JSON line per setting (us per case) and writes
$OUT/sweep_attn.json. --short: contexts of 128 to 4,096 keys (and 23,000 for comparison), the float rows only,
into $OUT/sweep_attn_short.json.
    python3 -u .ci/gpu/sweep_attn.py [seconds] [--short]"""
import itertools
import json
import math
import os
import sys
import time

import torch

import kernels.attention.paged as paged
from kernels.kvcodec import get_codec

sys.path.insert(0, ".ci/gpu")
from sweep_scales import graph_time  # noqa: E402

SHORT = "--short" in sys.argv        # short contexts (a chat's first turns, bench decode at depth 0)
args = [a for a in sys.argv[1:] if a != "--short"]
BUDGET = float(args[0]) if args else 200
H, HKV, D, BS = 24, 4, 256, 16
CASES = [(1, 23000), (4, 23000), (1, 131072), (1, 4096), (16, 4096)]
if SHORT:
    CASES = [(1, 128), (1, 512), (4, 512), (16, 512), (1, 1024), (4, 1024), (16, 1024), (1, 2048), (8, 2048),
             (16, 2048), (1, 4096), (16, 4096), (1, 23000)]
CODED = ("q8_0", "turbo4", "turbo3_tcq")


def make_cache(codec, B, L):
    nblk = B * -(-L // BS)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (nblk, BS, HKV, codec.row_bytes(D))
    k = torch.randint(0, 60, shape, dtype=torch.uint8, device="cuda", generator=g)
    v = torch.randint(0, 60, shape, dtype=torch.uint8, device="cuda", generator=g)
    tables = torch.randperm(nblk, device="cuda", generator=g).view(B, -1).to(torch.int32)
    return k, v, tables


def case_data(name, cases):
    """Per case: enough copies of its K/V to pass 300 MB (each layer of a step reads its own)."""
    codec = get_codec(name)
    out = []
    for B, L in cases:
        n = min(256, max(1, math.ceil(300e6 / (2 * B * L * HKV * codec.row_bytes(D)))))   # (256: past the L2)
        copies = [make_cache(codec, B, L) for _ in range(n)]
        out.append((B, L, codec, copies, torch.randn(B, H, D, device="cuda"),
                    torch.full((B,), L, dtype=torch.int32, device="cuda")))
    return out



def time_setting(data, setting, ref=None):
    """us per case with `setting` (None: a case that failed), and the outputs."""
    us, outs = [], []
    for i, (B, L, codec, copies, q, lens) in enumerate(data):
        paged.decode_config(codec, codec).update(setting)
        def run(kvt):
            k, v, tables = kvt
            return paged.paged_decode_attention(q, k, v, tables, lens, codec, codec, 0.0625, D, n_split=64,
                                                precision="f16")
        try:
            out = run(copies[0])
            if ref is not None:
                err = ((out - ref[i]).abs().max() / ref[i].abs().max()).item()
                if err > 1e-2:
                    raise ValueError(f"error {err}")
            us.append(round(graph_time(run, copies) * 1e6, 1))
            outs.append(out)
        except Exception as e:   # out of registers / shared memory
            print("skip", setting, B, L, type(e).__name__, str(e)[:80], flush=True)
            us.append(None)
            outs.append(None)
    return us, outs


F16 = get_codec("f16")
FLOAT_BASE = dict(paged.decode_config(F16, F16))   # the settings float rows use now
BASE = dict(paged.DECODE_CONFIG)                    # and the coded types
t_end = time.time() + BUDGET
results = dict(cases=CASES, f16=[], coded=[])
data = case_data("f16", CASES)
base_us, ref = time_setting(data, FLOAT_BASE)
results["f16"].append(dict(setting=FLOAT_BASE, us=base_us))
print(json.dumps(results["f16"][-1]), flush=True)
grid = [dict(block_t=bt, num_warps=nw, num_stages=ns, min_keys=mk)
        for bt, nw, ns, mk in itertools.product((16, 32, 64), (4, 8), (1, 2, 3), (64, 256)) if mk >= bt]
if SHORT:   # the short rows' split (short_keys; 0: none), then fewer keys per program for every row, around the
    # float rows' settings
    grid = [dict(short_keys=sk) for sk in (0, 128)] + [
        dict(block_t=bt, num_warps=nw, num_stages=2, min_keys=mk, short_keys=0)
        for bt, nw, mk in itertools.product((32, 64), (4, 8), (32, 64, 128, 256)) if mk >= bt]
for s in grid:
    if time.time() > t_end - 60:
        break
    us, _ = time_setting(data, dict(FLOAT_BASE, **s), ref)
    results["f16"].append(dict(setting=s, us=us))
    print(json.dumps(results["f16"][-1]), flush=True)
paged.decode_config(F16, F16).update(FLOAT_BASE)


def score(r):   # geometric mean of the speed-ups over the base, every case counted alike
    if None in r["us"]:
        return 0.0
    return math.exp(sum(math.log(b / u) for b, u in zip(base_us, r["us"])) / len(base_us))


ranked = sorted(results["f16"][1:], key=score, reverse=True)
for r in ranked[:5]:
    print("top", round(score(r), 3), json.dumps(r), flush=True)
del data
torch.cuda.empty_cache()
# the coded types: their settings now against the three best float-row settings
for name in (() if SHORT else CODED):
    if time.time() > t_end:
        break
    d2 = case_data(name, CASES[:3])
    b2, ref2 = time_setting(d2, BASE)
    results["coded"].append(dict(cache=name, setting=BASE, us=b2))
    print(json.dumps(results["coded"][-1]), flush=True)
    for r in ranked[:3]:
        us, _ = time_setting(d2, dict(BASE, **r["setting"]), ref2)
        results["coded"].append(dict(cache=name, setting=r["setting"], us=us))
        print(json.dumps(results["coded"][-1]), flush=True)
    paged.DECODE_CONFIG.clear()
    paged.DECODE_CONFIG.update(BASE)
    del d2
    torch.cuda.empty_cache()
name = "sweep_attn_short.json" if SHORT else "sweep_attn.json"
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w"), indent=1)
