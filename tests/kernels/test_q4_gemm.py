"""The 4-bit Triton matmul: repacking is exact (up to fp16 scale products), the kernel matches the
torch reference for every M shape, and a row's result does not depend on the other rows.
On the CPU the kernel runs in Triton's interpreter (small shapes); on a GPU natively (27B shapes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

triton = pytest.importorskip("triton")

from kernels.quant.q4_gemm import dequant_packed_ref, pack_q4, q4_matmul  # noqa: E402
from kernels.quant.ref import dequantize  # noqa: E402

BLOCK = {QT.Q4_K: (144, 256), QT.Q4_0: (18, 32), QT.Q4_1: (20, 32)}


def _random_weight(qtype, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs, nb = BLOCK[qtype]
    raw = torch.randint(0, 256, (n * k // nb * bs,), dtype=torch.uint8, generator=g)
    blk = raw.view(-1, bs)
    rng = np.random.default_rng(seed)
    fields = 1 if qtype == QT.Q4_0 else 2
    for f in range(fields):  # finite, modest fp16 scales
        blk.view(torch.int16)[:, f] = torch.from_numpy((rng.random(blk.shape[0]) * 0.01).astype(np.float16)).view(torch.int16)
    return raw


@pytest.mark.parametrize("qtype", list(BLOCK))
def test_pack_matches_gguf_dequant(qtype):
    n, k = 48, 512
    raw = _random_weight(qtype, n, k)
    ref = dequantize(raw, qtype, (n, k))
    packed = dequant_packed_ref(pack_q4(raw, qtype, n, k))
    if qtype == QT.Q4_K:  # scale products rounded to fp16
        assert torch.allclose(packed, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    else:
        assert torch.equal(packed, ref)


@pytest.mark.parametrize("qtype", list(BLOCK))
@pytest.mark.parametrize("m", [1, 3, 16, 21])
def test_kernel_matches_reference(qtype, m):
    n, k = 64, 512
    p = pack_q4(_random_weight(qtype, n, k, seed=m), qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = q4_matmul(x, p, block_n=32, block_k=256, split_k=2)
    ref = x.half().float() @ dequant_packed_ref(p).T
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_do_not_depend_on_batch(device):
    """A row's result does not depend on the other rows: bit for bit on CUDA. Under Triton's interpreter
    (the CPU) tl.dot is numpy's matmul, whose summation order changes with the rows a program holds on
    some CPUs (seen on 2 AVX2 cores), so there the rows agree to float32 rounding."""
    n, k = 64, 512
    p = pack_q4(_random_weight(QT.Q4_K, n, k).to(device), QT.Q4_K, n, k)
    x = torch.randn(20, k).to(device)
    full = q4_matmul(x, p, block_n=32, block_k=256)
    for lo, hi in [(0, 1), (3, 4), (5, 12), (0, 20)]:
        part = q4_matmul(x[lo:hi], p, block_n=32, block_k=256)
        if device == "cuda":
            assert torch.equal(part, full[lo:hi])
        else:
            assert torch.allclose(part, full[lo:hi], rtol=1e-6, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(17408, 5120), (5120, 17408), (12288, 5120)])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_kernel_27b_shapes_on_gpu(n, k, m):
    raw = _random_weight(QT.Q4_K, n, k).cuda()
    p = pack_q4(raw, QT.Q4_K, n, k)
    x = torch.randn(m, k, device="cuda")
    y = q4_matmul(x, p)
    ref = x.half().float() @ dequant_packed_ref(p).T
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-3
