"""The chunkwise-parallel delta rule (kernels/gdn/rule.py: delta_rule_chunked, its scan in
kernels/gdn/chunk.py) against the one-token-at-a-time recurrence at Qwen3.5-27B's sizes on a GPU (the
CPU's small-size cases are tests/engine/test_qwen35.py's)."""
from __future__ import annotations

import pytest
import torch

from kernels.gdn.rule import delta_rule_chunked, delta_rule_recurrent, l2_norm


def _delta_inputs(T, H, D, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(T, H, D, generator=g), 1e-6).to(device)
    k = l2_norm(torch.randn(T, H, D, generator=g), 1e-6).to(device)
    v = torch.randn(T, H, D, generator=g).to(device)
    gl = (-torch.rand(T, H, generator=g) * 0.5).to(device)
    beta = torch.sigmoid(torch.randn(T, H, generator=g)).to(device)
    S = (torch.randn(H, D, D, generator=g) * 0.1).to(device)
    return q, k, v, gl, beta, S


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_rule_real_sizes_gpu():
    """A 27B-sized head dimension (128), 8 of its 48 heads, 200 tokens (4 pieces, the last ragged)."""
    q, k, v, gl, beta, S0 = _delta_inputs(200, 8, 128, seed=3, device="cuda")
    o, S1 = delta_rule_chunked(q, k, v, gl, beta, S0)
    o_r, S_r = delta_rule_recurrent(q, k, v, gl, beta, S0)
    torch.testing.assert_close(o, o_r, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(S1, S_r, rtol=1e-3, atol=1e-3)
