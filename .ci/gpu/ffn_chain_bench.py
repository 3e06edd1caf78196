"""What the one-launch FFN (kernels/quant/ffn_chain.py) saves against the engine's three launches on the 27B's
FFN (5120 -> 2 x 17408 -> 5120, gate+up Q4_K in 128-row tiles, down Q4_K or Q6_K in 64-row tiles): LAYERS
layers of random weights (past the L2), each layer rms_norm -> FFN -> residual as in a decode step, in one
CUDA graph replayed (PDL on where the engine has it), at 1, 4 and 16 rows. The three-launch side uses the
engine's settings (tuned_config); the chain takes its splits and program count from the command line (each
combination is timed). The first layer's result is checked against the three launches (bit for bit where the
splits are the engine's).

    python3 -u .ci/gpu/ffn_chain_bench.py [--layers 6] [--programs 4 8] [--splits 4:17 3:11] [--json OUT]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, os.getcwd())
from kernels.fused import rms_norm  # noqa: E402
from kernels.quant.ffn_chain import ffn_chain, ffn_unfused  # noqa: E402
from kernels.quant.packed import _sm_count, packed_matmul, pack_weight, stack_rows, tuned_config  # noqa: E402
from kernels.fused import silu_mul  # noqa: E402
from tests.kernels.test_packed import _random_weight  # noqa: E402


def layer_weights(down_type, seed):
    f, k = 17408, 5120
    gate = pack_weight(_random_weight(QT.Q4_K, f, k, seed=seed).cuda(), QT.Q4_K, f, k)
    up = pack_weight(_random_weight(QT.Q4_K, f, k, seed=seed + 1).cuda(), QT.Q4_K, f, k)
    down = pack_weight(_random_weight(down_type, k, f, seed=seed + 2).cuda(), down_type, k, f)
    stack, _ = stack_rows([gate, up])
    return stack, down


def graph_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--programs", type=int, nargs="+", default=[4, 8], help="per SM (0: one per item)")
    ap.add_argument("--splits", nargs="+", default=["4:17", "3:11", "4:8"], help="gate+up:down")
    ap.add_argument("--caps", type=int, nargs="+", default=[128], help="maxnreg (0: none)")
    ap.add_argument("--stages", type=int, nargs="+", default=[3])
    ap.add_argument("--polls", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--json")
    a = ap.parse_args()
    n_sm = _sm_count(0)
    rows = []
    for down_type in (QT.Q4_K, QT.Q6_K):
        layers = [layer_weights(down_type, 10 * i) for i in range(a.layers)]
        cfg_a = tuned_config(layers[0][0], 0, n_sm)
        cfg_b = tuned_config(layers[0][1], 0, n_sm)
        # small norm weights: with random weights |gate|, |up| reach ~300 for inputs ~1 and silu(gate) * up
        # overflows fp16 (both paths gave NaN in s25 run 4); at ~0.01 h stays finite
        norm_w = (torch.rand(5120, device="cuda") + 0.5) * 0.01
        for m in (1, 4, 16):
            x0 = torch.randn(m, 5120, device="cuda")      # (rms_norm brings it to ~1; norm_w scales it)

            def unfused():
                x = x0
                for stack, down in layers:
                    h = rms_norm(x, norm_w, 1e-6, torch.float16)
                    gu = packed_matmul(h, stack, **cfg_a)
                    f = stack.n // 2
                    x = packed_matmul(silu_mul(gu[:, :f], gu[:, f:], torch.float16), down, add=x, **cfg_b)
                return x

            base = graph_ms(unfused)
            r = dict(down=down_type.name, rows=m, variant="three launches", ms=base, per_layer_us=base * 1e3 / a.layers,
                     splits=f"{cfg_a['split_k']}:{cfg_b['split_k']}")
            rows.append(r)
            print(f"{down_type.name} down, {m:2d} rows, three launches (splits {r['splits']}): "
                  f"{r['per_layer_us']:6.1f} us a layer", flush=True)
            for sp in a.splits:
                sa, sb = map(int, sp.split(":"))
                for per_sm, cap, st, poll in itertools.product(a.programs, a.caps, a.stages, a.polls):
                    kw = dict(split_a=sa, split_b=sb, programs=per_sm * n_sm, maxnreg=cap or None, num_stages=st,
                              poll=poll)

                    def chained():
                        x = x0
                        for stack, down in layers:
                            h = rms_norm(x, norm_w, 1e-6, torch.float16)
                            x = ffn_chain(h, stack, down, x, **kw)
                        return x
                    h = rms_norm(x0, norm_w, 1e-6, torch.float16)
                    want = ffn_unfused(h, layers[0][0], layers[0][1], x0, split_a=sa, split_b=sb, swap_ab=True)
                    got = ffn_chain(h, layers[0][0], layers[0][1], x0, **kw)
                    exact = bool(torch.equal(got, want))
                    err = ((got - want).abs().max() / (want - x0).abs().max()).item()
                    t = graph_ms(chained)
                    r = dict(down=down_type.name, rows=m, variant="chain", splits=sp, programs_per_sm=per_sm, ms=t,
                             maxnreg=cap, stages=st, poll=poll,
                             per_layer_us=t * 1e3 / a.layers, exact=exact, err=err)
                    rows.append(r)
                    print(f"{down_type.name} down, {m:2d} rows, chain splits {sp} {per_sm}/SM cap {cap} {st} stages "
                          f"poll {poll}: "
                          f"{r['per_layer_us']:6.1f} us a layer ({r['per_layer_us'] - base * 1e3 / a.layers:+.1f}), "
                          f"bit-exact {exact} err {err:.1e}", flush=True)
        layers.clear()
        torch.cuda.empty_cache()
    if a.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
