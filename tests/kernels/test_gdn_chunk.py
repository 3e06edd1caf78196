"""The chunk scan of the chunkwise-parallel delta rule (kernels/gdn/chunk.py): the Triton kernel
(interpreter on the CPU, real Qwen3.5 sizes on a GPU) against the torch loop, and the whole
delta_rule_chunked with the kernel against the one-token-at-a-time recurrence."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.models.qwen35 import delta_rule_chunked, delta_rule_recurrent, l2_norm  # noqa: E402
from kernels.gdn.chunk import chunk_scan, ref_chunk_scan  # noqa: E402


def _terms(H, N, C, Dk, Dv, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.3):
        return (torch.randn(*shape, generator=g) * s).to(device)
    return (r(H, N, C, Dv), r(H, N, C, Dk), r(H, N, C, Dk), r(H, N, C, C).tril(), r(H, N, C, Dk),
            torch.rand(H, N, generator=g).to(device), r(H, Dk, Dv))


@pytest.mark.parametrize("H,N,C,Dk,Dv,bv", [(2, 3, 16, 32, 32, 16), (3, 1, 16, 16, 64, 32)])
def test_kernel_matches_torch_loop(H, N, C, Dk, Dv, bv):
    t = _terms(H, N, C, Dk, Dv, seed=N)
    out, S = chunk_scan(*t, block_v=bv)
    out_r, S_r = ref_chunk_scan(*t)
    torch.testing.assert_close(out, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S_r, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    t = list(_terms(1, 1, 16, 32, 32, seed=0))
    with pytest.raises(ValueError, match="powers of two"):
        chunk_scan(*([t[0][..., :24]] + t[1:]))
    with pytest.raises(ValueError, match="float32"):
        chunk_scan(*([t[0].double()] + t[1:]))


def _delta_inputs(T, H, D, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(T, H, D, generator=g), 1e-6).to(device)
    k = l2_norm(torch.randn(T, H, D, generator=g), 1e-6).to(device)
    v = torch.randn(T, H, D, generator=g).to(device)
    gl = (-torch.rand(T, H, generator=g) * 0.5).to(device)
    beta = torch.sigmoid(torch.randn(T, H, generator=g)).to(device)
    S = (torch.randn(H, D, D, generator=g) * 0.1).to(device)
    return q, k, v, gl, beta, S


def test_chunked_rule_with_the_kernel_matches_the_recurrence(monkeypatch):
    """delta_rule_chunked scanning with the kernel (forced on the CPU: the interpreter) equals the
    one-token-at-a-time rule, a prompt of 3 pieces with a ragged end."""
    import engine.models.qwen35 as qwen35
    monkeypatch.setattr(qwen35, "use_chunk_scan", lambda t: True)
    q, k, v, gl, beta, S = _delta_inputs(40, 2, 16, seed=1)
    o, S1 = delta_rule_chunked(q, k, v, gl, beta, S, chunk=16)
    o_r, S_r = delta_rule_recurrent(q, k, v, gl, beta, S)
    torch.testing.assert_close(o, o_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S1, S_r, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_real_sizes_gpu(monkeypatch):
    """Qwen3.5-27B's prompt chunk: 48 heads, 8 pieces of 64, Dk = Dv = 128; and the whole chunked rule on
    the GPU with the kernel against the recurrence (kernels/gdn/chunk.py's USE_KERNEL waits for this)."""
    import engine.models.qwen35 as qwen35
    monkeypatch.setattr(qwen35, "use_chunk_scan", lambda t: True)
    t = _terms(48, 8, 64, 128, 128, seed=2, device="cuda")
    out, S = chunk_scan(*t)
    out_r, S_r = ref_chunk_scan(*t)
    torch.testing.assert_close(out, out_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, S_r, rtol=1e-4, atol=1e-4)
    q, k, v, gl, beta, S0 = _delta_inputs(200, 4, 128, seed=3, device="cuda")
    o, S1 = delta_rule_chunked(q, k, v, gl, beta, S0)
    o_r, S_r = delta_rule_recurrent(q, k, v, gl, beta, S0)
    torch.testing.assert_close(o, o_r, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(S1, S_r, rtol=1e-3, atol=1e-3)
