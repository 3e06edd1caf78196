"""The random rotation of the turbo codecs: per 128-value group, y = D2 H D1 x / sqrt(128)
(D1, D2 diagonal random signs, H the 128-point Walsh-Hadamard matrix). It is orthonormal, so
inner products survive it: q.k = (Rq).(Rk), which lets attention score rotated keys with a rotated
query and un-rotate only the attention output. Head dims that are not a multiple of 128 are
zero-padded to the next multiple (64 -> 128); wider heads (256) are several groups, each rotated
alike.

On CUDA the rotation runs as a Triton kernel (`_rotate_kernel`): every row is multiplied in the same
fixed order whatever the number of rows, so a decode row's rotated query, encoded key and
un-rotated output do not depend on the other rows of its step (cuBLAS picks its kernel, and with it
the summation order, from the row count)."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use torch
    triton = None

GROUP = 128


def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix [n, n] of +-1 (float64), n a power of two."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def padded_dim(d: int) -> int:
    return -(-d // GROUP) * GROUP


class Rotation:
    """R = diag(signs2) H diag(signs1) / sqrt(128), applied to every 128-group of the last dim."""

    def __init__(self, signs1: torch.Tensor, signs2: torch.Tensor):
        s1 = signs1.to(torch.float64).reshape(GROUP)
        s2 = signs2.to(torch.float64).reshape(GROUP)
        r = s2[:, None] * hadamard(GROUP) * s1[None, :] / GROUP ** 0.5
        self.matrix64 = r
        self._by_device: dict = {}

    def matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """R as float32 on `device` (y = R x, so rows are rotated by x @ R.T)."""
        key = str(device)
        m = self._by_device.get(key)
        if m is None:
            m = self._by_device[key] = self.matrix64.to(torch.float32).to(device).contiguous()
        return m

    def matrix_t(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """R.T as float32 on `device` (contiguous)."""
        key = ("T", str(device))
        m = self._by_device.get(key)
        if m is None:
            m = self._by_device[key] = self.matrix(device).T.contiguous()
        return m

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] (original domain) -> float32 [..., padded_dim(d)] (rotated, zero-padded)."""
        d = x.shape[-1]
        dp = padded_dim(d)
        x = x.float()
        if dp != d:
            x = torch.nn.functional.pad(x, (0, dp - d))
        if x.is_cuda and triton is not None:
            return _rows_times(x, self.matrix_t(x.device))
        g = x.reshape(*x.shape[:-1], dp // GROUP, GROUP)
        return (g @ self.matrix(x.device).T).reshape(*x.shape[:-1], dp)

    def unrotate(self, y: torch.Tensor, d: int | None = None) -> torch.Tensor:
        """Inverse of `rotate`: y [..., padded] -> float32 [..., d] (the padding dropped)."""
        dp = y.shape[-1]
        if y.is_cuda and triton is not None:
            x = _rows_times(y.float(), self.matrix(y.device))
        else:
            g = y.float().reshape(*y.shape[:-1], dp // GROUP, GROUP)
            x = (g @ self.matrix(y.device)).reshape(*y.shape[:-1], dp)
        return x[..., :d] if d is not None and d != dp else x


def _rows_times(x: torch.Tensor, m: torch.Tensor, block_r: int = 16) -> torch.Tensor:
    """Every 128-group of x [..., 128k] times m [128, 128] (Triton, fp32, fixed order per row)."""
    shape = x.shape
    x2 = x.reshape(-1, GROUP).contiguous()
    out = torch.empty_like(x2)
    n = x2.shape[0]
    if n:
        _rotate_kernel[(triton.cdiv(n, block_r),)](x2, m, out, n, BLOCK_R=block_r)
    return out.reshape(shape)


if triton is not None:
    @triton.jit
    def _rotate_kernel(x_ptr, m_ptr, out_ptr, N, BLOCK_R: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mr = (r < N)[:, None]
        j = tl.arange(0, 128)
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * 128 + j[None, :], mask=mr, other=0.0)
        m = tl.load(m_ptr + j[:, None] * 128 + j[None, :])
        tl.store(out_ptr + r.to(tl.int64)[:, None] * 128 + j[None, :], tl.dot(x, m, input_precision="ieee"), mask=mr)
