"""The gated delta rule's torch forms, for one sequence's run of tokens: one token at a time
(`delta_rule_recurrent`, the reference of every delta-rule kernel in kernels/gdn) and chunkwise-parallel
(`delta_rule_chunked`, what long prompt chunks take; its scan in chunk.py), and the L2 norm q and k get before
it. Qwen3.5's Gated DeltaNet (engine/models/qwen35.py) runs them through block.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gdn.chunk import chunk_scan

GDN_CHUNK = 64  # chunk size of the chunkwise-parallel delta rule (llama.cpp and HF use 64)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (llama.cpp build_gdn_l2_norm, FLA's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, one token at a time. q, k [T, H, Dk] (already L2-normed, q not yet
    scaled), v [T, H, Dv], g (log decay, <= 0) and beta [T, H], state [H, Dk, Dv].
    Returns o [T, H, Dv] and the new state."""
    q = q * q.shape[-1] ** -0.5
    S = state
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out), S


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = GDN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `delta_rule_recurrent`, in the chunkwise-parallel form (as llama.cpp's
    build_delta_net_chunking and HF's torch_chunk_gated_delta_rule): within a chunk of C tokens the
    delta-rule updates are condensed by the UT transform T = (I + strict_lower(diag(beta) K K^T * D))^-1
    (D the pairwise decays), then chunks are scanned sequentially through the state."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    q = q * Dk ** -0.5
    pad = (-T) % chunk
    n_chunks = (T + pad) // chunk

    def prep(x):  # [T, H, ...] -> [H, n_chunks, C, ...], zero-padded at the end
        x = x.transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad)) if x.ndim == 3 else F.pad(x, (0, pad))
        return x.reshape(H, n_chunks, chunk, *x.shape[2:])

    q, k, v, g, beta = prep(q), prep(k), prep(v), prep(g), prep(beta)
    kb = k * beta[..., None]
    vb = v * beta[..., None]
    gc = g.cumsum(-1)                                              # [H, N, C] log decay since chunk start
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # [H, N, C, C]
    lower = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = lower + eye
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)                      # [H,N,C,Dv]
    w = torch.linalg.solve_triangular(system, kb * gc.exp()[..., None], upper=False, unitriangular=True)  # [H,N,C,Dk]
    qk = (q @ k.transpose(-1, -2)) * decay                          # intra-chunk attention (causal, incl. diag)
    qg = q * gc.exp()[..., None]
    kg = k * (gc[..., -1:] - gc).exp()[..., None]
    g_last = gc[..., -1].exp()                                      # [H, N]
    # the scan through the state, piece by piece (kernels/gdn/chunk.py)
    out, S = chunk_scan(u, w, qg, qk, kg, g_last, state)                  # [H, N, C, Dv] (a view of any layout)
    o = out.permute(1, 2, 0, 3).reshape(n_chunks * chunk, H, Dv)[:T]   # [T, H, Dv]: one copy
    return o.contiguous(), S
