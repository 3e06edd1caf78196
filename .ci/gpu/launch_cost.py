"""What one decode-matmul launch costs beyond streaming its bytes, per 27B decode matrix (H200): each
matrix timed as matmul_shapes.py times it (copies past the L2, back to back in one CUDA graph, the
engine's settings), and again with two copies stacked into one launch of twice the row bands (the same
split, so the same work per program). Twice the single launch minus the double one is the fixed cost of a
launch (ramp-up, tail, split-K's sums, the gap between kernels); the double one's extra time over the
single is what the bytes cost.

    python3 -u .ci/gpu/launch_cost.py /tmp/m27.gguf [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".ci/gpu")
from matmul_shapes import decode_configs  # noqa: E402
from sweep_scales import clones, graph_time  # noqa: E402

from kernels.quant.packed import packed_matmul  # noqa: E402
from kernels.quant.packing import stack_rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows, fixed_per_step = [], {1: 0.0, 16: 0.0}
    for key, p, c, cfg in decode_configs(a.model):
        ws = clones(p)
        ws = ws[:len(ws) // 2 * 2]
        pairs = [stack_rows([ws[i], ws[i + 1]])[0] for i in range(0, len(ws), 2)]
        r = dict(type=key[0], n=key[1], k=key[2], tile_n=key[3], tile_k=key[4], per_step=c, mb=p.nbytes / 1e6,
                 config=dict(cfg))
        for m in (1, 16):
            x = torch.randn(m, p.k, device="cuda", dtype=torch.float16)
            one = graph_time(lambda w: packed_matmul(x, w, **cfg), ws) * 1e6
            two = graph_time(lambda w: packed_matmul(x, w, **cfg), pairs) * 1e6
            fixed = 2 * one - two
            r[f"us_{m}"], r[f"us_{m}_double"], r[f"fixed_us_{m}"] = one, two, fixed
            fixed_per_step[m] += c * fixed / 1e3
        rows.append(r)
        print(f"{key[0]:5s} {key[1]:6d} x {key[2]:5d} tile {key[3]} x{c:3d}/step {r['mb']:7.1f} MB  split "
              f"{cfg['split_k']:2d}  1 row {r['us_1']:6.1f} us, doubled {r['us_1_double']:6.1f}: fixed "
              f"{r['fixed_us_1']:5.1f} us; 16 rows {r['us_16']:6.1f} / {r['us_16_double']:6.1f}: fixed "
              f"{r['fixed_us_16']:5.1f} us; bytes at {r['mb'] / (r['us_1_double'] - r['us_1']):.2f} TB/s",
              flush=True)
        del ws, pairs
        torch.cuda.empty_cache()
    print(f"fixed cost of the step's matmul launches: 1 row {fixed_per_step[1]:.2f} ms, 16 rows {fixed_per_step[16]:.2f} ms")
    if a.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), shapes=rows,
                       fixed_ms_per_step={str(m): v for m, v in fixed_per_step.items()}), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
