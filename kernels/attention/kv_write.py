"""New K and V rows into a paged pool of a float cache type (f16 / f32; bf16 alike on the GPU) in one launch.

The decode step writes each attention layer's new keys and values into the pool: `codec.encode` (for a
float type a cast, one torch kernel each for K and V) then `index_copy_` (two more). `write_kv_rows` does
the four in one Triton kernel that takes part in the step's programmatic dependent launch (kernels/pdl.py),
where torch's kernels break that chain. The values are the same bits: the cast rounds to nearest even
either way. The compressed types keep their encoders and index_copy_.

`norm_rope_write_kv` goes one step further for decode rows: the per-head RMSNorm of q and k and their
rope (kernels/fused.py's _head_tile, four launches before) and the K/V write are one launch, which returns
the queries and leaves the keys and values in the pool.
"""
from __future__ import annotations

import torch

from kernels.pdl import pdl_args

try:
    import triton
    import triton.language as tl
    from kernels.fused import _head_tile
    from kernels.pdl import pdl_enter
except ImportError:     # CPU-only installs: the torch path
    triton = None

__all__ = ["write_kv_rows", "norm_rope_write_kv"]

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


    @triton.jit
    def _norm_rope_write_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr,
                                rows_ptr, H, HKV, D, DV, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, stride_cn, eps,
                                NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE_DIM: tl.constexpr, NEOX: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        """Token n = program_id 0; program_id 1 takes BLOCK_H heads of q (normed, roped, to qo float32 [N, H,
        D]), then of k (normed, roped, into pool row rows[n] of kc in its dtype), then of v (into vc's)."""
        pdl_enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        nq = tl.cdiv(H, BLOCK_H)
        nk = tl.cdiv(HKV, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        if j < nq:
            offs_h = j * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
            base = q_ptr + n * sq_n + offs_h[:, None].to(tl.int64) * sq_h
            x = _head_tile(base, n, offs_d, mask, qw_ptr, cos_ptr, sin_ptr, D, stride_cn, eps, NORM, HAS_W,
                           ROPE_DIM, NEOX)
            tl.store(qo_ptr + (n * H + offs_h[:, None]) * D + offs_d[None, :], x, mask=mask)
        else:
            dst = tl.load(rows_ptr + n).to(tl.int64)
            if j < nq + nk:
                offs_h = (j - nq) * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
                base = k_ptr + n * sk_n + offs_h[:, None].to(tl.int64) * sk_h
                x = _head_tile(base, n, offs_d, mask, kw_ptr, cos_ptr, sin_ptr, D, stride_cn, eps, NORM, HAS_W,
                               ROPE_DIM, NEOX)
                tl.store(kc_ptr + (dst * HKV + offs_h[:, None]) * D + offs_d[None, :],
                         x.to(kc_ptr.dtype.element_ty), mask=mask)
            else:
                offs_h = (j - nq - nk) * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < DV)
                x = tl.load(v_ptr + n * sv_n + offs_h[:, None].to(tl.int64) * sv_h + offs_d[None, :], mask=mask)
                tl.store(vc_ptr + (dst * HKV + offs_h[:, None]) * DV + offs_d[None, :],
                         x.to(vc_ptr.dtype.element_ty), mask=mask)


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


def norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None,
                       rope_dim: int, neox: bool, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor,
                       dtype_k: torch.dtype, dtype_v: torch.dtype) -> torch.Tensor:
    """q [n, H, D], k [n, Hkv, D], v [n, Hkv, Dv] as the projection made them (each head's last dim
    contiguous). Each head of q and k RMS-normed (q_norm / k_norm [D]; both None: no norm) and roped over
    its first rope_dim dims (cos/sin [n, rope_dim / 2]; 0: none), as kernels/fused.py's qk_norm_rope does;
    k and v then written to pool rows `rows` of kc / vc as write_kv_rows writes them. Returns the
    queries, float32 [n, H, D]."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q and k are normed together or not at all")
    n, H, D = q.shape
    HKV, DV = v.shape[1], v.shape[2]
    if k.shape != (n, HKV, D) or v.shape[0] != n:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if rope_dim and (tuple(cos.shape) != (n, rope_dim // 2) or cos.shape != sin.shape or rope_dim > D):
        raise ValueError(f"rope over {rope_dim} dims needs cos/sin [{n}, {rope_dim // 2}]")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("each head's values must be contiguous")
    qo = torch.empty((n, H, D), dtype=torch.float32, device=q.device)
    if n == 0:
        return qo
    if rope_dim:
        cos, sin = cos.contiguous(), sin.contiguous()
    kd, vd = kc.view(dtype_k).view(-1, HKV * D), vc.view(dtype_v).view(-1, HKV * DV)
    block_d = triton.next_power_of_2(max(D, DV))
    block_h = max(1, min(triton.next_power_of_2(max(H, HKV)), 2048 // block_d))
    grid = (n, triton.cdiv(H, block_h) + 2 * triton.cdiv(HKV, block_h))
    launch = dict(num_warps=max(1, min(8, block_h * block_d // 256))) if q.is_cuda else {}
    _norm_rope_write_kernel[grid](
        q, k, v, q_norm if q_norm is not None else q, k_norm if k_norm is not None else q,
        cos if rope_dim else q, sin if rope_dim else q, qo, kd, vd, rows, H, HKV, D, DV, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0) if rope_dim else 0, float(eps),
        NORM=q_norm is not None, HAS_W=q_norm is not None, ROPE_DIM=int(rope_dim), NEOX=bool(neox),
        BLOCK_H=block_h, BLOCK_D=block_d, **pdl_args(q), **launch)
    return qo
