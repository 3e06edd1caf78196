"""Small prompt chunks (at most SMALL_PROMPT_ROWS = 64 rows: a short request, a follow-up's new tokens, a
prompt's tail) on the 27B: what their matmuls cost, and which settings they should take.

1. Every packed matrix a step multiplies (matmul_shapes.decode_matrices), at 64 rows, timed alone in a CUDA
   graph over clones past the L2 (sweep_scales.graph_time): dequantize + cuBLAS padded to 256 rows (the path
   before) and to 64, the decode settings (16-row blocks), and small_prompt's settings (one 64-row block)
   with warps / stages / SWAP_AB varied. Per weight class the variant with the least time per step is the
   pick -> --pick FILE (HIVEJET_SMALL_PROMPT_CONFIG's JSON).
2. With the pick: runner.prefill of 16 / 32 / 64 tokens at chunk 256, through the 64-row graph against the
   256-row graph (SMALL_PROMPT_ROWS 0), and the memory the 64-row graph's capture reserved.

    python3 -u .ci/gpu/small_prompt.py /tmp/m27.gguf --json OUT --pick PICK [--seconds 150]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".ci/gpu")
from matmul_shapes import decode_configs  # noqa: E402
from sweep_scales import clones, graph_time  # noqa: E402

import engine.runner as runner_mod  # noqa: E402
import kernels.quant.packed as packed  # noqa: E402

ROWS = 64


def variants(p, cfg: dict) -> dict:
    base = packed.small_prompt(p, cfg)
    out = {}
    for warps in (4, 8):
        for stages in sorted({cfg["num_stages"], 2, 3}):
            for swap in (True, False):
                out[f"w{warps} s{stages} {'swap' if swap else 'noswap'}"] = dict(
                    base, num_warps=warps, num_stages=stages, swap_ab=swap)
    return out


def sweep(model_path: str, seconds: float) -> tuple:
    t_end = time.time() + seconds
    configs = decode_configs(model_path)
    rows, by_class = [], {}
    for key, p, per_step, cfg in configs:
        ws = clones(p)
        x = torch.randn(ROWS, p.k, device="cuda", dtype=torch.float16)
        r = dict(type=key[0], n=key[1], k=key[2], tile_n=key[3], tile_k=key[4], per_step=per_step, us={})
        r["us"]["cublas256"] = graph_time(lambda w: packed.prefill_matmul(x, w, pad_rows=256), ws[:2]) * 1e6
        r["us"]["cublas64"] = graph_time(lambda w: packed.prefill_matmul(x, w, pad_rows=64), ws[:2]) * 1e6
        r["us"]["decode16"] = graph_time(lambda w: packed.packed_matmul(x, w, **cfg), ws) * 1e6
        cls = packed.weight_class(p)
        for name, c in variants(p, cfg).items():
            if time.time() > t_end:
                break
            try:
                r["us"][name] = graph_time(lambda w: packed.packed_matmul(x, w, **c), ws) * 1e6
            except Exception as e:   # (out of shared memory or registers: not a candidate)
                r["us"][name] = None
                print(f"  {name}: {type(e).__name__}", flush=True)
            by_class.setdefault(cls, {}).setdefault(name, []).append((per_step, r["us"][name], c))
        best = min((v, k) for k, v in r["us"].items() if v is not None)
        print(f"{key[0]:5s} {key[1]:6d} x {key[2]:5d} x{per_step:3d}/step  cuBLAS 256 {r['us']['cublas256']:7.1f} "
              f"64 {r['us']['cublas64']:7.1f}  decode 16-row blocks {r['us']['decode16']:7.1f}  best {best[1]} "
              f"{best[0]:7.1f} us", flush=True)
        rows.append(r)
        del ws
        torch.cuda.empty_cache()
    pick, totals = {}, {}
    for cls, cands in by_class.items():
        full = {name: v for name, v in cands.items() if all(t is not None for _, t, _ in v)}
        score = {name: sum(c * t for c, t, _ in v) for name, v in full.items()
                 if len(v) == max(len(x) for x in full.values())}
        if score:
            name = min(score, key=score.get)
            c = full[name][0][2]
            pick[cls] = dict(num_warps=c["num_warps"], num_stages=c["num_stages"], swap_ab=c["swap_ab"])
            totals[cls] = {k: round(v / 1e3, 3) for k, v in sorted(score.items(), key=lambda kv: kv[1])}
    step = {m: sum(r["per_step"] * r["us"][m] for r in rows) / 1e3 for m in ("cublas256", "cublas64", "decode16")}
    print(f"matmuls of one 64-row chunk, ms: cuBLAS padded to 256 {step['cublas256']:.2f}, to 64 "
          f"{step['cublas64']:.2f}, decode settings {step['decode16']:.2f}; small_prompt per class: "
          f"{ {c: list(t.items())[:3] for c, t in totals.items()} }; pick {pick}", flush=True)
    return rows, pick, totals, step


def end_to_end(model_path: str) -> dict:
    """runner.prefill of short prompts through the 64-row graph and the 256-row graph (captured first)."""
    from engine.models import open_model
    model = open_model(model_path)
    r = runner_mod.Runner(model, device="cuda", n_slots=2, max_ctx=2048)
    small = packed.SMALL_PROMPT_ROWS
    out = {}

    def set_small(v):
        packed.SMALL_PROMPT_ROWS = v
    set_small(0)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_reserved()
    r.capture_prefill(256)
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_reserved()
    set_small(small)
    r.capture_prefill(256)
    torch.cuda.synchronize()
    m2 = torch.cuda.memory_reserved()
    out["reserved_mb"] = dict(graph256=(m1 - m0) / 2**20, graph64=(m2 - m1) / 2**20)
    toks = torch.randint(10, 1000, (64,)).tolist()
    for n in (16, 32, 64):
        for label, v in (("small", small), ("chunk256", 0)):
            set_small(v)
            ts = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r.prefill(0, toks[:n], chunk=256)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            out[f"{label}_{n}_ms"] = statistics.median(ts) * 1e3
        print(f"prefill of {n} tokens: 64-row graph {out[f'small_{n}_ms']:.2f} ms, 256-row graph "
              f"{out[f'chunk256_{n}_ms']:.2f} ms", flush=True)
    set_small(small)
    print(f"reserved by the graphs' capture: {out['reserved_mb']}", flush=True)
    r.close()
    model.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json")
    ap.add_argument("--pick")
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--no-sweep", action="store_true")
    a = ap.parse_args()
    res = dict(device=torch.cuda.get_device_name(0))
    if not a.no_sweep:
        rows, pick, totals, step = sweep(a.model, a.seconds)
        res.update(shapes=rows, pick=pick, per_class_ms=totals, chunk_matmuls_ms=step)
        if a.pick:
            json.dump(pick, open(a.pick, "w"))
        packed.SMALL_PROMPT_CONFIG = {**packed.SMALL_PROMPT_CONFIG, **pick}
        packed._CONFIGS.clear()
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    res["small_prompt_config"] = packed.SMALL_PROMPT_CONFIG
    res["end_to_end"] = end_to_end(a.model)
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
