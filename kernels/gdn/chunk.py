"""The sequential part of Qwen3.5's chunkwise-parallel delta rule (engine/models/qwen35.py:
delta_rule_chunked) as one Triton kernel: the scan of a prompt chunk's 64-token pieces through the state.

Per head, with the pieces' precomputed terms (u, w from the UT transform, qg, qk, kg, g_last), piece i:

    v_new = u[i] - w[i] @ S
    out[i] = qg[i] @ S + qk[i] @ v_new
    S = S * g_last[i] + kg[i]^T @ v_new

In torch that is five launches per piece (`ref_chunk_scan`; 40 per layer for a 512-token chunk, ~1900 of a
27B prompt chunk's), and a prompt chunk on the GPU is bound by the host's launches (docs/PERFORMANCE.md,
seventh session). Here one program per (head, block of BV state columns) keeps its [Dk, BV] slice of S
in registers through all pieces: the columns of S are independent in every line above. float32 dots
(input_precision "ieee", as torch's float32 matmul); the sums' order differs from cuBLAS's, so results
agree to float32 rounding. Not used yet (USE_KERNEL, below): written and checked under Triton's
interpreter, its one GPU run failed.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch loop in delta_rule_chunked
    triton = None


def ref_chunk_scan(u, w, qg, qk, kg, g_last, S):
    """The torch loop (delta_rule_chunked's): u [H, N, C, Dv], w, qg, kg [H, N, C, Dk], qk [H, N, C, C],
    g_last [H, N], S [H, Dk, Dv] -> out [H, N, C, Dv], the state after the last piece. Five launches per
    piece (each product and the sum beside it one baddbmm: a prompt chunk on the GPU is bound by the host's
    launches), the pieces' outputs written in place ([N, H, C, Dv], so each piece's block is contiguous)."""
    H, N, C, Dv = u.shape
    out = torch.empty((N, H, C, Dv), dtype=u.dtype, device=u.device)
    kgt = kg.transpose(-1, -2)
    for i in range(N):
        v_new = torch.baddbmm(u[:, i], w[:, i], S, alpha=-1.0)                 # u - w @ S
        torch.baddbmm(torch.bmm(qg[:, i], S), qk[:, i], v_new, out=out[i])     # qg @ S + qk @ v_new
        S = torch.baddbmm(S * g_last[:, i, None, None], kgt[:, i], v_new)     # S g + kg^T v_new
    return out.transpose(0, 1), S


if triton is not None:
    @triton.jit
    def _scan_kernel(u_ptr, w_ptr, qg_ptr, qk_ptr, kg_ptr, gl_ptr, s_ptr, out_ptr, s_out_ptr, N,
                     C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        h = tl.program_id(0)
        vb = tl.program_id(1)
        c = tl.arange(0, C)
        dk = tl.arange(0, DK)
        dv = vb * BV + tl.arange(0, BV)
        hh = h.to(tl.int64)
        S = tl.load(s_ptr + hh * DK * DV + dk[:, None] * DV + dv[None, :])                   # [DK, BV]
        for i in range(N):
            piece = hh * N + i
            wk = piece * C * DK + c[:, None] * DK + dk[None, :]                                # [C, DK] offsets
            uv = piece * C * DV + c[:, None] * DV + dv[None, :]                                # [C, BV] offsets
            v_new = tl.load(u_ptr + uv) - tl.dot(tl.load(w_ptr + wk), S, input_precision="ieee")
            qk = tl.load(qk_ptr + piece * C * C + c[:, None] * C + c[None, :])                 # [C, C]
            o = tl.dot(tl.load(qg_ptr + wk), S, input_precision="ieee") \
                + tl.dot(qk, v_new, input_precision="ieee")
            tl.store(out_ptr + uv, o)
            kg = tl.load(kg_ptr + wk)
            S = S * tl.load(gl_ptr + piece) + tl.dot(tl.trans(kg), v_new, input_precision="ieee")
        tl.store(s_out_ptr + hh * DK * DV + dk[:, None] * DV + dv[None, :], S)


def chunk_scan(u, w, qg, qk, kg, g_last, S, block_v: int = 32, num_warps: int = 4, num_stages: int = 1):
    """ref_chunk_scan in one Triton launch (CUDA, or Triton's interpreter). C, Dk and Dv must be powers of
    two >= 16 (Qwen3.5: 64, 128, 128); everything float32. num_stages 1: a piece's five tiles are ~120 KB of
    float32, more than shared memory holds several times over."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    H, N, C, DV = u.shape
    DK = w.shape[-1]
    for n in (C, DK, DV):
        if n < 16 or n & (n - 1):
            raise ValueError(f"chunk_scan needs powers of two >= 16, got C={C}, Dk={DK}, Dv={DV}")
    if any(t.dtype != torch.float32 for t in (u, w, qg, qk, kg, g_last, S)):
        raise ValueError("chunk_scan works in float32")
    bv = min(block_v, DV)
    args = [t.contiguous() for t in (u, w, qg, qk, kg, g_last, S)]
    out = torch.empty(H, N, C, DV, dtype=torch.float32, device=u.device)
    s_out = torch.empty(H, DK, DV, dtype=torch.float32, device=u.device)
    _scan_kernel[(H, DV // bv)](*args, out, s_out, N, C=C, DK=DK, DV=DV, BV=bv,
                                **(dict(num_warps=num_warps, num_stages=num_stages) if u.is_cuda else {}))
    return out, s_out


def use_chunk_scan(t: torch.Tensor) -> bool:
    """Whether delta_rule_chunked scans with the kernel: CUDA tensors with Triton (USE_KERNEL)."""
    return USE_KERNEL and triton is not None and t.is_cuda


# Off until it has passed tests/kernels/test_gdn_chunk.py's GPU test: its first H200 run (seventh session,
# with Triton's default 3 pipeline stages) stopped with a triton.runtime error at compile or launch, most
# likely shared memory; num_stages is 1 since, not yet run there. The interpreter tests check its values.
USE_KERNEL = False
