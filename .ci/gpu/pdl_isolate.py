"""On the GPU machine: which part of PDL makes the packed matmul's result change from run to run? A 27B prefill
(prefill_repeat.py under HIVEJET_PDL_KERNELS) was reproducible with PDL on for the small kernels only and not with it on for
the matmul only, the first difference in layer 0's gate+up partial sums (a 34816 x 5120 Q4_K stack, a 32-token
prompt's small-prompt settings). Here that one matmul alone, after an rms_norm each time as in the model, run many
times against its first result, with the kernel compiled with its PDL code or not, launched with the PDL attribute
or not, with and without the L2 prefetch before the wait, and at decode rows too.
Then (`configs`) the kernel's settings varied, each with its PDL code and prefetch against without: which
settings break, and whether the runs that agree also agree with the kernel without PDL.
    python3 -u .ci/gpu/pdl_isolate.py [REPEATS] [configs] -> $OUT/pdl_isolate.json"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import kernels.quant.packed as packed  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from kernels.fused import rms_norm  # noqa: E402
from tests.kernels.test_packed import _random_weight  # noqa: E402

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
N, K = 34816, 5120
p = packed.pack_weight(_random_weight(QT.Q4_K, N, K).cuda(), QT.Q4_K, N, K)
w_norm = torch.rand(K, device="cuda") + 0.5
gen = torch.Generator(device="cuda").manual_seed(0)
MODES = {   # label: (what pdl_args gives the matmul, PREFETCH_TILES)
    "off": ({}, 1),
    "code_only": (dict(PDL=1, launch_pdl=False), 1),
    "code_only_pf0": (dict(PDL=1, launch_pdl=False), 0),
    "attr": (dict(PDL=1, launch_pdl=True), 1),
    "attr_pf0": (dict(PDL=1, launch_pdl=True), 0),
    "attr_wait_first": (dict(PDL=2, launch_pdl=True), 1),
}
res = dict(device=torch.cuda.get_device_name(), shape=[N, K], tile=[p.tile_n, p.tile_k])
CONFIGS = {   # label: packed_matmul's settings (the small prompt's: block_m 64, 4 warps, 3 stages, swap_ab, split 4)
    "bm64": dict(block_m=64),
    "bm64_sumhere": dict(block_m=64, partials=False),
    "bm64_split1": dict(block_m=64, split_k=1, partials=False),
    "bm64_stages2": dict(block_m=64, num_stages=2),
    "bm64_stages4": dict(block_m=64, num_stages=4),
    "bm64_warps8": dict(block_m=64, num_warps=8),
    "bm64_noswap": dict(block_m=64, swap_ab=False),
    "bm32": dict(block_m=32),
    "bm16": dict(block_m=16),
    "bm16_reg128": dict(block_m=16, maxnreg=128),
}
if "configs" in sys.argv[2:]:
    x = torch.randn(32, K, device="cuda", generator=gen)
    h = rms_norm(x, w_norm, 1e-6, torch.float16)
    for label, over in CONFIGS.items():
        kw = dict(dict(num_warps=4, num_stages=3, swap_ab=True, split_k=4, partials=True), **over)
        runs = {}
        for mode, args in (("off", {}), ("code", dict(PDL=1, launch_pdl=False))):
            packed.pdl_args = lambda t, matmul=False, a=args: dict(a)
            packed.prefetch_tiles = lambda block_m: 1    # (the prefetch in every block size, as before the fix)
            outs = []
            for _ in range(REPEATS):
                h2 = rms_norm(x, w_norm, 1e-6, torch.float16)
                outs.append(packed.packed_matmul(h2, p, **kw).clone())
            torch.cuda.synchronize()
            runs[mode] = outs
        res[label] = {m: dict(differing_runs=sum(not torch.equal(o, outs[0]) for o in outs),
                              equal_to_off=sum(torch.equal(o, runs["off"][0]) for o in outs),
                              max_abs_vs_off=max(float((o - runs["off"][0]).abs().max()) for o in outs))
                      for m, outs in runs.items()}
        print(label, res[label], flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "pdl_configs.json"), "w"), indent=1)
    sys.exit(0)
for rows, prefill, partials in ((32, 64, True), (64, 64, True), (1, 0, False), (16, 0, False)):
    x = torch.randn(rows, K, device="cuda", generator=gen)
    case = f"rows{rows}_prefill{prefill}"
    res[case] = {"config": {k: v for k, v in packed.tuned_config(p, prefill, packed._sm_count(0), True).items()}}
    for label, (args, prefetch) in MODES.items():
        packed.pdl_args = lambda t, matmul=False, a=args: dict(a)
        packed.prefetch_tiles = lambda block_m, n=prefetch: n     # (in every block size, as before the fix)
        outs = []
        for _ in range(REPEATS):
            h = rms_norm(x, w_norm, 1e-6, torch.float16)
            outs.append(packed.matmul_tuned(h, p, prefill, partials=partials).clone())
        torch.cuda.synchronize()
        bad = [i for i, o in enumerate(outs) if not torch.equal(o, outs[0])]
        worst = max((float((o - outs[0]).abs().max()) for o in outs), default=0.0)
        res[case][label] = dict(differing_runs=len(bad), of=REPEATS, max_abs=worst)
        print(case, label, res[case][label], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "pdl_isolate.json"), "w"), indent=1)
