"""Gated DeltaNet decode step (kernels/gdn): the torch reference against qwen35's own single-token
math (conv as `_gated_delta_net` does it, `l2_norm`, `delta_rule_recurrent`), several slots with
distinct states and a padding row; the Triton kernel (interpreter on the CPU) against the
reference over consecutive steps, so the carried conv window and S are checked; real Qwen3.5
sizes and CUDA-graph capture on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn.rule import delta_rule_recurrent, l2_norm
from kernels.gdn import gdn_decode, ref_gdn_decode

K = 4
EPS = 1e-6


def _state(n_slots, Hk, Hv, D, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    C = (2 * Hk + Hv) * D
    conv_w = torch.randn(C, K, generator=gen) * 0.5
    conv_state = torch.randn(n_slots, K - 1, C, generator=gen)
    S = torch.randn(n_slots, Hv, D, D, generator=gen) * 0.3
    return conv_w.to(device), conv_state.to(device), S.to(device)


def _inputs(B, Hk, Hv, D, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    C = (2 * Hk + Hv) * D
    qkv = torch.randn(B, C, generator=gen)
    g = F.softplus(torch.randn(B, Hv, generator=gen)) * -torch.rand(Hv, generator=gen).add(0.1)  # log decay <= 0
    beta = torch.sigmoid(torch.randn(B, Hv, generator=gen))
    return qkv.to(device), g.to(device), beta.to(device)


def _qwen35_step(qkv_row, conv_w, conv_state, S, g_row, beta_row, Hk, Hv, D):
    """One token of one sequence, exactly as Qwen35Model._gated_delta_net for m == 1."""
    key_dim, m = Hk * D, 1
    xin = torch.cat([conv_state, qkv_row[None]], dim=0)                    # [K-1+m, conv_dim]
    conv = F.silu((xin.unfold(0, K, 1) * conv_w).sum(-1))                   # [m, conv_dim]
    q = l2_norm(conv[:, :key_dim].reshape(m, Hk, D), EPS)
    k = l2_norm(conv[:, key_dim:2 * key_dim].reshape(m, Hk, D), EPS)
    v = conv[:, 2 * key_dim:].reshape(m, Hv, D)
    if Hv != Hk:
        q = q.repeat(1, Hv // Hk, 1)
        k = k.repeat(1, Hv // Hk, 1)
    o, S_new = delta_rule_recurrent(q, k, v, g_row[None], beta_row[None], S)
    return o[0], xin[-(K - 1):].clone(), S_new


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
def test_ref_matches_qwen35(Hk, Hv):
    D, n_slots = 16, 6
    slots = torch.tensor([3, -1, 0, 5])
    conv_w, conv_state, S = _state(n_slots, Hk, Hv, D, seed=1)
    exp_cs, exp_S = conv_state.clone(), S.clone()
    for step in range(2):
        qkv, g, beta = _inputs(len(slots), Hk, Hv, D, seed=10 + step)
        o = ref_gdn_decode(qkv, conv_w, conv_state, S, slots, g, beta, Hk, D, EPS)
        for b, s in enumerate(slots.tolist()):
            if s < 0:
                assert torch.equal(o[b], torch.zeros(Hv, D))
                continue
            o_e, exp_cs[s], exp_S[s] = _qwen35_step(qkv[b], conv_w, exp_cs[s], exp_S[s], g[b], beta[b], Hk, Hv, D)
            torch.testing.assert_close(o[b], o_e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(conv_state, exp_cs, rtol=0, atol=0)
        torch.testing.assert_close(S, exp_S, rtol=1e-5, atol=1e-6)
    untouched = [1, 2, 4]
    _, cs0, S0 = _state(n_slots, Hk, Hv, D, seed=1)
    assert torch.equal(conv_state[untouched], cs0[untouched]) and torch.equal(S[untouched], S0[untouched])


def test_auto_is_ref_on_cpu():
    Hk, Hv, D = 2, 4, 16
    slots = torch.tensor([1, 0], dtype=torch.int32)
    conv_w, cs, S = _state(2, Hk, Hv, D, seed=2)
    cs2, S2 = cs.clone(), S.clone()
    qkv, g, beta = _inputs(2, Hk, Hv, D, seed=3)
    o = gdn_decode(qkv, conv_w, cs, S, slots, g, beta, Hk, D, EPS)
    o2 = ref_gdn_decode(qkv, conv_w, cs2, S2, slots, g, beta, Hk, D, EPS)
    assert torch.equal(o, o2) and torch.equal(cs, cs2) and torch.equal(S, S2)


def _compare(Hk, Hv, D, slots, n_slots, steps, device="cpu", tol=1e-5, **kw):
    conv_w, cs_t, S_t = _state(n_slots, Hk, Hv, D, seed=4, device=device)
    cs_r, S_r = cs_t.clone(), S_t.clone()
    for step in range(steps):
        qkv, g, beta = _inputs(len(slots), Hk, Hv, D, seed=20 + step, device=device)
        o_t = gdn_decode(qkv, conv_w, cs_t, S_t, slots, g, beta, Hk, D, EPS, impl="triton", **kw)
        o_r = ref_gdn_decode(qkv, conv_w, cs_r, S_r, slots, g, beta, Hk, D, EPS)
        torch.testing.assert_close(o_t, o_r, rtol=tol, atol=tol)
        torch.testing.assert_close(cs_t, cs_r, rtol=0, atol=0)
        torch.testing.assert_close(S_t, S_r, rtol=tol, atol=tol)
        pad = (slots < 0).nonzero().squeeze(1)
        assert torch.equal(o_t[pad], torch.zeros_like(o_t[pad]))


@pytest.mark.parametrize("D,slots,block_v", [
    (16, torch.tensor([2, 0, 5]), None),                        # int64 slots, one v-slice per head
    (32, torch.tensor([4, -1, 1], dtype=torch.int32), 8),      # int32 slots, padding row, 4 v-slices
])
def test_triton_matches_ref(D, slots, block_v):
    _compare(2, 4, D, slots, n_slots=6, steps=3, block_v=block_v)


def test_triton_makes_the_gates_from_raw_projections():
    """gate=(dt_bias, a): the kernel takes the raw projections (strided views of a stacked product, as
    the engine passes them) and makes g = softplus(alpha x + dt_bias) * a and beta = sigmoid(beta x)
    itself: the reference fed with gdn_gates' values, over 3 steps; softplus over its whole range
    (large negative, around the threshold 20, large positive)."""
    Hk, Hv, D = 2, 4, 16
    slots = torch.tensor([3, -1, 0])
    conv_w, cs_t, S_t = _state(4, Hk, Hv, D, seed=6)
    cs_r, S_r = cs_t.clone(), S_t.clone()
    gen = torch.Generator().manual_seed(7)
    dt, a = torch.randn(Hv, generator=gen), -torch.rand(Hv, generator=gen).add(0.1)
    from kernels.gdn.recurrent import gdn_gates
    for step, scale in enumerate((1.0, 8.0, 30.0)):
        C = (2 * Hk + Hv) * D
        stacked = torch.randn(3, C + 2 * Hv + 5, generator=gen)
        stacked[:, C:C + 2 * Hv] *= scale
        qkv, beta_x, alpha_x = stacked[:, :C], stacked[:, C:C + Hv], stacked[:, C + Hv:C + 2 * Hv]
        o_t = gdn_decode(qkv, conv_w, cs_t, S_t, slots, alpha_x, beta_x, Hk, D, EPS, impl="triton", gate=(dt, a))
        g, beta = gdn_gates(alpha_x, beta_x, dt, a)
        o_r = ref_gdn_decode(qkv, conv_w, cs_r, S_r, slots, g, beta, Hk, D, EPS)
        torch.testing.assert_close(o_t, o_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S_t, S_r, rtol=1e-5, atol=1e-5)
        assert torch.equal(gdn_decode(qkv, conv_w, cs_r.clone(), S_r.clone(), slots, alpha_x, beta_x, Hk, D, EPS,
                                      impl="ref", gate=(dt, a)),
                           ref_gdn_decode(qkv, conv_w, cs_r.clone(), S_r.clone(), slots, g, beta, Hk, D, EPS))
    with pytest.raises(ValueError, match="gate must be"):
        gdn_decode(qkv, conv_w, cs_t, S_t, slots, alpha_x, beta_x, Hk, D, EPS, impl="triton", gate=(dt[:2], a))


# ---------------------------------------------------------------------------------------------
# GPU: Qwen3.5 sizes (Hk = 16, Hv = 48, D = 128)

QWEN = dict(Hk=16, Hv=48, D=128)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4, 16])
def test_triton_real_sizes_gpu(B):
    slots = torch.randperm(2 * B + 1, generator=torch.Generator().manual_seed(B))[:B]
    if B > 1:
        slots[-1] = -1
    _compare(**QWEN, slots=slots.to(torch.int32).cuda(), n_slots=2 * B + 1, steps=3, device="cuda", tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4, 16])
def test_triton_cuda_graph(B):
    """Captured once with static buffers, replayed for 3 steps with new inputs copied in."""
    Hk, Hv, D = QWEN["Hk"], QWEN["Hv"], QWEN["D"]
    n_slots = B + 2
    slots = torch.arange(B, dtype=torch.int32, device="cuda").flip(0) + 1
    if B > 1:
        slots[1] = -1
    conv_w, cs_t, S_t = _state(n_slots, Hk, Hv, D, seed=5, device="cuda")
    cs_r, S_r = cs_t.clone(), S_t.clone()
    qkv, g, beta = _inputs(B, Hk, Hv, D, seed=30, device="cuda")
    # warm up (compiles) on throwaway state, then capture
    gdn_decode(qkv, conv_w, cs_t.clone(), S_t.clone(), slots, g, beta, Hk, D, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = gdn_decode(qkv, conv_w, cs_t, S_t, slots, g, beta, Hk, D, EPS)
    # capture does not run the kernels: cs_t/S_t are still the initial state
    for step in range(3):
        q2, g2, b2 = _inputs(B, Hk, Hv, D, seed=40 + step, device="cuda")
        qkv.copy_(q2)
        g.copy_(g2)
        beta.copy_(b2)
        graph.replay()
        o_r = ref_gdn_decode(q2, conv_w, cs_r, S_r, slots, g2, b2, Hk, D, EPS)
        torch.testing.assert_close(o_static, o_r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cs_t, cs_r, rtol=0, atol=0)
        torch.testing.assert_close(S_t, S_r, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16])
def test_triton_raw_gates_gpu(B):
    """The engine's decode call at Qwen3.5 sizes: raw projections and (dt_bias, a) in, as the reference."""
    from kernels.gdn.recurrent import gdn_gates
    Hk, Hv, D = QWEN["Hk"], QWEN["Hv"], QWEN["D"]
    slots = torch.arange(B, dtype=torch.int64, device="cuda")
    conv_w, cs_t, S_t = _state(B, Hk, Hv, D, seed=8, device="cuda")
    cs_r, S_r = cs_t.clone(), S_t.clone()
    gen = torch.Generator().manual_seed(9)
    dt, a = torch.randn(Hv, generator=gen).cuda(), -torch.rand(Hv, generator=gen).add(0.1).cuda()
    for step in range(3):
        qkv, _, _ = _inputs(B, Hk, Hv, D, seed=50 + step, device="cuda")
        ab = (torch.randn(B, 2 * Hv, generator=gen) * 4).cuda()
        o_t = gdn_decode(qkv, conv_w, cs_t, S_t, slots, ab[:, :Hv], ab[:, Hv:], Hk, D, EPS, gate=(dt, a))
        g, beta = gdn_gates(ab[:, :Hv], ab[:, Hv:], dt, a)
        o_r = ref_gdn_decode(qkv, conv_w, cs_r, S_r, slots, g, beta, Hk, D, EPS)
        torch.testing.assert_close(o_t, o_r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(S_t, S_r, rtol=1e-4, atol=1e-4)
