"""The CPU path's elementwise ops of a layer compiled with numba: RMSNorm (rows or heads), SwiGLU gating, and
per-head norm + rotary embedding, each computing the float64 (or, for rope, float32) operations of its torch
reference in kernels/fused.py in the same order, rounded once to float32 (`_round`: docs/ACCURACY.md).

Same signatures as the references (`ref_rms_norm`, `ref_silu_mul`, `ref_qk_norm_rope`); each
function here takes the numba kernel when numba imports and the input is a float32 CPU tensor, else the
reference. The elementwise float64 ops (products, quotients, square roots, exp, tanh) are IEEE operations in the
reference's order; the sums run in index order, where torch's vectorized float64 reductions (and its SLEEF exp /
tanh) may differ from them in the last bit of a float64: ~1e-16 relative, which the one rounding to float32 turns
into a different float32 about once in 10^8 values (tests/kernels/cpu/test_rows.py checks the float32 bits). No
fastmath: nothing is reassociated or fused into an FMA. On the torch side a decode row's norm was ~10 small torch
ops (~50 us); here it is one call (~5-10 us with its tensor conversions).

GeGLU (gemma3) stays torch's: its 0.5 x (1 + tanh(u)) cancels for negative x, where torch's vectorized tanh and
libm's differ by more than float32 hides (11 of 10752 products differed).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels import fused
from kernels.cpu.jit import LazyKernels, parallel_launch


def _compile() -> dict:
    import numba
    numba.config.THREADING_LAYER = "workqueue"   # as kernels/quant/intdot_numba.py: beside torch's OpenMP
    from kernels.cpu import rows_numba as m
    return {"rms_norm": m.rms_norm_rows, "silu": m.silu_rows, "silu_parallel": m.silu_rows_parallel,
            "norm_rope": m.norm_rope_rows, "numba": numba}


def _warm(k: dict) -> None:
    x = np.ones((1, 4), np.float32)
    k["rms_norm"](x, x[0], True, 1e-6, np.empty_like(x))
    k["silu"](x, x, np.empty_like(x))
    k["silu_parallel"](x, x, np.empty_like(x))
    x3 = np.ones((1, 1, 4), np.float32)
    k["norm_rope"](x3, x[0], True, True, 1e-6, x[:, :2].copy(), x[:, :2].copy(), 4, False, np.empty_like(x3))


_KERNELS = LazyKernels(_compile, _warm)
PARALLEL_ROWS = 32   # SwiGLU of at least this many rows (prompt rows) runs on every thread; fewer on the calling one
_NO_W = np.zeros(1, np.float32)


def available() -> bool:
    """Whether numba imports here (else the functions below run their torch references)."""
    return _KERNELS.get() is not None


def _f32_cpu(*ts) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


def _w(w: torch.Tensor | None):
    return _NO_W if w is None else w.contiguous().numpy()


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fused.ref_rms_norm: x * rsqrt(mean(x^2) + eps) * w over the last dim, any leading dims."""
    k = _KERNELS.get()
    if k is None or out_dtype not in (None, torch.float32) or not _f32_cpu(x) or x.ndim < 1 or x.numel() == 0 \
            or (w is not None and not _f32_cpu(w)):
        return fused.ref_rms_norm(x, w, eps, out_dtype)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = np.empty(x2.shape, np.float32)
    k["rms_norm"](x2.numpy(), _w(w), w is not None, float(eps), out)
    return torch.from_numpy(out).view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fused.ref_silu_mul: silu(gate) * up in float64, rounded once."""
    k = _KERNELS.get()
    if k is None or out_dtype not in (None, torch.float32) or not _f32_cpu(gate, up) or gate.shape != up.shape \
            or gate.ndim < 1 or gate.numel() == 0:
        return fused.ref_silu_mul(gate, up, out_dtype)
    g2 = gate.reshape(-1, gate.shape[-1]).contiguous()
    u2 = up.reshape(-1, up.shape[-1]).contiguous()
    out = np.empty(g2.shape, np.float32)
    if g2.shape[0] >= PARALLEL_ROWS and torch.get_num_threads() > 1:
        with parallel_launch(k["numba"]):
            k["silu_parallel"](g2.numpy(), u2.numpy(), out)
    else:
        k["silu"](g2.numpy(), u2.numpy(), out)
    return torch.from_numpy(out).view(gate.shape)


def qk_norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 rope_dim: int, neox: bool) -> torch.Tensor:
    """fused.ref_qk_norm_rope: x [N, H, D] RMS-normed per head with w (skipped when w is None), then rotated over its
    first rope_dim dims with cos / sin [N, rope_dim / 2]."""
    k = _KERNELS.get()
    if k is None or x.ndim != 3 or not _f32_cpu(x, cos, sin) or (w is not None and not _f32_cpu(w)) \
            or rope_dim % 2 or rope_dim > x.shape[-1] or tuple(cos.shape) != (x.shape[0], rope_dim // 2) \
            or sin.shape != cos.shape or x.numel() == 0:
        return fused.ref_qk_norm_rope(x, w, eps, cos, sin, rope_dim, neox)
    out = np.empty(x.shape, np.float32)
    k["norm_rope"](x.contiguous().numpy(), _w(w), w is not None, w is not None, float(eps), cos.contiguous().numpy(),
                   sin.contiguous().numpy(), int(rope_dim), bool(neox), out)
    return torch.from_numpy(out)
