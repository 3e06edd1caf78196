"""On the GPU machine: HiveJet's packed Q4_K matmul against the libraries the GPU-path issue asked to
evaluate, on the 27B model's FFN shapes, same run, same weights' bit budget (4-bit values, a scale and
a min or zero per 32 values):
  - decode rows M = 1..64: packed_matmul (tuned_config) vs torch's int4 "tinygemm" kernel
    (aten._weight_int4pack_mm, what torchao's int4 weight-only path calls) vs gemlite 0.6
    (A16W4, group 32, its H100 configs) vs an fp16 cuBLAS product (reads 3.2x the bytes);
  - prefill rows M = 512, 2048: packed_matmul's prefill tiles vs dequantize-to-fp16 + cuBLAS.
Prints one JSON line per case and writes $OUT/eval_libs.json.
    python3 .ci/gpu/eval_libs.py"""
import json
import os
import sys
import time

import torch
from gguf import GGMLQuantizationType as QT
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
from kernels.quant.packed import (  # noqa: E402
    dequant_packed, matmul_tuned, packed_matmul, prefill_matmul, tuned_config,
)
from kernels.quant.packing import nibble_values, row_major  # noqa: E402

SHAPES = [(17408, 5120), (5120, 17408)]
ROWS = [1, 2, 4, 8, 16, 32, 64]
out_rows = []


def log(**kw):
    out_rows.append(kw)
    print(json.dumps(kw), flush=True)


def q4k_weight(n, k):
    raw = torch.randint(0, 256, (n * k // 256 * 144,), dtype=torch.uint8, device="cuda").view(-1, 144)
    half = torch.tensor(0.001, dtype=torch.float16, device="cuda").view(torch.int16)
    raw.view(torch.int16)[:, :2] = half
    from kernels.quant.packing import pack_weight
    return pack_weight(raw.reshape(-1), QT.Q4_K, n, k)


def tinygemm(p):
    """The same 4-bit values and per-32 scale/min in tinygemm's layout: w = (q - 8) * s + z."""
    s, mn = (row_major(p, t) for t in (p.scale, p.minv))
    q = nibble_values(p)                                         # 0..15
    packed = (q[:, 0::2] << 4 | q[:, 1::2]).contiguous()
    w = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    s = s.float()
    z = 8 * s - mn.float()
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, w, 32, sz)


def gemlite_layer(p):
    import gemlite
    from gemlite.core import DType, GemLiteLinearTriton
    cfg = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    GemLiteLinearTriton.load_config(cfg)
    s, mn = (row_major(p, t) for t in (p.scale, p.minv))
    q = nibble_values(p).contiguous()
    s = s.contiguous()
    z = (mn.float() / s.float()).to(torch.float16).contiguous()   # w = (q - z) * s
    lin = GemLiteLinearTriton(W_nbits=4, group_size=32, in_features=p.k, out_features=p.n,
                              input_dtype=DType.FP16, output_dtype=DType.FP16)
    lin.pack(q, s, z, bias=None)
    return lin


def main():
    t_start = time.time()
    for n, k in SHAPES:
        p = q4k_weight(n, k)
        w16 = dequant_packed(p)
        ref_bytes = p.nbytes
        libs = {"hivejet": lambda x: matmul_tuned(x, p)}
        try:
            libs["torch_int4"] = tinygemm(p)
        except Exception as e:  # noqa: BLE001
            log(shape=[n, k], lib="torch_int4", error=repr(e)[:300])
        try:
            libs["gemlite"] = gemlite_layer(p)
        except Exception as e:  # noqa: BLE001
            log(shape=[n, k], lib="gemlite", error=repr(e)[:300])
        libs["fp16_cublas"] = lambda x: x @ w16.t()
        for m in ROWS:
            x32 = torch.randn(m, k, device="cuda")
            ref = x32.half().float() @ w16.float().t()
            for name, fn in libs.items():
                x = x32.to(torch.bfloat16) if name == "torch_int4" else x32.half()
                if name == "hivejet":
                    x = x32
                try:
                    y = fn(x).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    ms = do_bench(lambda: fn(x), warmup=10, rep=50)
                except Exception as e:  # noqa: BLE001
                    log(shape=[n, k], m=m, lib=name, error=repr(e)[:300])
                    continue
                nbytes = w16.numel() * 2 if name == "fp16_cublas" else ref_bytes
                log(shape=[n, k], m=m, lib=name, ms=round(ms, 4), tbps=round(nbytes / ms / 1e9, 3),
                    q4_equiv_tbps=round(ref_bytes / ms / 1e9, 3), rel_err=round(err, 5))
        for m in (512, 2048):
            x = torch.randn(m, k, device="cuda")
            flop = 2 * m * n * k
            cfg = tuned_config(p, 512, torch.cuda.get_device_properties(0).multi_processor_count)
            for name, fn in (("triton_prefill_tiles", lambda: packed_matmul(x, p, **cfg)),
                             ("dequant_cublas", lambda: prefill_matmul(x, p)),
                             ("dequant_only", lambda: dequant_packed(p)),
                             ("cublas_fp16_only", lambda: torch.mm(x.half(), w16.t(), out_dtype=torch.float32))):
                try:
                    ms = do_bench(fn, warmup=5, rep=30)
                except Exception as e:  # noqa: BLE001
                    log(shape=[n, k], m=m, lib=name, error=repr(e)[:300])
                    continue
                log(shape=[n, k], m=m, lib=name, ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1))
        del p, w16
        torch.cuda.empty_cache()
    log(total_s=round(time.time() - t_start, 1), device=torch.cuda.get_device_name(0), torch=torch.__version__)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "eval_libs.json"), "w") as f:
        json.dump(out_rows, f, indent=1)


if __name__ == "__main__":
    main()
