"""The decode matmul with the scales stored three ways, on the 27B's shapes (H200): 8-bit codes times
d/dmin per tile row ("codes", the layout since 2026-12-01), fp16 products ("f16": scale and min per
group for Q4_K, scale only for Q6_K whose min is 32 * scale), and for Q6_K also an fp16 min stored
beside the scale ("f16+minv", the layout before). Each weight is cloned until the copies exceed the
50 MB L2 several times over, a CUDA graph multiplies them one after the other (the engine's decode
settings: matmul_tuned's TMA configuration), and the graph's replays are timed by CUDA events: TB/s of
each layout's own bytes, and microseconds per matmul. Two rounds, the variants alternating.

    python3 -u .ci/gpu/sweep_scales.py [--json OUT]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

sys.path.insert(0, "tests/kernels")
from test_packed import _random_weight  # noqa: E402

from kernels.quant.packed import _has_tma, _sm_count, packed_matmul, tuned_config  # noqa: E402
from kernels.quant.packing import pack_weight
from gguf import GGMLQuantizationType as QT  # noqa: E402

SHAPES = [("Q4_K", 34816, 5120), ("Q4_K", 5120, 17408), ("Q4_K", 12288, 5120), ("Q6_K", 5120, 17408),
          ("Q6_K", 248320, 5120)]


def variants(qt, n, k):
    raw = _random_weight(QT[qt], n, k, seed=1).cuda()
    out = {"codes": pack_weight(raw, QT[qt], n, k, coded=True),
           "f16": pack_weight(raw, QT[qt], n, k, coded=False)}
    if qt == "Q6_K":
        f = out["f16"]
        out["f16+minv"] = dataclasses.replace(f, minv=(f.scale.float() * f.offset).half(), offset=0)
    return out


def clones(p, total=600e6):
    c = max(2, int(total // p.nbytes) + 1)
    def cp(t):
        return None if t is None else t.clone()
    return [p] + [dataclasses.replace(p, planes=tuple(cp(t) for t in p.planes), scale=cp(p.scale),
                                      minv=cp(p.minv), supers=cp(p.supers)) for _ in range(c - 1)]


def graph_time(fn, items, reps=10):
    """Seconds per call of fn(item), over a CUDA graph that calls it on each item in turn, replayed reps
    times (timed by CUDA events)."""
    for w in items:
        fn(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in items:
            fn(w)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e-3 / (reps * len(items))


def time_it(ws, m, cfg):
    x = torch.randn(m, ws[0].k, device="cuda", dtype=torch.float16)   # (as the engine hands x over)
    return graph_time(lambda w: packed_matmul(x, w, **cfg), ws)


def time_case(label, p, ws, xs, ref, cfg, **fields) -> list[dict]:
    """One variant (settings cfg) of the decode matmul on p, timed on its clones ws (time_it) at each row
    count of xs {rows: x} and checked against ref {rows: the engine's output}: a result dict per row count
    (fields, rows, us, tbps, err), each printed after `label`; a variant that does not compile or launch
    (registers, shared memory) is reported and left out."""
    out = []
    for m, x in xs.items():
        try:
            y = packed_matmul(x, p, **cfg)
            err = ((y - ref[m]).abs().max() / ref[m].abs().max()).item()
            t = time_it(ws, m, cfg)
        except Exception as e:
            print(f"{label} M={m}: {type(e).__name__} {str(e)[:80]}", flush=True)
            continue
        out.append(dict(fields, rows=m, us=t * 1e6, tbps=p.nbytes / t / 1e12, err=err))
        print(f"{label} M={m:2d}: {t * 1e6:7.1f} us {p.nbytes / t / 1e12:.2f} TB/s err {err:.1e}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    n_sm, tma = _sm_count(0), _has_tma(0)
    rows = []
    for qt, n, k in SHAPES:
        vs = variants(qt, n, k)
        sets = {name: clones(p) for name, p in vs.items()}
        cfgs = {name: tuned_config(p, False, n_sm, tma=tma) for name, p in vs.items()}
        for rnd in range(2):
            for m in (1, 16):
                for name, ws in sets.items():
                    t = time_it(ws, m, cfgs[name])
                    r = dict(type=qt, n=n, k=k, layout=name, rows=m, round=rnd, us=t * 1e6,
                             tbps=vs[name].nbytes / t / 1e12, mb=vs[name].nbytes / 1e6)
                    rows.append(r)
                    print(f"{qt} {n}x{k} {name:9s} M={m:2d} round {rnd}: {r['us']:8.1f} us  {r['mb']:7.1f} MB  "
                          f"{r['tbps']:.2f} TB/s", flush=True)
        del sets, vs
        torch.cuda.empty_cache()
    if args.json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
