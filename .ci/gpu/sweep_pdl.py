"""Programmatic dependent launch (kernels/pdl.py) for the decode matmul: every packed matrix of a decode
step (matmul_shapes.py's list), each timed in a CUDA graph of back-to-back launches over copies past the
L2, with PDL off, and on with 0, 1, 2, 4 and all tiles of each program prefetched into L2 before it waits
for the previous launch. Prints the step's matmul total per setting (1 and 16 rows).

    python3 -u .ci/gpu/sweep_pdl.py /tmp/m27.gguf [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".ci/gpu")
from matmul_shapes import decode_configs  # noqa: E402
from sweep_scales import clones, graph_time  # noqa: E402

import kernels.pdl  # noqa: E402
import kernels.quant.packed as packed  # noqa: E402

SETTINGS = [("off", False, 0), ("on, no prefetch", True, 0), ("prefetch 1", True, 1), ("prefetch 2", True, 2),
            ("prefetch 4", True, 4), ("prefetch all", True, 1 << 20)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {name: dict(total_ms={1: 0.0, 16: 0.0}, shapes=[]) for name, _, _ in SETTINGS}
    for key, p, count, cfg in decode_configs(a.model):
        ws = clones(p)
        line = f"{key[0]:5s} {key[1]:6d} x {key[2]:5d} x{count:3d}/step:"
        for name, on, pf in SETTINGS:
            kernels.pdl.ENABLED, packed.PREFETCH_TILES = on, pf
            us = {}
            for m in (1, 16):
                x = torch.randn(m, p.k, device="cuda")
                us[m] = graph_time(lambda w: packed.packed_matmul(x, w, **cfg), ws) * 1e6
                res[name]["total_ms"][m] += count * us[m] / 1e3
            res[name]["shapes"].append(dict(type=key[0], n=key[1], k=key[2], per_step=count, us_1=us[1], us_16=us[16]))
            line += f"  {name} {us[1]:.1f}"
        print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
    kernels.pdl.ENABLED = True
    for name, _, _ in SETTINGS:
        t = res[name]["total_ms"]
        print(f"{name:16s} step's matmuls: 1 row {t[1]:.2f} ms, 16 rows {t[16]:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), settings=res), f, indent=1)


if __name__ == "__main__":
    main()
