"""The prompt-chunk attention through torch's FlashAttention-2 (kernels/attention/flash.py) against a
plain masked softmax: a chunk at depth (bottom-right causal alignment), grouped K/V heads, sliding
window. GPU only (the kernel exists only in CUDA builds); the CPU check is that it declines."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.flash import flash_chunk_attention, flash_fits


def _reference(q, k, v, scale, window):
    T, H, _ = q.shape
    end, hkv = k.shape[0], k.shape[1]
    qpos = torch.arange(end - T, end, device=q.device)[:, None]
    kpos = torch.arange(end, device=q.device)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= qpos - kpos < window
    kk = k.float().repeat_interleave(H // hkv, 1)
    vv = v.float().repeat_interleave(H // hkv, 1)
    s = torch.einsum("thd,khd->htk", q.float(), kk) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htk,khd->thd", s.softmax(-1), vv)


def test_flash_declines_cpu_and_odd_shapes():
    q = torch.randn(4, 2, 64, dtype=torch.float16)
    assert not flash_fits(q, q, q)
    if torch.cuda.is_available():
        c = q.cuda()
        assert not flash_fits(c, c.float(), c.float())                      # float32 K/V
        assert not flash_fits(torch.randn(4, 2, 320, device="cuda", dtype=torch.float16), c, c)


@pytest.mark.gpu
@pytest.mark.parametrize("T,end,H,hkv,d,window", [
    (512, 512, 6, 1, 256, 0), (512, 23552, 24, 4, 256, 0), (37, 1000, 8, 2, 128, 0),
    (300, 2000, 4, 1, 256, 512), (1, 700, 6, 2, 64, 0)])
def test_flash_chunk_matches_masked_softmax(T, end, H, hkv, d, window):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, H, d, device="cuda", generator=g, dtype=torch.float16)
    k = torch.randn(end, hkv, d, device="cuda", generator=g, dtype=torch.float16)
    v = torch.randn(end, hkv, d, device="cuda", generator=g, dtype=torch.float16)
    assert flash_fits(q, k, v)
    scale = d ** -0.5
    out = flash_chunk_attention(q, k, v, scale, window).float()
    ref = _reference(q, k, v, scale, window)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 2e-3


def test_pieces_merged_by_lse_equal_one_attention():
    """attention_lse over key pieces, merged, equals the attention over all keys (causal in the last piece,
    which holds the queries' own positions)."""
    from kernels.attention.flash import attention_lse, merge_attention
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 6, 32, generator=g)
    k = torch.randn(40, 2, 32, generator=g)
    v = torch.randn(40, 2, 32, generator=g)
    want = _reference(q, k, v, 0.2, 0)
    acc = None
    for lo, hi in ((24, 40), (10, 24), (0, 10)):
        acc = merge_attention(acc, attention_lse(q, k[lo:hi], v[lo:hi], 0.2, causal=hi == 40))
    assert (acc[0] - want).abs().max() < 1e-5
    whole = attention_lse(q, k, v, 0.2, causal=True)
    assert (acc[1] - whole[1]).abs().max() < 1e-5


@pytest.mark.gpu
def test_flash_lse_matches_the_math():
    """FlashAttention's log-sum-exp is what attention_lse promises (the runner checks it once per device
    and falls back to the paged kernel otherwise): here it must hold on the machine's torch."""
    from kernels.attention.flash import _flash_lse, attention_lse_reference, flash_lse_works
    assert flash_lse_works(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(2)
    for T, L, causal in ((512, 8192, True), (300, 8192, False), (1, 700, True)):
        q = torch.randn(T, 24, 256, device="cuda", generator=g, dtype=torch.float16)
        k = torch.randn(L, 4, 256, device="cuda", generator=g, dtype=torch.float16)
        v = torch.randn(L, 4, 256, device="cuda", generator=g, dtype=torch.float16)
        o, lse = _flash_lse(q, k, v, 0.0625, causal)
        ro, rl = attention_lse_reference(q, k, v, 0.0625, causal)
        assert (o - ro).abs().max() < 2e-3 and (lse - rl).abs().max() < 2e-3
