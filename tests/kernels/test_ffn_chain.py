"""kernels/quant/ffn_chain.py: the decode FFN as one launch against the three-launch path (packed_matmul,
silu_mul, packed_matmul with the residual), on the CPU under Triton's interpreter (small shapes; its
programs run one after another, so the first claims every item) and on the GPU at the 27B's shapes, where
the programs race (bit for bit at the same split counts, many launches and CUDA graph replays)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

triton = pytest.importorskip("triton")

from kernels.quant.ffn_chain import chain_supported, ffn_chain, ffn_unfused  # noqa: E402
from kernels.quant.packed import dequant_packed_ref, pack_weight, stack_rows  # noqa: E402
from tests.kernels.test_packed import _random_weight  # noqa: E402


def _weights(f, k, n_out, gate_tile, down_tile_n, types=(QT.Q4_K, QT.Q4_K, QT.Q6_K), seed=0, device="cpu"):
    """A gate+up stack ([2f, k], tiles of gate_tile rows) and down ([n_out, f], K tiles of gate_tile)."""
    tg, tu, td = types
    gate = pack_weight(_random_weight(tg, f, k, seed=seed).to(device), tg, f, k, tile_n=gate_tile)
    up = pack_weight(_random_weight(tu, f, k, seed=seed + 1).to(device), tu, f, k, tile_n=gate_tile)
    down = pack_weight(_random_weight(td, n_out, f, seed=seed + 2).to(device), td, n_out, f, tile_n=down_tile_n,
                       tile_k=gate_tile)
    stack, _ = stack_rows([gate, up])
    return stack, down


def _reference(x, stack, down, add):
    """float64 add + silu(x W_g^T) * (x W_u^T) @ W_d^T, h rounded to fp16 as the kernels do."""
    f = stack.n // 2
    gu = x.half().double() @ dequant_packed_ref(stack).double().T
    h = (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]).half().double()
    return add.double() + h @ dequant_packed_ref(down).double().T


@pytest.mark.parametrize("split_a,split_b", [(1, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("programs", [1, 4, 0])
def test_chain_matches_three_launches(split_a, split_b, programs):
    """Interpreter: the chain's result equals the three-launch path's (same splits; silu_mul on the CPU
    is float64, so within fp16 rounding of h) and the float64 reference; the counts are back at 0."""
    f, k, n_out = 256, 256, 48
    stack, down = _weights(f, k, n_out, 32, 16)
    assert chain_supported(stack, down, f)
    g = torch.Generator().manual_seed(3)
    for m in (1, 5):
        x = torch.randn(m, k, generator=g).half()
        add = torch.randn(m, n_out, generator=g)
        y = ffn_chain(x, stack, down, add, split_a=split_a, split_b=split_b, programs=programs)
        ref = _reference(x, stack, down, add)
        unfused = ffn_unfused(x, stack, down, add, split_a=split_a, split_b=split_b, swap_ab=True)
        scale = (ref - add.double()).abs().max()
        assert ((y.double() - ref).abs().max() / scale).item() < 3e-3
        assert ((y - unfused).abs().max() / scale).item() < 3e-3
    from kernels.quant.ffn_chain import _COUNTS
    c = _COUNTS[(id(stack.planes[0]), id(down.planes[0]), x.device)]
    for t in (c.cnt_a, c.pair, c.ready, c.cnt_b, c.work, c.exit):
        assert int(t.abs().sum()) == 0


def test_chain_refuses_what_it_cannot_take():
    f, k, n_out = 256, 256, 48
    stack, down = _weights(f, k, n_out, 32, 16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        ffn_chain(torch.randn(17, k).half(), stack, down, torch.zeros(17, n_out), split_a=1, split_b=1, programs=1)
    with pytest.raises(ValueError, match="add must be"):
        ffn_chain(torch.randn(2, k).half(), stack, down, torch.zeros(2, n_out - 1), split_a=1, split_b=1, programs=1)
    # down's K tiles wider than gate's bands: one chunk of h is not one down tile
    narrow = pack_weight(_random_weight(QT.Q6_K, n_out, f, seed=9), QT.Q6_K, n_out, f, tile_n=16, tile_k=64)
    assert not chain_supported(stack, narrow, f)
    with pytest.raises(ValueError, match="chain_supported"):
        ffn_chain(torch.randn(2, k).half(), stack, narrow, torch.zeros(2, n_out), split_a=1, split_b=1, programs=1)


@pytest.mark.gpu
@pytest.mark.parametrize("down_type", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_chain_on_gpu_is_bit_exact(down_type):
    """H200 / any CUDA GPU, the 27B's FFN (5120 -> 2 x 17408 -> 5120): the chain's programs race; its
    result has the three-launch path's bits at the same splits, every launch, and in a replayed graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernels.quant.packed import _sm_count
    f, k = 17408, 5120
    stack, down = _weights(f, k, k, 128, 64, types=(QT.Q4_K, QT.Q4_K, down_type), device="cuda")
    progs = 4 * _sm_count(0)
    cfg = dict(split_a=4, split_b=17)
    for m in (1, 4, 16):
        # (inputs ~0.01: with random weights at this size silu(gate) * up overflows fp16 for inputs ~1)
        x = (0.01 * torch.randn(m, k, device="cuda")).half()
        add = torch.randn(m, k, device="cuda")
        want = ffn_unfused(x, stack, down, add, swap_ab=True, **cfg)
        assert torch.isfinite(want).all()
        for _ in range(20):
            assert torch.equal(ffn_chain(x, stack, down, add, programs=progs, maxnreg=128, **cfg), want)
            assert torch.equal(ffn_chain(x, stack, down, add, programs=0, maxnreg=128, **cfg), want)
    x = (0.01 * torch.randn(4, k, device="cuda")).half()
    add = torch.randn(4, k, device="cuda")
    ffn_chain(x, stack, down, add, programs=progs, **cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ffn_chain(x, stack, down, add, programs=progs, **cfg)
    for i in range(20):
        x.copy_(0.01 * torch.randn(4, k, device="cuda", generator=torch.Generator("cuda").manual_seed(i)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ffn_unfused(x, stack, down, add, swap_ab=True, **cfg))
