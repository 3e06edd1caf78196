"""A matmul input made inside the decode matmul (kernels/fused.py: GatedInput, kernels/quant/packed.py:
_gated_x): for every op and the layouts the models pass (column views of a stacked product, the
attention gate as a strided per-head view, the DeltaNet output per head), the fused kernel gives the
result of the separate op followed by the plain matmul, a row's result does not depend on the other
rows, and the engine's Weight.matmul keeps its CPU results. On the CPU the kernels run in Triton's
interpreter (small shapes); the `gpu` test runs the 27B's shapes."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

pytest.importorskip("triton")

from kernels import fused  # noqa: E402
from kernels.fused import GatedInput  # noqa: E402
from kernels.quant.packed import dequant_packed_ref, pack_weight, packed_matmul  # noqa: E402
from tests.kernels.test_packed import _random_weight  # noqa: E402


def _weight(qtype, n, k, seed, device="cpu", **kw):
    p = pack_weight(_random_weight(qtype, n, k, seed=seed).to(device), qtype, n, k, **kw)
    return p


def _inputs(op: str, m: int, k: int, head: int, seed: int, device="cpu"):
    """a, b (and the norm's w) laid out as the model code hands them over."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 2).to(device)
    if op in ("silu", "gelu_tanh"):   # gate | up: column views of one stacked product [m, 2k]
        gu = r(m, 2 * k)
        return gu[:, :k], gu[:, k:], None
    if op == "sigmoid":               # a [m, H*D]; the gate a strided view of the joint q|gate product
        qg = r(m, k // head, 2 * head)
        return r(m, k), qg[..., head:], None
    # norm_silu: o [m, H, D] contiguous, z a column view of the stacked DeltaNet input product
    zx = r(m, k + 48)
    return r(m, k // head, head), zx[:, 16:16 + k], (torch.rand(head, generator=g) + 0.5).to(device)


def _fused_and_dense(op, qtype, m, n=32, k=512, head=128, seed=0, device="cpu", **kw):
    p = _weight(qtype, n, k, seed, device, tile_n=32, tile_k=kw.pop("tile_k", 128))
    a, b, w = _inputs(op, m, k, head, seed + 1, device)
    gi = GatedInput(op, a, b, w, 1e-6)
    return packed_matmul(gi, p, **kw), packed_matmul(gi.dense(), p, **kw), gi, p


@pytest.mark.parametrize("op", fused.GATED_OPS)
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_fused_input_gives_the_separate_ops_result(op, qtype):
    for m in (1, 3):
        y, ref, gi, p = _fused_and_dense(op, qtype, m, split_k=2, swap_ab=qtype != QT.Q8_0)
        # the same fp32 formulas, rounded to fp16 as the plain path rounds its x
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # and the product itself, against torch on the dequantized weight
        want = gi.dense().half().float() @ dequant_packed_ref(p).T
        assert ((y - want).abs().max() / want.abs().max()).item() < 2e-3


@pytest.mark.parametrize("op", fused.GATED_OPS)
def test_fused_input_rows_do_not_depend_on_batch(op):
    y5, _, gi, p = _fused_and_dense(op, QT.Q4_K, 5, split_k=2, swap_ab=True)
    one = GatedInput(op, gi.a[:1], gi.b[:1], gi.w, gi.eps)
    assert torch.equal(packed_matmul(one, p, split_k=2, swap_ab=True), y5[:1])


def test_norm_groups_smaller_than_a_tile_and_the_fallback():
    # two 64-value heads per 128-value tile: normed per head inside the tile
    y, ref, _, _ = _fused_and_dense("norm_silu", QT.Q4_K, 2, head=64, split_k=2)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # a head that no tile holds whole (96 values): the kernel takes the dense input instead
    y, ref, _, _ = _fused_and_dense("norm_silu", QT.Q4_K, 2, k=768, head=96, split_k=1)
    assert torch.equal(y, ref)


def test_bad_inputs_are_refused():
    a = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="op must be"):
        GatedInput("relu", a, a)
    with pytest.raises(ValueError, match="differ"):
        GatedInput("silu", a, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="heads"):
        GatedInput("norm_silu", a, a, torch.ones(64))
    p = _weight(QT.Q4_K, 32, 256, 0, tile_n=32)
    with pytest.raises(ValueError, match="columns"):
        packed_matmul(GatedInput("silu", a, a), p)


def test_weight_matmul_keeps_the_cpu_results():
    """On the CPU Weight.matmul takes dense(): the bits of the model code's former separate ops."""
    from engine.models.common import Weight
    w = Weight.__new__(Weight)
    w.name, w.qtype, w.shape, w.dense = "t", QT.Q4_K, (32, 512), None
    w.raw = _random_weight(QT.Q4_K, 32, 512, seed=3)
    gu = torch.randn(3, 1024, generator=torch.Generator().manual_seed(3))
    got = w.matmul(GatedInput("silu", gu[:, :512], gu[:, 512:]))
    assert torch.equal(got, w.matmul(fused.ref_silu_mul(gu[:, :512], gu[:, 512:])))
    assert got.shape == (3, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("op,n,k", [("silu", 5120, 17408), ("sigmoid", 5120, 6144), ("norm_silu", 5120, 6144)])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_fused_input_on_gpu(op, n, k, qtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernels.quant.packed import matmul_tuned
    p = _weight(qtype, n, k, 11, "cuda")
    for m in (1, 16):
        a, b, w = _inputs(op, m, k, 128, m, "cuda")
        gi = GatedInput(op, a, b, w, 1e-6)
        add = torch.randn(m, n, device="cuda")
        y = matmul_tuned(gi, p, add=add)
        ref = matmul_tuned(gi.dense(), p, add=add)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
        one = matmul_tuned(GatedInput(op, a[:1], b[:1], w, 1e-6), p, add=add[:1])
        assert torch.equal(one, y[:1])
