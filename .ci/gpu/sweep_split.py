"""Split-K counts on every matrix a 27B decode step multiplies (H200): each matrix with the engine's settings
and with every other split count (a divisor of its K tiles, 1 .. 64), timed like matmul_shapes.py (clones past
the L2, one CUDA graph, fp16 x at 1 and 16 rows), each checked against the engine's output; then the step's
matmul time with the engine's splits and with each matrix's fastest.

    python3 -u .ci/gpu/sweep_split.py /tmp/m27.gguf [--json OUT]
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
    ap.add_argument("--json")
    a = ap.parse_args()
    n_sm = _sm_count(0)
    rows, engine, best = [], {1: 0.0, 16: 0.0}, {1: 0.0, 16: 0.0}
    for key, p, c, cfg0 in decode_configs(a.model):
        kt, bands = p.k // p.tile_k, p.n_pad // p.tile_n
        xs = {m: torch.randn(m, p.k, device="cuda", dtype=torch.float16) for m in (1, 16)}
        ref = {m: packed_matmul(xs[m], p, **cfg0) for m in (1, 16)}
        ws = clones(p)
        splits = [s for s in range(1, min(kt, 64) + 1) if kt % s == 0]
        got = {}
        for s in splits:
            ours = s == cfg0["split_k"]
            label = (f"{key[0]} {key[1]}x{key[2]} x{c} split {s:2d} ({bands * s / n_sm:5.2f} programs/SM)"
                     + (" *" if ours else ""))
            for r in time_case(label, p, ws, xs, ref, dict(cfg0, split_k=s), type=key[0], n=key[1], k=key[2],
                               tile_n=p.tile_n, per_step=c, split=s, engine=ours):
                rows.append(r)
                got[(s, r["rows"])] = r["us"]
        for m in (1, 16):
            engine[m] += c * got[(cfg0["split_k"], m)]
            b = min((u, s) for (s, mm), u in got.items() if mm == m)
            best[m] += c * b[0]
            print(f"  {key[0]} {key[1]}x{key[2]} {m:2d} rows: engine split {cfg0['split_k']} "
                  f"{got[(cfg0['split_k'], m)]:.1f} us, best split {b[1]} {b[0]:.1f} us", flush=True)
        del ws
        torch.cuda.empty_cache()
    for m in (1, 16):
        print(f"step's matmuls, {m} rows: engine splits {engine[m] / 1e3:.3f} ms, each matrix's best {best[m] / 1e3:.3f} ms")
    if a.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows,
                       engine_ms={m: v / 1e3 for m, v in engine.items()}, best_ms={m: v / 1e3 for m, v in best.items()}),
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
