"""A drafting step's Gated DeltaNet (kernels/gdn/verify.py): its rows' outputs and the states after the commit of
the accepted rows equal successive one-row decode steps (gdn_decode) - to the bit, for the reference and for the
Triton kernels (interpreter on the CPU; real sizes on a GPU); slots without drafts are updated as by decode,
multi-row slots not until the commit; the layout of a step's rows."""
from __future__ import annotations

import pytest
import torch

from kernels.gdn import gdn_decode
from kernels.gdn.verify import delta_block_v, draft_layout, gdn_commit, gdn_verify

K = 4
EPS = 1e-6


def _case(Hk, Hv, D, n_layers, n_slots, B, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    C = (2 * Hk + Hv) * D
    conv_w = torch.randn(n_layers, C, K, generator=gen) * 0.5
    cs = torch.randn(n_layers, n_slots, K - 1, C, generator=gen)
    S = torch.randn(n_layers, n_slots, Hv, D, D, generator=gen) * 0.3
    qkv = torch.randn(n_layers, B, C, generator=gen)
    alpha_x = torch.randn(n_layers, B, Hv, generator=gen)
    beta_x = torch.randn(n_layers, B, Hv, generator=gen)
    gate = (torch.randn(Hv, generator=gen) * 0.1, -torch.rand(Hv, generator=gen).add(0.1))
    return [t.to(device) for t in (conv_w, cs, S, qkv, alpha_x, beta_x)], tuple(t.to(device) for t in gate)


def _sequential(conv_w, cs, S, qkv, ax, bx, gate, slots, keep, Hk, D, impl):
    """What one-row steps give: every row's output from its slot's states after the rows before it; the
    states after each slot's first keep[slot] rows (all of them for a slot not in keep). (With the tile width
    the drafting step takes for its rows: the Triton kernel's float32 sums depend on it.)"""
    L, B, _ = qkv.shape
    kw = dict(block_v=delta_block_v(B, S.shape[2], D)) if impl == "triton" else {}
    cs, S = cs.clone(), S.clone()
    o = torch.zeros(L, B, S.shape[2], D, device=qkv.device)
    for s in sorted(set(x for x in slots if x >= 0)):
        rows = [r for r, x in enumerate(slots) if x == s]
        for il in range(L):
            chain = (cs[il].clone(), S[il].clone())
            for j, r in enumerate(rows):
                args = (qkv[il, r:r + 1], conv_w[il])
                tail = (torch.tensor([s], device=qkv.device), ax[il, r:r + 1], bx[il, r:r + 1], Hk, D, EPS)
                o[il, r] = gdn_decode(*args, *chain, *tail, impl=impl, gate=gate, **kw)[0]
                if j < keep.get(s, len(rows)):
                    gdn_decode(*args, cs[il], S[il], *tail, impl=impl, gate=gate, **kw)
    return o, cs, S


def _drafting_step(conv_w, cs, S, qkv, ax, bx, gate, slots, keep, Hk, D, impl):
    """gdn_verify per layer, then gdn_commit for each multi-row slot's `keep` rows. Returns o, cs, S."""
    L, B, C = qkv.shape
    Hv = S.shape[2]
    lay = torch.tensor(draft_layout(slots), device=qkv.device)
    kept = tuple(torch.zeros(L, B, n, device=qkv.device) for n in (C, C, Hv, Hv))
    o = torch.stack([gdn_verify(qkv[il], conv_w[il], cs[il], S[il], lay, ax[il], bx[il], Hk, D, EPS,
                                tuple(k[il] for k in kept), gate=gate, impl=impl) for il in range(L)])
    for s, n in keep.items():
        gdn_commit(conv_w, cs, S, kept, s, slots.index(s), n, Hk, D, EPS, block_v=delta_block_v(B, Hv, D),
                   impl=impl)
    return o, cs, S


def test_draft_layout():
    assert draft_layout([3, 1, 0]) is None
    assert draft_layout([2, 2, 2, 5, -1, -1]) == [
        [2, 2, 2, 5, -1, -1], [0, 1, 2, 0, 0, 0], [3, 3, 3, 1, 1, 1],
        [2, 5, -1, -1, -1, -1], [0, 3, 4, 5, 0, 0], [3, 1, 1, 1, 0, 0]]
    # the scratch slot's rows are padding
    assert draft_layout([4, 4, 7, 7], scratch=7)[3] == [4, -1, -1, -1]
    with pytest.raises(ValueError, match="not consecutive"):
        draft_layout([1, 2, 1])


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("keep", [1, 2, 4])
def test_verify_then_commit_equals_one_row_steps(impl, keep):
    if impl == "triton":
        pytest.importorskip("triton")
    Hk, Hv, D = 2, 4, 16
    slots = [3, 3, 3, 3, 0, 5, 5, -1]          # slot 3 drafts 3, slot 0 decodes, slot 5 drafts 1, a padding row
    (conv_w, cs, S, qkv, ax, bx), gate = _case(Hk, Hv, D, n_layers=2, n_slots=6, B=len(slots), seed=keep)
    keeps = {3: keep, 5: min(keep, 2)}
    o, cs1, S1 = _drafting_step(conv_w, cs.clone(), S.clone(), qkv, ax, bx, gate, slots, keeps, Hk, D, impl)
    o_ref, cs2, S2 = _sequential(conv_w, cs, S, qkv, ax, bx, gate, slots, keeps, Hk, D, impl)
    assert torch.equal(o, o_ref)               # every row's output, drafts included, as one-row steps give it
    assert torch.equal(cs1, cs2) and torch.equal(S1, S2)


def test_multi_row_slots_wait_for_the_commit():
    Hk, Hv, D = 2, 2, 8
    slots = [1, 1, 2]
    (conv_w, cs, S, qkv, ax, bx), gate = _case(Hk, Hv, D, n_layers=1, n_slots=3, B=3, seed=7)
    cs0, S0 = cs.clone(), S.clone()
    _drafting_step(conv_w, cs, S, qkv, ax, bx, gate, slots, {}, Hk, D, "ref")
    assert torch.equal(cs[:, 1], cs0[:, 1]) and torch.equal(S[:, 1], S0[:, 1])      # the drafting slot: untouched
    assert not torch.equal(S[:, 2], S0[:, 2])                                       # the decoding one: a step on
    assert torch.equal(cs[:, 0], cs0[:, 0]) and torch.equal(S[:, 0], S0[:, 0])      # no row: untouched


def test_triton_matches_ref_at_other_sizes():
    pytest.importorskip("triton")
    Hk, Hv, D = 1, 3, 12                       # (D not a power of two: masked channels)
    slots = [0, 0, 2, 2, 2]
    (conv_w, cs, S, qkv, ax, bx), gate = _case(Hk, Hv, D, n_layers=1, n_slots=3, B=5, seed=3)
    out = {}
    for impl in ("ref", "triton"):
        out[impl] = _drafting_step(conv_w, cs.clone(), S.clone(), qkv, ax, bx, gate, slots, {0: 2, 2: 1}, Hk, D,
                                   impl)
    for a, b in zip(out["triton"], out["ref"]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [1, 3, 4])
def test_real_sizes_gpu(keep):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    Hk, Hv, D = 16, 48, 128                    # the 27B's
    slots = [5, 5, 5, 5] + [1] + [9, 9, 9, 9]
    (conv_w, cs, S, qkv, ax, bx), gate = _case(Hk, Hv, D, n_layers=2, n_slots=12, B=len(slots), seed=keep,
                                                device="cuda")
    keeps = {5: keep, 9: 4}
    o, cs1, S1 = _drafting_step(conv_w, cs.clone(), S.clone(), qkv, ax, bx, gate, slots, keeps, Hk, D, "triton")
    o_ref, cs2, S2 = _sequential(conv_w, cs, S, qkv, ax, bx, gate, slots, keeps, Hk, D, "triton")
    assert torch.equal(o, o_ref)
    assert torch.equal(cs1, cs2) and torch.equal(S1, S2)
