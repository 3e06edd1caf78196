"""Torch references: plain causal softmax attention, and attention over a paged KV cache in any
cache type (decode the sequence's blocks, rotate the query for rotated types, attend, rotate the
output back). The Triton kernels in paged.py have the same semantics."""
from __future__ import annotations

import torch

from kernels.kvcodec import KVCodec


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                     window: int = 0, k_start: int = 0,
                     bidirectional: list[tuple[int, int]] | None = None,
                     seg_bias: torch.Tensor | None = None, seg_len: int = 0) -> torch.Tensor:
    """Causal attention of q [T, H, D] (positions q_start..q_start+T) over k, v [S, Hkv, D]
    (positions k_start..k_start+S). GQA: each KV head serves H/Hkv query heads (query head i uses KV
    head i // (H/Hkv)). window > 0: a query at p sees keys at p' with p - p' < window (llama.cpp's
    standard sliding window). bidirectional: position spans [lo, hi) whose tokens also see the later
    tokens of their span (Gemma 3 image tokens). seg_bias [T, H, n_seg]: added to the score of a key
    at position p (before `scale`) is seg_bias[..., p // seg_len] (the KV cache's per-segment key
    centers, engine/kv/sequence.py)."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    g = H // Hkv
    qh = q.reshape(T, Hkv, g, D).permute(1, 2, 0, 3)            # [Hkv, g, T, D]
    kh = k.permute(1, 0, 2)[:, None]                              # [Hkv, 1, S, D]
    vh = v.permute(1, 0, 2)[:, None]
    # in float64 up to the output: BLAS sums in an order that depends on T (a prompt's row against the same
    # row alone) and the CPU's instruction set, and so do torch's softmax (its exp and sums); in float32 a
    # query's result moved with the number of queries beside it, and through the CPU path's 8-bit activation
    # rounding that could move a logit by 0.4 (docs/ACCURACY.md)
    wide = q.dtype == torch.float32
    if wide:
        qh, kh, vh = qh.double(), kh.double(), vh.double()
    scores = qh @ kh.transpose(-1, -2)                            # [Hkv, g, T, S]
    # (in place: the same values as new tensors, two fewer passes over the largest tensor here)
    if seg_bias is not None:
        kseg = torch.arange(k_start, k_start + S, device=scores.device) // seg_len
        b = seg_bias.reshape(T, Hkv, g, -1).permute(1, 2, 0, 3)   # [Hkv, g, T, n_seg]
        scores.add_(b[..., kseg])
    scores.mul_(scale)
    qpos = torch.arange(q_start, q_start + T)[:, None]
    kpos = torch.arange(k_start, k_start + S)[None, :]
    masked = kpos > qpos
    if window > 0:
        masked |= (qpos - kpos) >= window
    for lo, hi in bidirectional or ():
        masked &= ~((qpos >= lo) & (qpos < hi) & (kpos >= lo) & (kpos < hi))
    scores.masked_fill_(masked.to(scores.device, non_blocking=True), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh                      # [Hkv, g, T, Dv]
    if wide:
        out = out.float()
    return out.permute(2, 0, 1, 3).reshape(T, H, v.shape[-1])


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, end: int) -> tuple[int, torch.Tensor]:
    """Rows of positions first..end from a paged cache [n_blocks, block_size, Hkv, row_bytes]
    (first: the start of the first block the table still holds; -1 entries are dropped blocks)."""
    bs = cache.shape[1]
    bt = block_table.tolist()
    nb = -(-end // bs)
    fb = 0
    while fb < nb and bt[fb] < 0:
        fb += 1
    ids = torch.tensor(bt[fb:nb], dtype=torch.long, device=cache.device)
    return fb * bs, cache[ids].flatten(0, 1)[: end - fb * bs]


def gathered_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, end: int, codec_k: KVCodec,
                codec_v: KVCodec) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(first, K, V): a sequence's held keys and values through position end - 1, gathered from its blocks and
    decoded into the stored domain (the torch reference's decode)."""
    first, kp = gather_blocks(k_cache, block_table, end)
    _, vp = gather_blocks(v_cache, block_table, end)
    return first, codec_k.decode_stored(kp, impl="ref"), codec_v.decode_stored(vp, impl="ref")


def ref_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        q_start: int, codec_k: KVCodec, codec_v: KVCodec, scale: float, head_dim_v: int,
                        window: int = 0, gate: torch.Tensor | None = None, seg_bias: torch.Tensor | None = None,
                        seg_len: int = 0) -> torch.Tensor:
    """One sequence's chunk: q [T, H, D] at positions q_start.. attends causally over the cache up to
    q_start + T (the chunk's own K/V already written; q and seg_bias/seg_len as the keys were
    stored, see SequenceKV.prep_query / score_bias). Returns float32 [T, H, head_dim_v];
    `gate` [T, H, head_dim_v]: qwen35's gated attention, output * sigmoid(gate)."""
    first, K, V = gathered_kv(k_cache, v_cache, block_table, q_start + q.shape[0], codec_k, codec_v)
    out = causal_attention(codec_k.to_stored(q), K, V, q_start, scale, window, k_start=first, seg_bias=seg_bias,
                           seg_len=seg_len)
    out = codec_v.from_stored(out, head_dim_v)
    return (out.double() * torch.sigmoid(gate.double())).float() if gate is not None else out


def ref_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, codec_k: KVCodec, codec_v: KVCodec, scale: float, head_dim_v: int,
                     window: int = 0, gate: torch.Tensor | None = None, seg_bias: torch.Tensor | None = None,
                     seg_len: int = 0) -> torch.Tensor:
    """Decode: q [B, H, D], one query per sequence at position seq_lens[b] - 1; seg_bias [B, H, n_seg]."""
    outs = []
    for b in range(q.shape[0]):
        L = int(seq_lens[b])
        outs.append(ref_paged_attention(q[b:b + 1], k_cache, v_cache, block_tables[b], L - 1, codec_k, codec_v,
                                        scale, head_dim_v, window, None if gate is None else gate[b:b + 1],
                                        None if seg_bias is None else seg_bias[b:b + 1], seg_len))
    return torch.cat(outs)
