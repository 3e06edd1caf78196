"""A prompt chunk's attention over a contiguous float K/V with torch's FlashAttention-2 kernel; and the
same over several pieces of keys (`attention_lse` per piece, `merge_attention` to combine them), which
engine/runner/attention.py uses for compressed caches decoded a piece at a time.

The chunk's T queries sit at positions end - T .. end - 1 and see every earlier key (causal inside
the chunk, aligned to the bottom right: query i sees keys 0 .. end - T + i), optionally only the last
`window` of them. FlashAttention-2 reads grouped K/V heads itself (GQA), so neither a mask nor
repeated K/V heads are materialized, unlike torch's scaled_dot_product_attention with a boolean mask.
"""
from __future__ import annotations

import torch


def flash_supported(device: torch.device, head_dim: int) -> bool:
    """Whether the kernel runs there for this head size: CUDA sm80+, a multiple of 8 up to 256."""
    return (device.type == "cuda" and head_dim % 8 == 0 and head_dim <= 256
            and torch.cuda.get_device_capability(device)[0] >= 8)


def flash_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: flash_supported, fp16/bf16 K/V, one head size for q, K
    and V, query heads a multiple of K/V heads."""
    d = q.shape[-1]
    if k.dtype not in (torch.float16, torch.bfloat16) or not k.shape[-1] == v.shape[-1] == d:
        return False
    return q.shape[-2] % k.shape[-2] == 0 and flash_supported(q.device, d)


def _flash(q, k, v, scale, causal, window=0):
    """torch's FlashAttention-2 on one sequence: (out [T, H, D] in K's dtype, lse [H, T] float32)."""
    left = window - 1 if window else None
    out, lse = torch.ops.aten._flash_attention_forward(
        q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), None, None, q.shape[0], k.shape[0],
        0.0, causal, False, scale=scale, window_size_left=left, window_size_right=0 if window else None)[:2]
    return out[0], lse[0]


def flash_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int = 0) -> torch.Tensor:
    """q [T, H, D] in K's dtype, k / v [end, Hkv, D] (every key up to the chunk's last position);
    returns [T, H, D] in K's dtype."""
    return _flash(q, k, v, scale, True, window)[0]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, H, D] over k / v [L, Hkv, D] (all keys visible, or causal aligned to the bottom
    right) with each query's log-sum-exp of its scaled scores: (out [T, H, D] float32, lse [T, H] float32).
    FlashAttention-2 where it takes the tensors, else plain torch math (small shapes: tests)."""
    if flash_fits(q, k, v) and flash_lse_works(q.device):
        return _flash_lse(q, k, v, scale, causal)
    return attention_lse_reference(q, k, v, scale, causal)


def _flash_lse(q, k, v, scale, causal):
    out, lse = _flash(q, k, v, scale, causal)
    return out.float(), lse.transpose(0, 1).float()


def attention_lse_reference(q, k, v, scale, causal):
    T, H, _ = q.shape
    L, hkv = k.shape[0], k.shape[1]
    kk = k.float().repeat_interleave(H // hkv, 1)
    vv = v.float().repeat_interleave(H // hkv, 1)
    s = torch.einsum("thd,lhd->htl", q.float(), kk) * scale
    if causal:
        qpos = torch.arange(L - T, L, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > qpos, float("-inf"))
    lse = torch.logsumexp(s, -1)                                         # [H, T]
    out = torch.einsum("htl,lhd->thd", torch.exp(s - lse[..., None]), vv)
    return out, lse.transpose(0, 1)


def merge_attention(a: tuple[torch.Tensor, torch.Tensor] | None,
                    b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over two disjoint key sets from each set's (out [T, H, D], lse [T, H]): the outputs
    weighted by exp(lse), and the union's lse. a may be None (nothing yet)."""
    if a is None:
        return b
    (oa, la), (ob, lb) = a, b
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    tot = wa + wb
    return (wa[..., None] * oa + wb[..., None] * ob) / tot[..., None], m + torch.log(tot)


_LSE_CHECKED: dict[str, bool] = {}


def flash_lse_works(device: torch.device) -> bool:
    """Whether this torch's FlashAttention returns what attention_lse expects (its log-sum-exp layout and
    units are not a public contract): checked once per device on a small problem against the torch math."""
    key = str(device)
    if key not in _LSE_CHECKED:
        g = torch.Generator(device=device).manual_seed(0)
        ok = True
        for T, L, causal in ((5, 40, True), (1, 33, True), (7, 50, False)):
            q = torch.randn(T, 4, 64, device=device, generator=g, dtype=torch.float16)
            k = torch.randn(L, 2, 64, device=device, generator=g, dtype=torch.float16)
            v = torch.randn(L, 2, 64, device=device, generator=g, dtype=torch.float16)
            try:
                o, lse = _flash_lse(q, k, v, 0.125, causal)
            except (RuntimeError, TypeError):
                ok = False
                break
            ro, rl = attention_lse_reference(q, k, v, 0.125, causal)
            ok &= o.shape == ro.shape and lse.shape == rl.shape
            ok &= bool((o - ro).abs().max() < 1e-2) and bool((lse - rl).abs().max() < 1e-2)
        _LSE_CHECKED[key] = bool(ok)
    return _LSE_CHECKED[key]
