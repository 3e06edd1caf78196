"""Experiment (issue #4): the decode matmul with integer dots, as llama.cpp's MMVQ computes it. x is
quantized to int8 per 32 values (xd: the block's scale, xs: xd * sum of its codes, llama.cpp's Q8_1), a
Q4_K weight's nibbles are masked straight into int8 operands (no fp16 tile), each 32-value group is one
int8 tl.dot ([tile_n, 32] x [32, 16] -> int32), and the group's scale and min are applied to the int32
sums in float32:  y[m, n] = sum_g  s[n, g] * xd[m, g] * dot_g[n, m]  -  minv[n, g] * xs[m, g].
Not wired into the engine (it rounds x to 8-bit blocks where the engine rounds it to fp16). Same grid,
tiles and split as the engine's decode matmul; each group's plane bytes come by TMA as a [tile_n, 16] box.

    TRITON_INTERPRET=1 python3 .ci/gpu/int8_dot.py check     (CPU: the kernel against float64 sums)
    python3 -u .ci/gpu/int8_dot.py bench [--json OUT]       (H200: against the engine's decode matmul)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, ".ci/gpu")
sys.path.insert(0, "tests/kernels")
from test_packed import _random_weight  # noqa: E402

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kernels.quant.packed import (  # noqa: E402
    _has_tma, _sm_count, group_scales, nibble_values, pack_weight, packed_matmul, row_major, tuned_config,
)


def quantize_x(x: torch.Tensor):
    """x float [M, K] -> (xq int8 [M, K], xd float32 [M, K/32], xs float32 [M, K/32]) as llama.cpp's Q8_1:
    d = max|x| / 127 per block, q = round(x / d), s = d * sum(q)."""
    m, k = x.shape
    b = x.float().view(m, k // 32, 32)
    d = b.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(b / d.clamp_min(1e-30)[..., None]), torch.zeros_like(b))
    q = q.to(torch.int8)
    return q.view(m, k).contiguous(), d.contiguous(), (d * q.float().sum(-1)).contiguous()


@triton.jit
def _int8_mm_kernel(xq_ptr, xd_ptr, xs_ptr, lo_desc, s_ptr, m_ptr, part_ptr, M, N, TILES,
                    KT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G: tl.constexpr = BLOCK_K // GROUP
    K: tl.constexpr = KT * BLOCK_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(0, TILES):
        kt = pid_k * TILES + t
        tile = pid_n.to(tl.int64) * KT + kt
        for g in tl.static_range(G):
            b = lo_desc.load([(tile * BLOCK_N).to(tl.int32), g * (GROUP // 2)])          # [BLOCK_N, 16] uint8
            q = tl.reshape(tl.join(b & 0x0F, b >> 4), (BLOCK_N, GROUP)).to(tl.int8)
            kg = kt * G + g
            xg = tl.load(xq_ptr + offs_m[:, None] * K + kg * GROUP + tl.arange(0, GROUP)[None, :],
                         mask=mask_m[:, None], other=0)
            d = tl.dot(q, tl.trans(xg))                                                    # int32 [BLOCK_N, BLOCK_M]
            sg = tl.load(s_ptr + tile * (BLOCK_N * G) + rows * G + g).to(tl.float32)
            mg = tl.load(m_ptr + tile * (BLOCK_N * G) + rows * G + g).to(tl.float32)
            xdg = tl.load(xd_ptr + offs_m * (K // GROUP) + kg, mask=mask_m, other=0.0)
            xsg = tl.load(xs_ptr + offs_m * (K // GROUP) + kg, mask=mask_m, other=0.0)
            acc += d.to(tl.float32) * (sg[:, None] * xdg[None, :]) - mg[:, None] * xsg[None, :]
    cols = pid_n * BLOCK_N + rows
    offs = pid_k.to(tl.int64) * M * N + offs_m[None, :].to(tl.int64) * N + cols[:, None]
    tl.store(part_ptr + offs, acc, mask=mask_m[None, :] & (cols[:, None] < N))


def int8_matmul(xq, xd, xs, p, split: int, part: torch.Tensor | None = None, desc=None, num_warps=4, num_stages=2):
    """Partial sums [split, M, N] (their sum over the split is y)."""
    m, n = xq.shape[0], p.n
    kt = p.k // p.tile_k
    split = next(s for s in range(max(1, min(split, kt)), kt + 1) if kt % s == 0)   # a divisor, as the engine's
    if desc is None:
        desc = TensorDescriptor.from_tensor(p.planes[0].view(-1, p.planes[0].shape[-1]), [p.tile_n, 16])
    if part is None:
        part = torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
    kw = dict(num_warps=num_warps, num_stages=num_stages) if xq.is_cuda else {}
    _int8_mm_kernel[(-(-m // 16), p.n_pad // p.tile_n, split)](
        xq, xd, xs, desc, p.scale, p.minv, part, m, n, kt // split, KT=kt, BLOCK_M=16, BLOCK_N=p.tile_n,
        BLOCK_K=p.tile_k, GROUP=p.group, **kw)
    return part


def in_order(p):
    """p with its 4-bit plane in value order (value 2j, 2j+1 in byte j), as this kernel reads it (the
    engine's plane is in tensor-core fragment order since 2026-12-01)."""
    q = nibble_values(p)
    b = q[:, 0::2] | (q[:, 1::2] << 4)
    nt, kt, tn, w = p.planes[0].shape
    b = torch.cat([b, b.new_zeros(nt * tn - p.n, b.shape[1])]).view(nt, tn, kt, w).permute(0, 2, 1, 3)
    return dataclasses.replace(p, planes=(b.contiguous(),))


def reference(xq, xd, xs, p):
    """float64: sum_g s * xd * (q . xq) - minv * xs."""
    s, mv = (t.double() for t in group_scales(p))
    q = nibble_values(p).double()
    m, k = xq.shape
    dots = torch.einsum("ngk,mgk->mng", q.view(p.n, k // 32, 32), xq.double().view(m, k // 32, 32))
    return (dots * s[None] * xd.double()[:, None, :]).sum(-1) - (mv[None] * xs.double()[:, None, :]).sum(-1)


def check():
    for n, k in ((64, 512), (40, 768)):
        p = pack_weight(_random_weight(QT.Q4_K, n, k, seed=3), QT.Q4_K, n, k, tile_n=32)
        for m in (1, 5):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            xq, xd, xs = quantize_x(x)
            y = int8_matmul(xq, xd, xs, in_order(p), split=2).sum(0)
            ref = reference(xq, xd, xs, p)
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            print(f"{n}x{k} M={m}: max error {err:.2e}")
            assert err < 1e-5
            fp16 = packed_matmul(x, p, split_k=2)   # the engine's result: x in fp16, the weight's fp16 tile
            print(f"   vs the fp16 kernel: {((y - fp16).abs().max() / fp16.abs().max()).item():.2e}")
    print("ok")


def bench(out_json):
    from sweep_scales import clones, graph_time
    n_sm, tma = _sm_count(0), _has_tma(0)
    rows = []
    for n, k in ((34816, 5120), (5120, 17408), (12288, 5120)):
        p = pack_weight(_random_weight(QT.Q4_K, n, k, seed=1).cuda(), QT.Q4_K, n, k)
        cfg = tuned_config(p, False, n_sm, tma=tma)
        ws, ws_seq = clones(p), clones(in_order(p))
        descs = {id(w): TensorDescriptor.from_tensor(w.planes[0].view(-1, w.planes[0].shape[-1]), [w.tile_n, 16])
                 for w in ws_seq}
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda")
            xq, xd, xs = quantize_x(x)
            y = int8_matmul(xq, xd, xs, in_order(p), cfg["split_k"]).sum(0)
            ref = reference(xq, xd, xs, p)
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            del ref
            part = torch.empty((cfg["split_k"], m, n), device="cuda")
            res = {"fp16 (engine)": graph_time(lambda w: packed_matmul(x, w, **cfg), ws)}
            for warps, stages in ((4, 2), (4, 3), (8, 3)):
                res[f"int8 {warps}w/{stages}s"] = graph_time(
                    lambda w: int8_matmul(xq, xd, xs, w, cfg["split_k"], part, descs[id(w)], warps, stages), ws_seq)
            for name, t in res.items():
                r = dict(n=n, k=k, rows=m, kernel=name, us=t * 1e6, tbps=p.nbytes / t / 1e12, err=err)
                rows.append(r)
                print(f"Q4_K {n}x{k} M={m:2d} {name:14s} {r['us']:7.1f} us {r['tbps']:.2f} TB/s  (int8 error {err:.1e})",
                      flush=True)
        del ws, ws_seq
        torch.cuda.empty_cache()
    if out_json:
        json.dump(dict(device=torch.cuda.get_device_name(0), results=rows), open(out_json, "w"), indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["check", "bench"])
    ap.add_argument("--json")
    a = ap.parse_args()
    check() if a.what == "check" else bench(a.json)
