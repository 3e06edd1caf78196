"""Where a decode step's matmul time goes, per weight shape: every packed matrix a decode step multiplies
(stacks as one), grouped by (type, rows, K, tile), each timed alone with the engine's settings at 1 and
16 rows (cloned past the L2, in one CUDA graph: sweep_scales.graph_time), times how often a step runs
it. The sum is what the matmuls would cost back to back; `bench decode` gives the whole step. x is fp16,
as the engine hands it over (Weight.input_dtype); --x32 also times float32 x (the kernel rounding it: what
handing x over in fp16 saves).

    python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf [--x32] [--json OUT]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings

import torch

sys.path.insert(0, ".ci/gpu")
from sweep_scales import clones, graph_time  # noqa: E402

from engine.models import open_model  # noqa: E402
from engine.models.common import StackedWeights, Weight  # noqa: E402
from engine.runner import Runner  # noqa: E402
from kernels.quant.packed import _has_tma, _sm_count, packed_matmul, tuned_config  # noqa: E402
from kernels.quant.packing import PackedWeight


def decode_matrices(model) -> dict:
    """(type, rows, K, tile rows, tile values) -> [one such PackedWeight, how many a decode step multiplies]."""
    stacked_parts, mats = set(), []
    warnings.filterwarnings("ignore", category=FutureWarning)    # (gc meets torch's deprecated aliases)
    for o in gc.get_objects():
        if isinstance(o, StackedWeights):
            for stack, cols in o.groups:
                mats.append(stack)
                stacked_parts.update(id(o.parts[i]) for i, _ in cols)
    for o in gc.get_objects():
        if isinstance(o, Weight) and isinstance(o.gpu, PackedWeight) and id(o) not in stacked_parts \
                and "nextn" not in o.name:     # (the MTP block runs only with --spec mtp)
            if o.name != "token_embd.weight" or o is getattr(model, "output", None):
                mats.append(o.gpu)
    by_key: dict = {}
    for p in mats:
        by_key.setdefault((p.qtype.name, p.n, p.k, p.tile_n, p.tile_k), [p, 0])[1] += 1
    return by_key


def decode_configs(model_path: str) -> list:
    """The model on the GPU; [(key, PackedWeight, per step, the engine's decode settings)], the most
    bytes per step first."""
    model = open_model(model_path)
    Runner(model, device="cuda", n_slots=1, max_ctx=64)
    n_sm, tma = _sm_count(0), _has_tma(0)
    return [(key, p, c, tuned_config(p, False, n_sm, tma=tma))
            for key, (p, c) in sorted(decode_matrices(model).items(), key=lambda kv: -kv[1][1] * kv[1][0].nbytes)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json")
    ap.add_argument("--x32", action="store_true", help="also float32 x")
    a = ap.parse_args()
    rows, total = [], {1: 0.0, 16: 0.0, "1_x32": 0.0, "16_x32": 0.0}
    for key, p, c, cfg in decode_configs(a.model):
        ws = clones(p)
        r = dict(type=key[0], n=key[1], k=key[2], tile_n=key[3], tile_k=key[4], per_step=c, mb=p.nbytes / 1e6,
                 config=dict(cfg))
        for m in (1, 16):
            for x32 in (False, True) if a.x32 else (False,):
                x = torch.randn(m, p.k, device="cuda", dtype=torch.float32 if x32 else torch.float16)
                t = graph_time(lambda w: packed_matmul(x, w, **cfg), ws)
                tag = f"{m}_x32" if x32 else m
                r[f"us_{tag}"], r[f"tbps_{tag}"] = t * 1e6, p.nbytes / t / 1e12
                total[tag] += c * t
        rows.append(r)
        print(f"{key[0]:5s} {key[1]:6d} x {key[2]:5d} tile {key[3]}x{key[4]} x{c:3d}/step {r['mb']:7.1f} MB  "
              f"1 row {r['us_1']:7.1f} us {r['tbps_1']:.2f} TB/s  16 rows {r['us_16']:7.1f} us {r['tbps_16']:.2f} TB/s  "
              f"split {cfg['split_k']}" + (f"  float32 x: {r['us_1_x32']:7.1f} / {r['us_16_x32']:7.1f} us" if a.x32 else ""),
              flush=True)
        del ws
        torch.cuda.empty_cache()
    mb = sum(r["mb"] * r["per_step"] for r in rows)
    print(f"all decode matmuls: {mb / 1e3:.2f} GB, 1 row {total[1] * 1e3:.2f} ms ({mb / 1e6 / total[1]:.2f} TB/s), "
          f"16 rows {total[16] * 1e3:.2f} ms" + (f"; float32 x: {total['1_x32'] * 1e3:.2f} / {total['16_x32'] * 1e3:.2f} ms"
                                                 if a.x32 else ""))
    if a.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), shapes=rows, total_ms={m: t * 1e3 for m, t in total.items()},
                       gb=mb / 1e3), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
