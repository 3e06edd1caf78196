"""The sequential part of Qwen3.5's chunkwise-parallel delta rule (engine/models/qwen35.py:
delta_rule_chunked): the scan of a prompt chunk's 64-token pieces through the state.

Per head, with the pieces' precomputed terms (u, w from the UT transform, qg, qk, kg, g_last), piece i:

    v_new = u[i] - w[i] @ S
    out[i] = qg[i] @ S + qk[i] @ v_new
    S = S * g_last[i] + kg[i]^T @ v_new

Five launches per piece (40 per layer for a 512-token chunk). These stay torch: prompt chunks run as CUDA
graphs (engine/runner_prefill.py), which makes the launches cheap, and a one-launch Triton version (one
program per head and block of state columns, float32 dots without tensor cores) gave wrong values at the
27B's sizes on the H200 and took 2.3x the kernel time of a whole prompt chunk's torch loops
(docs/decisions/).
"""
from __future__ import annotations

import torch


def chunk_scan(u, w, qg, qk, kg, g_last, S):
    """u [H, N, C, Dv], w, qg, kg [H, N, C, Dk], qk [H, N, C, C], g_last [H, N], S [H, Dk, Dv] -> out
    [H, N, C, Dv], the state after the last piece. Each product and the sum beside it is one baddbmm; the
    pieces' outputs are written in place ([N, H, C, Dv], so each piece's block is contiguous)."""
    H, N, C, Dv = u.shape
    out = torch.empty((N, H, C, Dv), dtype=u.dtype, device=u.device)
    kgt = kg.transpose(-1, -2)
    for i in range(N):
        v_new = torch.baddbmm(u[:, i], w[:, i], S, alpha=-1.0)                 # u - w @ S
        torch.baddbmm(torch.bmm(qg[:, i], S), qk[:, i], v_new, out=out[i])     # qg @ S + qk @ v_new
        S = torch.baddbmm(S * g_last[:, i, None, None], kgt[:, i], v_new)     # S g + kg^T v_new
    return out.transpose(0, 1), S
