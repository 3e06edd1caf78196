"""The delta rule's torch forms (kernels/gdn/rule.py): the chunkwise-parallel form equals the recurrence,
in float32 and against float64, and a sequence split anywhere with its state carried gives the same result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn.rule import delta_rule_chunked, delta_rule_recurrent, l2_norm



def _delta_inputs(T, H=4, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(T, H, D, generator=g), 1e-6)
    k = l2_norm(torch.randn(T, H, D, generator=g), 1e-6)
    v = torch.randn(T, H, D, generator=g)
    gl = -F.softplus(torch.randn(T, H, generator=g)) * torch.rand(H, generator=g) * 3   # log decay <= 0
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    s0 = torch.randn(H, D, D, generator=g) * 0.3
    return [x.to(dtype) for x in (q, k, v, gl, beta, s0)]


@pytest.mark.parametrize("T", [2, 64, 150])
def test_delta_rule_chunked_equals_recurrent(T):
    args = _delta_inputs(T)
    o_r, s_r = delta_rule_recurrent(*args)
    o_c, s_c = delta_rule_chunked(*args)
    o_64, s_64 = delta_rule_recurrent(*_delta_inputs(T, dtype=torch.float64))
    assert o_c.shape == o_r.shape == (T, 4, 16) and s_c.shape == (4, 16, 16)
    assert (o_c - o_r).abs().max() < 1e-5 and (s_c - s_r).abs().max() < 1e-5
    assert (o_c.double() - o_64).abs().max() < 1e-5 and (s_c.double() - s_64).abs().max() < 1e-5
    # splitting the sequence anywhere and carrying the state gives the same result
    cut = T // 3 + 1
    o1, s1 = delta_rule_chunked(*[x[:cut] for x in args[:5]], args[5], chunk=8)
    o2, s2 = delta_rule_chunked(*[x[cut:] for x in args[:5]], s1, chunk=8) if cut < T else (o1[:0], s1)
    assert (torch.cat([o1, o2]) - o_r).abs().max() < 1e-5 and (s2 - s_r).abs().max() < 1e-5
