"""Causal attention of a prompt chunk's rows on the CPU, compiled with numba: kernels/attention/ref.py's
`causal_attention` (the same signature) in float64 up to the output, as its torch code computes it (the scores, the
scale, the softmax, the weighted sum of values), rounded once to float32, without the [heads, T, S] score tensor
and its masked half: each query row's scores run over the keys it sees only, the query heads and rows spread
over numba's threads.

The float64 products and exp are IEEE operations in the reference's order; the sums (the q . k dots, the softmax's,
the weighted sum of values) run in channel and key order, where BLAS and torch's vectorized softmax may sum in
another order: a last-bit float64 difference, which the one rounding to float32 almost never shows
(tests/kernels/cpu/test_causal.py checks the float32 bits; kernels/cpu/paged_decode.py computes a decode row the
same way). The kernel takes float32 q, k, v with neither `bidirectional` spans nor `seg_bias` (the f16 / bf16 /
f32 caches, the default); the other inputs take the reference.

`paged_attention` is kernels/attention/ref.py's `ref_paged_attention` (its reference, the same leading arguments)
with this causal_attention: a runner slot's prompt chunk over its gathered, decoded blocks (engine/runner/attention.py).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.attention.ref import causal_attention as ref_causal_attention
from kernels.attention.ref import gathered_kv
from kernels.cpu.jit import LazyKernels, parallel_launch

ROWS = 16   # query rows per work item (with one query head)


def _compile() -> dict:
    import numba
    numba.config.THREADING_LAYER = "workqueue"   # as kernels/quant/intdot_numba.py: beside torch's OpenMP
    from kernels.cpu import causal_numba as m
    return {"heads_transposed": m.heads_transposed, "causal_rows": m.causal_rows, "numba": numba}


def _warm(k: dict) -> None:
    x = np.ones((2, 1, 4), np.float32)
    kt, vh = np.empty((1, 4, 2)), np.empty((1, 2, 4))
    k["heads_transposed"](x, x, kt, vh)
    k["causal_rows"](x, kt, vh, 0, 0, 0.5, 0, ROWS, np.empty((2, 1, 4), np.float32))


_KERNELS = LazyKernels(_compile, _warm)


def available() -> bool:
    return _KERNELS.get() is not None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                     window: int = 0, k_start: int = 0, bidirectional: list[tuple[int, int]] | None = None,
                     seg_bias: torch.Tensor | None = None, seg_len: int = 0) -> torch.Tensor:
    """kernels/attention/ref.py's causal_attention: q [T, H, D] at positions q_start.., k, v [S, Hkv, D] at k_start..
    (the keys through the queries' last position). Returns float32 [T, H, Dv]."""
    T, H, _ = q.shape
    S, hkv, D = k.shape
    if (bidirectional or seg_bias is not None or q.dtype != torch.float32 or k.dtype != torch.float32
            or v.dtype != torch.float32 or q.device.type != "cpu" or k_start + S != q_start + T
            or H % hkv or k_start > q_start or not available()):
        return ref_causal_attention(q, k, v, q_start, scale, window, k_start, bidirectional, seg_bias, seg_len)
    kern = _KERNELS.get()
    dv = v.shape[2]
    kt = np.empty((hkv, D, S), np.float64)
    vh = np.empty((hkv, S, dv), np.float64)
    out = np.empty((T, H, dv), np.float32)
    with parallel_launch(kern["numba"]):
        kern["heads_transposed"](k.contiguous().numpy(), v.contiguous().numpy(), kt, vh)
        kern["causal_rows"](q.contiguous().numpy(), kt, vh, int(q_start), int(k_start), float(scale), int(window),
                            ROWS, out)
    return torch.from_numpy(out)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    q_start: int, codec_k, codec_v, scale: float, head_dim_v: int, window: int = 0,
                    seg_bias: torch.Tensor | None = None, seg_len: int = 0) -> torch.Tensor:
    """ref_paged_attention without its gate: q [T, H, D] at positions q_start.. over the cache through q_start + T
    (the chunk's own K/V written). Returns float32 [T, H, head_dim_v]."""
    first, K, V = gathered_kv(k_cache, v_cache, block_table, q_start + q.shape[0], codec_k, codec_v)
    out = causal_attention(codec_k.to_stored(q), K, V, q_start, scale, window, k_start=first, seg_bias=seg_bias,
                           seg_len=seg_len)
    return codec_v.from_stored(out, head_dim_v)
