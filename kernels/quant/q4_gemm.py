"""4-bit weights on the GPU: Q4_0, Q4_1 and Q4_K repacked once at load into one affine layout,
and a Triton kernel that multiplies M rows (decode tokens and drafts, or a prefill chunk) with each
weight tile while it is on chip.

Packed layout of a [N, K] matrix (every 32 consecutive values of a row form a group):
  q      uint8 [N, K/2]   value 2j in the low nibble of byte j, value 2j+1 in the high nibble
  scale  fp16  [N, K/32]
  minv   fp16  [N, K/32]  so that  W[n, k] = scale[n, k/32] * q[n, k] - minv[n, k/32]
Q4_0: scale = d, minv = 8d.  Q4_1: scale = d, minv = -m.  Q4_K: scale = d*sc, minv = dmin*m (the
scale products rounded to fp16, which DESIGN.md allows within the fidelity limits).

The kernel is split-K: each program reduces one K slice of a [BLOCK_N] tile of outputs for all M
rows and writes a partial sum; the partials are added in a fixed order afterwards, so results do
not depend on scheduling (no atomics) and a row's output does not depend on the other rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT

from kernels.quant.ref import _f16, _fields, _k_scale_min, check_supported, row_bytes

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the torch reference instead
    triton = None

PACKABLE = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})


@dataclass
class Packed4:
    q: torch.Tensor
    scale: torch.Tensor
    minv: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel() + 2 * self.minv.numel()


def _pairs(q: torch.Tensor) -> torch.Tensor:
    """uint8 values [..., K] (0..15) -> bytes [..., K/2] with value 2j low, 2j+1 high."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def pack_q4(raw: torch.Tensor, qtype, n: int, k: int) -> Packed4:
    """Repack a Q4_0 / Q4_1 / Q4_K weight (its GGUF bytes) into the affine 4-bit layout."""
    qtype = QT(qtype)
    check_supported(qtype)
    if qtype not in PACKABLE:
        raise ValueError(f"{qtype.name} is not a 4-bit affine type")
    b = raw.reshape(-1).view(torch.uint8).view(n, row_bytes(qtype, k))
    if qtype == QT.Q4_K:
        blocks = b.reshape(-1, 144)
        nb = blocks.shape[0]
        sc, mn = _k_scale_min(blocks, 4)
        scale = _f16(blocks, 0)[:, None] * sc.float()         # [nb, 8]
        minv = _f16(blocks, 2)[:, None] * mn.float()
        q = _fields(blocks, 16, 144, 4, 2, (-1, 4, 32), 2).reshape(nb, 256)
    else:
        bs = 18 if qtype == QT.Q4_0 else 20
        blocks = b.reshape(-1, bs)
        nb = blocks.shape[0]
        d = _f16(blocks, 0)[:, None]
        qs = blocks[:, bs - 16:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)             # values j and 16+j of a group
        if qtype == QT.Q4_0:
            scale, minv = d, 8.0 * d
        else:
            scale, minv = d, -_f16(blocks, 2)[:, None]
    return Packed4(q=_pairs(q.reshape(n, k)).contiguous(),
                   scale=scale.reshape(n, k // 32).to(torch.float16).contiguous(),
                   minv=minv.reshape(n, k // 32).to(torch.float16).contiguous(), n=n, k=k)


def dequant_packed_ref(p: Packed4) -> torch.Tensor:
    """Torch reference of the packed layout: float32 [N, K]."""
    q = torch.stack([p.q & 0x0F, p.q >> 4], dim=-1).reshape(p.n, p.k // 32, 32).float()
    w = q * p.scale.float()[..., None] - p.minv.float()[..., None]
    return w.reshape(p.n, p.k)


if triton is not None:
    @triton.jit
    def _q4_mm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, part_ptr, M, N, K,
                      stride_xm, stride_qn, stride_sn, K_SPLIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * K_SPLIT
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = k_start + kk
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float16)
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            qb = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :], mask=mask_n[:, None], other=0)
            lo = (qb & 0x0F).to(tl.float16)
            hi = (qb >> 4).to(tl.float16)
            qv = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // 32, 32))
            offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=mask_n[:, None], other=0.0)
            mn = tl.load(m_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=mask_n[:, None], other=0.0)
            w = tl.reshape(qv * s[:, :, None] - mn[:, :, None], (BLOCK_N, BLOCK_K))
            acc += tl.dot(x, tl.trans(w))
        out = part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def _split_k(n_tiles: int, k: int, block_k: int, n_sm: int) -> int:
    """Enough K slices that the grid covers every SM about twice; each slice a whole number of
    BLOCK_K steps."""
    steps = k // block_k
    want = max(1, -(-2 * n_sm // max(n_tiles, 1)))
    split = 1
    for s in range(1, steps + 1):
        if steps % s == 0:
            split = s
            if s >= want:
                break
    return split


def q4_matmul(x: torch.Tensor, p: Packed4, block_n: int = 64, block_k: int = 256, split_k: int | None = None,
              block_m: int = 16, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ W.T -> float32 [M, N] with W in the packed layout (Triton; CUDA or interpreter)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    M, K = x.shape
    assert K == p.k and K % block_k == 0
    n_tiles = -(-p.n // block_n)
    if split_k is None:
        n_sm = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        # from the weight's shape only, never from M: a row's sum order must not depend on how
        # many other rows share the step (batch invariance)
        split_k = _split_k(n_tiles, K, block_k, n_sm)
    part = torch.empty((split_k, M, p.n), dtype=torch.float32, device=x.device)
    x = x.contiguous()
    grid = (n_tiles, split_k, -(-M // block_m))
    _q4_mm_kernel[grid](x, p.q, p.scale, p.minv, part, M, p.n, K,
                        x.stride(0), p.q.stride(0), p.scale.stride(0), K_SPLIT=K // split_k,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        **({} if not x.is_cuda else dict(num_warps=num_warps, num_stages=num_stages)))
    return part.sum(0) if split_k > 1 else part[0]
