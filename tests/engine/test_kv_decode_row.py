"""SequenceKV.attend's one-row path (kernels/cpu/paged_decode.py: the K/V write and attention over the pool's blocks
in place) gives the torch path's bits, step after step: a full-attention layer and a sliding-window layer whose
early blocks are dropped, f16 and bf16 caches, a forked sequence writing into a shared block (copy-on-write), and
the stored K/V the same afterwards."""
from __future__ import annotations

import pytest
import torch

from engine.kv import KVPool, SequenceKV
from engine.kv.pool import LayerKV
from kernels.cpu import paged_decode

needs_numba = pytest.mark.skipif(not paged_decode.available(), reason="numba is not installed")


def _run(cache_type: str, fast: bool, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    monkeypatch.setattr(paged_decode, "supported", (lambda k, v: paged_decode.available()) if fast
                        else (lambda k, v: False))
    W, bs = 24, 8
    pool = KVPool({0: LayerKV(2, 64, 64), 1: LayerKV(2, 64, 64, window=W)}, cache_type, block_size=bs)
    g = torch.Generator().manual_seed(7)
    kv = SequenceKV(2, pool=pool)
    outs = []
    n0 = 21
    for layer, window in ((0, 0), (1, W)):   # a prompt chunk (the torch path either way)
        q, k, v = (torch.randn(n0, h, 64, generator=g) for h in (6, 2, 2))
        outs.append(kv.attend(layer, q, k, v, 0, 0.125, window))
    kv.length = n0
    other = None
    for pos in range(n0, n0 + 40):
        if pos == n0 + 5:
            other = kv.fork()                # shares the current block: the next write copies it
        for layer, window in ((0, 0), (1, W)):
            q, k, v = (torch.randn(1, h, 64, generator=g) for h in (6, 2, 2))
            outs.append(kv.attend(layer, q, k, v, pos, 0.125, window))
            if other is not None and pos < n0 + 10:
                outs.append(other.attend(layer, q * 2, k, v * 3, pos, 0.125, window))
        kv.length = pos + 1
        if other is not None:
            other.length = pos + 1
    stored = [kv.append(layer, n0 + 40, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))[i]
              for layer in (0, 1) for i in (0, 1)]
    return outs, stored


@needs_numba
@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_one_row_attend_gives_the_torch_paths_bits(cache_type, monkeypatch):
    fast_out, fast_kv = _run(cache_type, True, monkeypatch)
    ref_out, ref_kv = _run(cache_type, False, monkeypatch)
    assert len(fast_out) == len(ref_out)
    for a, b in zip(fast_out, ref_out):
        assert torch.equal(a, b)
    for a, b in zip(fast_kv, ref_kv):
        assert torch.equal(a, b)
