"""kernels/quant/prefetch.py: the byte ranges a weight's prefetch asks for, a no-op where it cannot run, and on
a GPU of sm_90+ a launch over unaligned and odd-sized tensors that changes nothing."""
from __future__ import annotations

import pytest
import torch

from kernels.quant import prefetch as P


def test_ranges_are_aligned_and_inside_each_tensor():
    base = torch.zeros(10_000, dtype=torch.uint8)
    views = [base[3:3 + 5000], base[16:16 + 40], base[100:100 + 7], torch.zeros(33, dtype=torch.float16)]
    got = P.ranges(views)
    assert len(got) == 3                                  # 7 bytes hold no aligned 16-byte run
    for (b, first, n), t in zip(got, [views[0], views[1], views[3]]):
        start = b.data_ptr() + first
        assert start % 16 == 0 and n % 16 == 0 and n > 0
        assert b.data_ptr() <= start and start + n <= b.data_ptr() + t.numel() * t.element_size()
        assert b.data_ptr() + t.numel() * t.element_size() - (start + n) < 16


def test_ranges_skip_tensors_that_are_not_contiguous():
    t = torch.zeros(64, 64, dtype=torch.uint8)
    assert P.ranges([t[:, ::2]]) == []


def test_prefetch_is_nothing_on_the_cpu():
    t = torch.arange(4096, dtype=torch.uint8)
    P.prefetch_weight([t, None])
    assert torch.equal(t, torch.arange(4096, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_runs_on_the_gpu_and_changes_nothing():
    """Unaligned views, odd sizes, more pieces than one program covers, in the stream and aside, eagerly and in
    a CUDA graph."""
    if not P.can_prefetch(torch.empty(1, device="cuda")):
        pytest.skip("no bulk prefetch here (sm_90+, PDL on)")
    big = torch.randint(0, 255, (40 << 20,), dtype=torch.uint8, device="cuda")
    keep = big.clone()
    views = [big[5:5 + (17 << 20) + 3], big[(20 << 20):(20 << 20) + 100], big[-77:].view(torch.uint8),
             torch.ones(999, dtype=torch.float16, device="cuda")]
    P.prefetch_weight(views)
    P.prefetch_weight(views, aside=True)
    P.join_prefetches()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        P.prefetch_weight(views)
        P.prefetch_weight(views, aside=True)    # a side stream forked and joined inside the capture
        y = big[:1024].float().sum()
        P.join_prefetches()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(big, keep) and float(y) == float(keep[:1024].float().sum())
