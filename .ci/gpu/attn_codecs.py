"""On the GPU machine: the paged decode attention per cache type as the engine launches it (decode_config,
64 split-K programs per row and KV head), on the 27B's attention shape (24 query heads, 4 KV heads, head
size 256, blocks of 16), one sequence at depth 23,000 and 131,072 and four at 23,000; then a few other
settings for turbo3_tcq. K/V are random bytes (the speed does not depend on them). Prints one JSON line per
case (us per layer, K/V TB/s) and writes $OUT/attn_codecs.json.
    python3 -u .ci/gpu/attn_codecs.py"""
import json
import os

import torch
from triton.testing import do_bench

import kernels.attention.paged as paged
from kernels.kvcodec import get_codec

H, HKV, D, BS = 24, 4, 256, 16
TYPES = tuple(os.environ.get("ATTN_TYPES", "f16,q8_0,turbo4,turbo3_tcq").split(","))
CASES = [(1, 23000), (4, 23000), (1, 131072)]
BASE = {name: dict(paged.decode_config(get_codec(name), get_codec(name))) for name in TYPES}
TCQ_TRIES = [dict(num_warps=8), dict(block_t=32), dict(num_stages=2), dict(block_t=32, num_warps=8)]


def make_cache(codec, B, L):
    nblk = B * -(-L // BS)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (nblk, BS, HKV, codec.row_bytes(D))
    k = torch.randint(0, 60, shape, dtype=torch.uint8, device="cuda", generator=g)
    v = torch.randint(0, 60, shape, dtype=torch.uint8, device="cuda", generator=g)
    tables = torch.randperm(nblk, device="cuda", generator=g).view(B, -1).to(torch.int32)
    return k, v, tables


results = []
for name in TYPES:
    codec = get_codec(name)
    for B, L in CASES:
        k, v, tables = make_cache(codec, B, L)
        q = torch.randn(B, H, D, device="cuda")
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        gb = 2 * B * L * HKV * codec.row_bytes(D) / 1e9
        tries = [{}] + (TCQ_TRIES if name == "turbo3_tcq" else [])
        for change in tries:
            cfg = paged.decode_config(codec, codec)
            cfg.update(BASE[name], **change)

            def run():
                return paged.paged_decode_attention(q, k, v, tables, lens, codec, codec, 0.0625, D, n_split=64,
                                                    precision=cfg["dot"])
            try:
                run()
                ms = do_bench(run, warmup=5, rep=50)
            except Exception as e:   # out of registers / shared memory
                print("skip", name, B, L, change, type(e).__name__, flush=True)
                continue
            r = dict(cache=name, rows=B, depth=L, change=change, us=round(ms * 1e3, 1), tbps=round(gb / ms, 3))
            results.append(r)
            print(json.dumps(r), flush=True)
        del k, v
        torch.cuda.empty_cache()
        cfg.update(BASE[name])
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_codecs.json"), "w"), indent=1)
