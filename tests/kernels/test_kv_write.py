"""kernels/attention/kv_write.py: new K and V rows written into a paged pool of a float cache type in one
kernel, against the runner's torch path (cast, then index_copy_): the same bytes everywhere, rows it does
not name untouched. On the CPU the kernel runs in Triton's interpreter (which truncates to bf16 where the
GPU rounds, so bf16 is not among the types the runner hands it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.attention.kv_write import write_kv_rows  # noqa: E402


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
