"""Stream-K against split-K for the decode matmul (H200): every matrix a 27B decode step multiplies, with the
engine's split-K settings and with stream-K at several programs per SM (packed_matmul's `stream`: each program
one equal run of the weight's tiles), timed like matmul_shapes.py (clones past the L2, one CUDA graph, fp16 x
at 1 and 16 rows), each checked against the engine's output; then each setting's sum over a step (times how
often a step runs each matrix), and the bits of stream-K's in-kernel sums against its separate sum kernel.

    python3 -u .ci/gpu/sweep_stream.py /tmp/m27.gguf [--per-sm 2 3 4 ...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".ci/gpu")
from matmul_shapes import decode_configs  # noqa: E402
from sweep_scales import clones, time_case  # noqa: E402

from kernels.quant.packed import _sm_count, packed_matmul  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--per-sm", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    ap.add_argument("--json")
    a = ap.parse_args()
    n_sm = _sm_count(0)
    rows, total = [], {}
    for key, p, c, cfg0 in decode_configs(a.model):
        cfg0 = {k: v for k, v in cfg0.items() if k != "stream"}
        xs = {m: torch.randn(m, p.k, device="cuda", dtype=torch.float16) for m in (1, 16)}
        ref = {m: packed_matmul(xs[m], p, **cfg0) for m in (1, 16)}
        ws = clones(p)
        cases = [("split", cfg0)] + [(f"stream {s}/SM", dict(cfg0, stream=s * n_sm)) for s in a.per_sm]
        for name, cfg in cases:
            label = f"{key[0]} {key[1]}x{key[2]} x{c} {name:14s}"
            got = time_case(label, p, ws, xs, ref, cfg, type=key[0], n=key[1], k=key[2], per_step=c, variant=name)
            rows += got
            for r in got:
                total[(name, r["rows"])] = total.get((name, r["rows"]), 0.0) + c * r["us"]
        x = xs[16]
        s = dict(cfg0, stream=4 * n_sm)
        apart = packed_matmul(x, p, **dict(s, sum_here=False))
        same = all(torch.equal(packed_matmul(x, p, **dict(s, sum_here=True)), apart) for _ in range(20))
        print(f"{key[0]} {key[1]}x{key[2]}: stream-K sums in the kernel == separate kernel (20 launches): {same}",
              flush=True)
        rows.append(dict(type=key[0], n=key[1], k=key[2], sums_equal=same))
        del ws
        torch.cuda.empty_cache()
    print("per step (us):")
    for (name, m), us in sorted(total.items(), key=lambda kv: (kv[0][1], kv[1])):
        print(f"  {name:14s} {m:2d} rows {us / 1e3:7.3f} ms")
    if a.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows,
                       totals=[dict(variant=n, rows=m, ms=us / 1e3) for (n, m), us in total.items()]),
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
