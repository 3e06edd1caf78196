"""kernels/attention/kv_write.py: new K and V rows written into a paged pool of a float cache type in one
kernel, against the runner's torch path (cast, then index_copy_): the same bytes everywhere, rows it does
not name untouched. On the CPU the kernel runs in Triton's interpreter (which truncates to bf16 where the
GPU rounds, so bf16 is not among the types the runner hands it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import fused  # noqa: E402
from kernels.attention.kv_write import norm_rope_write_kv, write_kv_rows  # noqa: E402


def _cos_sin(n: int, rope_dim: int, start: int = 7):
    inv = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    theta = torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv[None, :]
    return theta.cos().float(), theta.sin().float()


def _projection(n: int, h: int, hkv: int, d: int, dv: int, g: torch.Generator, device="cpu"):
    """q (a strided view of qwen35's Q|gate), k and v (views of one stacked product's rows)."""
    qg = torch.randn(n, h, 2 * d, generator=g, device=device) * 3
    kv = torch.randn(n, hkv * (d + dv) + 8, generator=g, device=device) * 2
    return (qg[..., :d], kv[:, :hkv * d].view(n, hkv, d), kv[:, hkv * d:hkv * (d + dv)].view(n, hkv, dv))


def _pool(dtype, blocks, bs, hkv, d, g, device="cpu"):
    es = torch.tensor([], dtype=dtype).element_size()
    return torch.randint(0, 255, (blocks, bs, hkv, d * es), dtype=torch.uint8, generator=g, device=device)


@pytest.mark.parametrize("dtype_k,dtype_v", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                             (torch.float32, torch.float16)])
def test_rows_written_as_the_torch_path_writes_them(dtype_k, dtype_v):
    g = torch.Generator().manual_seed(3)
    blocks, bs, hkv, d, dv, n = 5, 4, 2, 16, 8, 3
    es_k, es_v = torch.tensor([], dtype=dtype_k).element_size(), torch.tensor([], dtype=dtype_v).element_size()
    kc = torch.randint(0, 255, (blocks, bs, hkv, d * es_k), dtype=torch.uint8, generator=g)
    vc = torch.randint(0, 255, (blocks, bs, hkv, dv * es_v), dtype=torch.uint8, generator=g)
    k = torch.randn(n, hkv, d, generator=g) * 100
    v = torch.randn(n, hkv, 2 * dv, generator=g)[..., ::2]            # a strided view, as a slice may be
    rows = torch.tensor([7, 0, 19])
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(-1, hkv, kc.shape[-1]).index_copy_(0, rows, k.to(dtype_k).contiguous().view(torch.uint8))
    want_v.view(-1, hkv, vc.shape[-1]).index_copy_(0, rows, v.to(dtype_v).contiguous().view(torch.uint8))
    write_kv_rows(k, v, kc, vc, rows, dtype_k, dtype_v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    write_kv_rows(k[:0], v[:0], kc, vc, rows[:0], dtype_k, dtype_v)   # no rows: nothing written
    assert torch.equal(kc, want_k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("norm,rope_dim,neox", [(True, 16, True), (True, 32, False), (False, 32, True),
                                                (True, 0, True)])
def test_norm_rope_write_is_the_separate_kernels(dtype, norm, rope_dim, neox):
    """One launch for q/k norms, rope and the K/V write: the queries qk_norm_rope makes (bit for bit), the
    pool bytes write_kv_rows writes from qk_norm_rope's keys, rows it does not name untouched; v's head dim
    may differ from q/k's."""
    g = torch.Generator().manual_seed(5)
    n, h, hkv, d, dv = 3, 6, 2, 32, 16
    q, k, v = _projection(n, h, hkv, d, dv, g)
    qw, kw = (torch.randn(d, generator=g), torch.randn(d, generator=g)) if norm else (None, None)
    cos, sin = _cos_sin(n, rope_dim) if rope_dim else (None, None)
    kc, vc = _pool(dtype, 5, 4, hkv, d, g), _pool(dtype, 5, 4, hkv, dv, g)
    want_k, want_v = kc.clone(), vc.clone()
    rows = torch.tensor([9, 0, 19])
    with fused.force_triton():
        prep = (lambda x, w: fused.qk_norm_rope(x, w, 1e-6, cos, sin, rope_dim, neox)) if rope_dim else \
            (lambda x, w: fused.head_rms_norm(x, w, 1e-6))
        want_q, k_ready = (prep(q, qw), prep(k, kw)) if norm or rope_dim else (q, k)
    write_kv_rows(k_ready, v, want_k, want_v, rows, dtype, dtype)
    out = norm_rope_write_kv(q, k, v, qw, kw, 1e-6, cos, sin, rope_dim, neox, kc, vc, rows, dtype, dtype)
    assert out.dtype == torch.float32 and torch.equal(out, want_q)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    ref = fused.ref_qk_norm_rope(q, qw, 1e-6, cos, sin, rope_dim, neox) if rope_dim else \
        fused.ref_head_rms_norm(q, qw, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_norm_rope_write_rejects_bad_shapes():
    g = torch.Generator().manual_seed(1)
    q, k, v = _projection(2, 4, 2, 16, 16, g)
    kc = vc = _pool(torch.float16, 2, 4, 2, 16, g)
    rows = torch.tensor([0, 1])
    w = torch.ones(16)
    cos, sin = _cos_sin(2, 8)
    with pytest.raises(ValueError, match="normed together"):
        norm_rope_write_kv(q, k, v, w, None, 1e-6, cos, sin, 8, True, kc, vc, rows, torch.float16, torch.float16)
    with pytest.raises(ValueError, match="do not fit"):
        norm_rope_write_kv(q, k[:, :1], v, w, w, 1e-6, cos, sin, 8, True, kc, vc, rows, torch.float16, torch.float16)
    with pytest.raises(ValueError, match="cos/sin"):
        norm_rope_write_kv(q, k, v, w, w, 1e-6, cos[:1], sin[:1], 8, True, kc, vc, rows, torch.float16,
                           torch.float16)


@pytest.mark.gpu
def test_norm_rope_write_on_gpu():
    """The 27B's attention heads (24 q heads and 4 k/v heads of 256, rope over 64, NEOX) at 1 and 16 rows,
    bf16 too, inside a CUDA graph: as qk_norm_rope then write_kv_rows (within float32 rounding: the kernels'
    reductions are laid out differently), and the same bytes for v."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    h, hkv, d, rope_dim = 24, 4, 256, 64
    for n in (1, 16):
        q, k, v = _projection(n, h, hkv, d, d, g, dev)
        qw, kw = torch.randn(d, device=dev, generator=g), torch.randn(d, device=dev, generator=g)
        cos, sin = (t.to(dev) for t in _cos_sin(n, rope_dim, start=20000))
        rows = torch.randperm(64 * 16, device=dev)[:n]
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            kc, vc = _pool(dtype, 64, 16, hkv, d, g, dev), _pool(dtype, 64, 16, hkv, d, g, dev)
            norm_rope_write_kv(q, k, v, qw, kw, 1e-6, cos, sin, rope_dim, True, kc, vc, rows, dtype, dtype)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = norm_rope_write_kv(q, k, v, qw, kw, 1e-6, cos, sin, rope_dim, True, kc, vc, rows, dtype, dtype)
            k.copy_(torch.randn(k.shape, device=dev, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            want_q = fused.qk_norm_rope(q, qw, 1e-6, cos, sin, rope_dim, True)
            want_k = fused.qk_norm_rope(k, kw, 1e-6, cos, sin, rope_dim, True)
            torch.testing.assert_close(out, want_q, rtol=1e-5, atol=1e-5)
            got_k = kc.view(dtype).view(-1, hkv, d)[rows].float()
            tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(got_k, want_k.to(dtype).float(), **tol)
            assert torch.equal(vc.view(dtype).view(-1, hkv, d)[rows], v.to(dtype))


@pytest.mark.gpu
def test_rows_written_on_gpu():
    """On the GPU, bf16 too (rounded to nearest, as torch casts), at a 27B layer's size inside a CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hkv, d = 4, 256
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        es = torch.tensor([], dtype=dtype).element_size()
        kc = torch.zeros(64, 16, hkv, d * es, dtype=torch.uint8, device="cuda")
        vc = torch.zeros_like(kc)
        k, v = torch.randn(16, hkv, d, device="cuda") * 50, torch.randn(16, hkv, d, device="cuda")
        rows = torch.randperm(64 * 16, device="cuda")[:16]
        write_kv_rows(k, v, kc, vc, rows, dtype, dtype)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            write_kv_rows(k, v, kc, vc, rows, dtype, dtype)
        k.copy_(torch.randn_like(k))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc.view(dtype).view(-1, hkv, d)[rows], k.to(dtype))
        assert torch.equal(vc.view(dtype).view(-1, hkv, d)[rows], v.to(dtype))
