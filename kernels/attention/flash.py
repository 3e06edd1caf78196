"""A prompt chunk's attention over a contiguous float K/V with torch's FlashAttention-2 kernel.

The chunk's T queries sit at positions end - T .. end - 1 and see every earlier key (causal inside
the chunk, aligned to the bottom right: query i sees keys 0 .. end - T + i), optionally only the last
`window` of them. FlashAttention-2 reads grouped K/V heads itself (GQA), so neither a mask nor
repeated K/V heads are materialized, unlike torch's scaled_dot_product_attention with a boolean mask.
"""
from __future__ import annotations

import torch


def flash_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CUDA sm80+, fp16/bf16 K/V, one head size for q, K and
    V that is a multiple of 8 up to 256, query heads a multiple of K/V heads."""
    d = q.shape[-1]
    if not (q.is_cuda and k.dtype in (torch.float16, torch.bfloat16) and k.shape[-1] == v.shape[-1] == d):
        return False
    if d % 8 or d > 256 or q.shape[-2] % k.shape[-2]:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 8


def flash_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int = 0) -> torch.Tensor:
    """q [T, H, D] in K's dtype, k / v [end, Hkv, D] (every key up to the chunk's last position);
    returns [T, H, D] in K's dtype."""
    T, end = q.shape[0], k.shape[0]
    left = window - 1 if window else None
    out = torch.ops.aten._flash_attention_forward(
        q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), None, None, T, end, 0.0, True,
        False, scale=scale, window_size_left=left, window_size_right=0 if window else None)[0]
    return out[0]
