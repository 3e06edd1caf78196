"""One query row's attention over a paged KV cache on the CPU, with its K/V write: the numba kernel reads the keys and
values straight from the pool's blocks through the block table (no gather copy) and computes the float64 attention
of kernels/attention/ref.py's `causal_attention` (scores, scale, softmax, weighted sum) in the same operations and
order, rounded once to float32.

`decode_attention(q, k, v, k_cache, v_cache, table, first, start, scale, window, codec_k, codec_v)`: write k [1,
Hkv, D] and v [1, Hkv, Dv] at position `start` (blocks of `table`, a long tensor of block ids, -1 for a block a
sliding window dropped; `first`: the first position still held), then attend q [1, H, D] (GQA: head i reads KV head
i // (H / Hkv)) over positions first..start (window > 0: the last `window` of them). Returns float32 [1, H, Dv].
`ref_decode_attention` is the torch code the CPU path runs otherwise (engine/kv/sequence.py: encode, indexed write,
gather, decode, causal_attention), with the same signature.
`paged_decode(q, k_cache, v_cache, block_tables, seq_lens, codec_k, codec_v, scale, head_dim_v, window)`: the
runner's decode rows (engine/runner/attention.py), their K/V already in the pool: row r's q [H, D] at position
seq_lens[r] - 1 over the blocks of block_tables[r]; its reference is kernels/attention/ref.py's `ref_paged_decode`
(the same leading arguments). Cache types f16 and bf16 (the values themselves, 16 bits: `supported`); the others
take the reference.

The K / V rows are encoded as torch's .to(float16) / .to(bfloat16) rounds them (nearest even) and decoded exactly
(fp16: the bits moved into a float32 and scaled by 2^112; bf16: the float32's upper half). The float64 products and exp are IEEE
operations in the reference's order; the sums (the q . k dot, the softmax's, the weighted sum of values) run in
key and channel order, where BLAS and torch's vectorized softmax may sum in another order: a last-bit float64
difference, which the one rounding to float32 almost never shows (tests/kernels/cpu/test_paged_decode.py checks
the float32 bits; docs/decisions/cpu-decode-step.md).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.attention.ref import causal_attention, gather_blocks, ref_paged_decode
from kernels.cpu.jit import LazyKernels

_KINDS = {"f16": 0, "bf16": 1}


def _compile() -> dict:
    from kernels.cpu import paged_decode_numba as m
    return {"decode_attend": m.decode_attend, "attend_rows": m.attend_rows, "encode_row": m.encode_row,
            "decode_row": m.decode_row, "decode_rows": m.decode_rows}


def _warm(k: dict) -> None:
    kc = np.zeros((1, 16, 1, 4), np.int16)
    bits = np.ones((1, 4), np.float32).view(np.int32)
    k["decode_attend"](np.ones((1, 4), np.float32), bits, bits, kc, kc.copy(), np.zeros(1, np.int64), 0, 0, 0.5, 0,
                       0, 0, np.empty((1, 4), np.float32))
    k["attend_rows"](np.ones((1, 1, 4), np.float32), kc, kc.copy(), np.zeros((1, 1), np.int32),
                     np.ones(1, np.int32), 0.5, 0, 0, 0, np.empty((1, 1, 4), np.float32))


_KERNELS = LazyKernels(_compile, _warm)


def available() -> bool:
    return _KERNELS.get() is not None


def supported(codec_k, codec_v) -> bool:
    """Whether the kernel takes these cache types (f16 / bf16 K and V) and numba imports here."""
    return codec_k.name in _KINDS and codec_v.name in _KINDS and available()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, first: int, start: int, scale: float, window: int, codec_k,
                     codec_v) -> torch.Tensor:
    """Write k, v at `start` and attend q over positions first..start (see the module docstring); float32 [1, H, Dv].
    Takes the reference where the kernel does not apply."""
    if not supported(codec_k, codec_v) or q.shape[0] != 1 or k.shape[0] != 1 or q.dtype != torch.float32 \
            or q.device.type != "cpu" or k_cache.device.type != "cpu":
        return ref_decode_attention(q, k, v, k_cache, v_cache, table, first, start, scale, window, codec_k, codec_v)
    kern = _KERNELS.get()
    H, dv = q.shape[1], v.shape[2]
    out = np.empty((H, dv), np.float32)
    kk, kv = _KINDS[codec_k.name], _KINDS[codec_v.name]
    kern["decode_attend"](q[0].numpy(), k[0].float().contiguous().view(torch.int32).numpy(),
                          v[0].float().contiguous().view(torch.int32).numpy(), k_cache.view(torch.int16).numpy(),
                          v_cache.view(torch.int16).numpy(), table.numpy(), int(first), int(start), float(scale),
                          int(window), kk, kv, out)
    return torch.from_numpy(out).view(1, H, dv)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, codec_k, codec_v, scale: float, head_dim_v: int, window: int = 0,
                 seg_bias: torch.Tensor | None = None, seg_len: int = 0) -> torch.Tensor:
    """Decode rows over the pool, their K/V written (see the module docstring); float32 [rows, H, head_dim_v].
    block_tables, seq_lens: int32, as the runner keeps them (read as they are, no copy). Takes the reference
    (kernels/attention/ref.py: ref_paged_decode) where the kernel does not apply (another cache type, a score bias)."""
    if (not supported(codec_k, codec_v) or seg_bias is not None or q.dtype != torch.float32
            or q.device.type != "cpu" or block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32):
        return ref_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, codec_k, codec_v, scale, head_dim_v,
                                window, seg_bias=seg_bias, seg_len=seg_len)
    kern = _KERNELS.get()
    out = np.empty((q.shape[0], q.shape[1], head_dim_v), np.float32)
    kern["attend_rows"](q.contiguous().numpy(), k_cache.view(torch.int16).numpy(), v_cache.view(torch.int16).numpy(),
                        block_tables.contiguous().numpy(), seq_lens.contiguous().numpy(), float(scale), int(window),
                        _KINDS[codec_k.name], _KINDS[codec_v.name], out)
    return torch.from_numpy(out)


def ref_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, table: torch.Tensor, first: int, start: int, scale: float, window: int,
                         codec_k, codec_v) -> torch.Tensor:
    """The torch code: k, v encoded and written at `start`, the held blocks gathered and decoded, causal_attention
    (float64) of q over them, the output taken from the stored domain."""
    bs = k_cache.shape[1]
    blk, slot = int(table[start // bs]), start % bs
    k_cache[blk, slot] = codec_k.encode(k[0])
    v_cache[blk, slot] = codec_v.encode(v[0])
    got_first, kp = gather_blocks(k_cache, table, start + 1)
    _, vp = gather_blocks(v_cache, table, start + 1)
    if got_first != first:
        raise ValueError(f"the table's first held position is {got_first}, not {first}")
    K, V = codec_k.decode_stored(kp), codec_v.decode_stored(vp)
    out = causal_attention(codec_k.to_stored(q), K, V, start, scale, window, k_start=first)
    return codec_v.from_stored(out, v.shape[-1])
