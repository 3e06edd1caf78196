"""New K and V rows into a paged pool of a float cache type (f16 / f32; bf16 alike on the GPU) in one launch.

The decode step writes each attention layer's new keys and values into the pool: `codec.encode` (for a
float type a cast, one torch kernel each for K and V) then `index_copy_` (two more). `write_kv_rows` does
the four in one Triton kernel that takes part in the step's programmatic dependent launch (kernels/pdl.py),
where torch's kernels break that chain. The values are the same bits: the cast rounds to nearest even
either way. The compressed types keep their encoders and index_copy_.
"""
from __future__ import annotations

import torch

from kernels.pdl import pdl_args

try:
    import triton
    import triton.language as tl
    from kernels.pdl import pdl_enter
except ImportError:     # CPU-only installs: the torch path
    triton = None

__all__ = ["write_kv_rows"]

if triton is not None:
    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, rows_ptr, stride_k, stride_v, K_ELEMS: tl.constexpr,
                         V_ELEMS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (r, 0) copies k's row r to the pool row rows[r] of kc, (r, 1) v's to vc, in the pool's dtype."""
        pdl_enter(PDL)
        r = tl.program_id(0)
        dst = tl.load(rows_ptr + r).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if tl.program_id(1) == 0:
            m = offs < K_ELEMS
            x = tl.load(k_ptr + r.to(tl.int64) * stride_k + offs, mask=m)
            tl.store(kc_ptr + dst * K_ELEMS + offs, x.to(kc_ptr.dtype.element_ty), mask=m)
        else:
            m = offs < V_ELEMS
            x = tl.load(v_ptr + r.to(tl.int64) * stride_v + offs, mask=m)
            tl.store(vc_ptr + dst * V_ELEMS + offs, x.to(vc_ptr.dtype.element_ty), mask=m)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] as [n, H * D] with each row contiguous."""
    x2 = x.reshape(x.shape[0], -1)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def write_kv_rows(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor,
                  dtype_k: torch.dtype, dtype_v: torch.dtype) -> None:
    """kc's pool row rows[i] = k[i] as dtype_k (and vc's = v[i] as dtype_v): k [n, Hkv, D], v [n, Hkv, Dv];
    kc, vc the pool's uint8 caches [blocks, block_size, Hkv, bytes of a head row] holding dtype_k /
    dtype_v values; rows int64 [n] (Runner._rows). Triton (CUDA or the interpreter)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    n = k.shape[0]
    if n == 0:
        return
    k2, v2 = _as_rows(k), _as_rows(v)
    kd, vd = kc.view(dtype_k).view(-1, k2.shape[1]), vc.view(dtype_v).view(-1, v2.shape[1])
    block = triton.next_power_of_2(max(k2.shape[1], v2.shape[1]))
    launch = dict(num_warps=4) if k.is_cuda else {}
    _write_kv_kernel[(n, 2)](k2, v2, kd, vd, rows, k2.stride(0), v2.stride(0), K_ELEMS=k2.shape[1],
                             V_ELEMS=v2.shape[1], BLOCK=block, **pdl_args(k), **launch)
