"""kernels/cpu/causal.py: a prompt chunk's causal attention in numba gives kernels/attention/ref.py's float32 bits
(GQA, a chunk after earlier keys, sliding windows, dropped first blocks, odd sizes), on one thread and on two, and
takes the reference for what it does not compute."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.ref import causal_attention as ref
from kernels.cpu import causal

needs_numba = pytest.mark.skipif(not causal.available(), reason="numba is not installed")


def _qkv(T, before, H, Hkv, D, Dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g) * 2
    k = torch.randn(before + T, Hkv, D, generator=g) * 2
    v = torch.randn(before + T, Hkv, Dv, generator=g)
    return q, k, v


@needs_numba
@pytest.mark.parametrize("T,before,H,Hkv,D,Dv,window,k_start", [
    (512, 0, 9, 3, 64, 64, 0, 0),        # the demo model's first prompt chunk
    (37, 100, 4, 1, 16, 16, 0, 0),       # a chunk after earlier keys, one KV head
    (64, 64, 8, 8, 32, 24, 40, 0),       # a sliding window, V heads narrower than K
    (16, 48, 2, 2, 8, 8, 5, 16),         # keys from position 16 on (a window's dropped first block)
    (1, 20, 4, 2, 16, 16, 0, 0),         # one row
])
def test_causal_attention_gives_the_references_bits(T, before, H, Hkv, D, Dv, window, k_start):
    q, k, v = _qkv(T, before, H, Hkv, D, Dv, seed=T + before)
    k, v = k[k_start:], v[k_start:]
    want = ref(q, k, v, before, 0.125, window, k_start=k_start)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = causal.causal_attention(q, k, v, before, 0.125, window, k_start=k_start)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


def test_what_the_kernel_does_not_take_goes_to_the_reference():
    q, k, v = _qkv(8, 8, 4, 2, 16, 16, seed=1)
    spans = [(2, 6)]
    assert torch.equal(causal.causal_attention(q, k, v, 8, 0.3, bidirectional=spans),
                       ref(q, k, v, 8, 0.3, bidirectional=spans))
    bias = torch.randn(8, 4, 1)
    assert torch.equal(causal.causal_attention(q, k, v, 8, 0.3, seg_bias=bias, seg_len=256),
                       ref(q, k, v, 8, 0.3, seg_bias=bias, seg_len=256))
    qd, kd, vd = q.double(), k.double(), v.double()
    assert torch.equal(causal.causal_attention(qd, kd, vd, 8, 0.3), ref(qd, kd, vd, 8, 0.3))


@pytest.mark.parametrize("name,window", [("f16", 0), ("bf16", 0), ("f32", 24), ("q8_0", 0)])
def test_paged_attention_gives_the_references_bits(name, window):
    """A runner slot's prompt chunk (20 rows after 37 positions) over scattered blocks: ref_paged_attention's bits,
    the 16-bit and f32 caches through the kernel, q8_0 through the reference's float path."""
    from kernels.attention.ref import ref_paged_attention
    from kernels.kvcodec import get_codec
    codec = get_codec(name)
    g = torch.Generator().manual_seed(len(name) + window)
    H, Hkv, D, nb, start, T = 6, 2, 32, 8, 37, 20
    x = torch.randn(nb * 16, Hkv, D, generator=g)
    kc = codec.encode(x).view(nb, 16, Hkv, -1)
    vc = codec.encode(torch.randn(nb * 16, Hkv, D, generator=g)).view(nb, 16, Hkv, -1)
    table = torch.randperm(nb, generator=g).to(torch.int32)
    q = torch.randn(T, H, D, generator=g)
    got = causal.paged_attention(q, kc, vc, table, start, codec, codec, 0.2, D, window)
    want = ref_paged_attention(q, kc, vc, table, start, codec, codec, 0.2, D, window)
    assert got.shape == (T, H, D) and torch.equal(got, want)
