"""The one-launch delta rule over a short run of tokens (kernels/gdn/rows.py) against the token-at-a-time
recurrence (kernels/gdn/rule.py: delta_rule_recurrent): in Triton's interpreter on small shapes, and on
a GPU at Qwen3.5-27B's sizes (and against the chunked form the small prompt chunks used before)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.gdn.rule import delta_rule_chunked, delta_rule_recurrent, l2_norm  # noqa: E402
from kernels.gdn.rows import ROWS_KERNEL_MAX, delta_rule_pieces, delta_rule_rows, rows_kernel_applies  # noqa: E402


def _inputs(T, H, D, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(T, H, D, generator=g), 1e-6)
    k = l2_norm(torch.randn(T, H, D, generator=g), 1e-6)
    v = torch.randn(T, H, D, generator=g)
    gl = -torch.rand(T, H, generator=g) * 0.5
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    S = torch.randn(H, D, D, generator=g) * 0.1
    return [t.to(device) for t in (q, k, v, gl, beta, S)]


@pytest.mark.parametrize("T,H,D,block_v", [(5, 3, 16, 8), (9, 2, 24, 16), (2, 4, 32, 32)])
def test_rows_kernel_matches_the_recurrence(T, H, D, block_v):
    """Every token's output and the final state, D a power of two or not (masked columns), one or several
    blocks of v-columns per head."""
    args = _inputs(T, H, D, seed=T + D)
    o, S = delta_rule_rows(*args, block_v=block_v)
    o_r, S_r = delta_rule_recurrent(*[a.double() for a in args])
    torch.testing.assert_close(o, o_r.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S_r.float(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(S, args[5])   # (the input state is read, not written)


def test_padding_rows_leave_the_state_alone():
    """A padded prompt chunk's padding rows (log decay 0, beta 0) pass the state through bit for bit, so a
    run padded to the chunk's rows ends in the state of its real rows."""
    q, k, v, gl, beta, S0 = _inputs(7, 2, 16, seed=5)
    o, S = delta_rule_rows(q[:4], k[:4], v[:4], gl[:4], beta[:4], S0)
    gl[4:], beta[4:] = 0.0, 0.0
    o_p, S_p = delta_rule_rows(q, k, v, gl, beta, S0)
    assert torch.equal(S_p, S) and torch.equal(o_p[:4], o)


def test_pieces_kernel_runs_each_slot_as_alone():
    """Several slots' runs in one launch (a prompt pass of several sequences): each piece's outputs and its
    slot's new state are what the piece gets alone, bit for bit, padding rows at a piece's end (log decay 0,
    beta 0: a pass's alignment) included; unused pieces (no rows) and slots in no piece stay as they were."""
    H, D = 2, 16
    q, k, v, gl, beta, _ = _inputs(26, H, D, seed=9)
    gl[7:16], beta[7:16] = 0.0, 0.0                         # piece 0's padding rows
    states = torch.randn(5, H, D, D, generator=torch.Generator().manual_seed(1)) * 0.1
    before = states.clone()
    slots = torch.tensor([3, 0, 4, 3, 3])                    # the last two pieces unused
    cu = torch.tensor([0, 16, 17, 26, 26, 26], dtype=torch.int32)
    o = delta_rule_pieces(q, k, v, gl, beta, states, slots, cu)
    for i, slot in enumerate((3, 0, 4)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        real = 7 if i == 0 else hi - lo
        o1, s1 = delta_rule_rows(q[lo:lo + real], k[lo:lo + real], v[lo:lo + real], gl[lo:lo + real],
                                 beta[lo:lo + real], before[slot])
        assert torch.equal(o[lo:lo + real], o1)
        assert torch.equal(states[slot], s1)
        ref = delta_rule_recurrent(*[t[lo:hi].double() for t in (q, k, v, gl, beta)], before[slot].double())
        torch.testing.assert_close(states[slot], ref[1].float(), rtol=1e-5, atol=1e-5)
    for slot in (1, 2):
        assert torch.equal(states[slot], before[slot])
    with pytest.raises(ValueError):
        delta_rule_pieces(q, k, v, gl, beta, states.double(), slots, cu)
    with pytest.raises(ValueError):
        delta_rule_pieces(q, k, v, gl, beta, states, slots, cu[:-1])


def test_rows_kernel_takes_short_runs_on_cuda_only():
    q = torch.zeros(8, 2, 16)
    assert not rows_kernel_applies(q)                       # (a CPU tensor: the torch forms)
    if torch.cuda.is_available():
        assert rows_kernel_applies(q.cuda()) and not rows_kernel_applies(torch.zeros(65, 2, 16, device="cuda"))
    with pytest.raises(ValueError):
        delta_rule_rows(q, q, q, torch.zeros(8, 3), torch.zeros(8, 2), torch.zeros(2, 16, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [ROWS_KERNEL_MAX, 17])
def test_rows_kernel_real_sizes_gpu(T):
    """The 27B's 48 v-heads of 128: against the recurrence in float64 and the chunked form (float32)."""
    args = _inputs(T, 48, 128, seed=T, device="cuda")
    o, S = delta_rule_rows(*args)
    o_r, S_r = delta_rule_recurrent(*[a.double() for a in args])
    torch.testing.assert_close(o, o_r.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, S_r.float(), rtol=1e-4, atol=1e-4)
    o_c, S_c = delta_rule_chunked(*args)
    torch.testing.assert_close(o, o_c, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(S, S_c, rtol=1e-3, atol=1e-3)
