"""kernels/cpu/rows.py: the numba RMSNorm, SwiGLU and per-head norm + rope give their torch references' float32 bits
(kernels/fused.py), on rows and heads, with and without weights, both rotary layouts and partial rotary."""
from __future__ import annotations

import pytest
import torch

from kernels import fused
from kernels.cpu import rows

needs_numba = pytest.mark.skipif(not rows.available(), reason="numba is not installed")


def _randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


@needs_numba
@pytest.mark.parametrize("shape", [(1, 576), (37, 960), (4, 9, 64)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_gives_the_references_bits(shape, weighted):
    x = _randn(*shape, scale=3.0, seed=1)
    w = _randn(shape[-1], seed=2) if weighted else None
    for eps in (1e-5, 1e-6):
        assert torch.equal(rows.rms_norm(x, w, eps), fused.ref_rms_norm(x, w, eps))


@needs_numba
def test_rms_norm_takes_strided_input_and_falls_back_for_other_dtypes():
    x = _randn(6, 2 * 576, seed=3)[:, ::2]
    w = _randn(576, seed=4)
    assert torch.equal(rows.rms_norm(x, w, 1e-5), fused.ref_rms_norm(x, w, 1e-5))
    xd = x.double()
    assert torch.equal(rows.rms_norm(xd, w, 1e-5), fused.ref_rms_norm(xd, w, 1e-5))
    assert rows.rms_norm(x, w, 1e-5, torch.float16).dtype == torch.float16


@needs_numba
@pytest.mark.parametrize("n", [1, 3, 64, 100])   # 64 and 100 rows: blocks of 16 rows over the threads
def test_silu_mul_gives_the_references_bits(n):
    gate, up = _randn(n, 1536, scale=4.0, seed=5), _randn(n, 1536, seed=6)
    assert torch.equal(rows.silu_mul(gate, up), fused.ref_silu_mul(gate, up))
    big = torch.tensor([[-1e4, 1e4, -80.0, 0.0, -0.0, 1e-30]])
    assert torch.equal(rows.silu_mul(big, big), fused.ref_silu_mul(big, big))


@needs_numba
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_qk_norm_rope_gives_the_references_bits(neox, weighted, rope_dim):
    x = _randn(5, 9, 64, scale=2.0, seed=7)
    w = _randn(64, seed=8) if weighted else None
    pos = torch.arange(100, 105, dtype=torch.float64)[:, None]
    theta = pos * 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    cos, sin = theta.cos().float(), theta.sin().float()
    got = rows.qk_norm_rope(x, w, 1e-6, cos, sin, rope_dim, neox)
    assert torch.equal(got, fused.ref_qk_norm_rope(x, w, 1e-6, cos, sin, rope_dim, neox))
    strided = _randn(5, 9, 128, seed=9)[..., :64]    # qwen35's Q: a view of the joint Q|gate projection
    assert torch.equal(rows.qk_norm_rope(strided, w, 1e-6, cos, sin, rope_dim, neox),
                       fused.ref_qk_norm_rope(strided, w, 1e-6, cos, sin, rope_dim, neox))
