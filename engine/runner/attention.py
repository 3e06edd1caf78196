"""Attention on the runner's path: how the Runner's rows attend over the paged KV pool (engine/runner/runner.py),
the Runner's `attention` (a SlotAttention).
Decode rows: the paged Triton kernel (kernels/attention/paged.py) for every cache type; without Triton (the CPU)
the numba kernel of kernels/cpu/paged_decode.py for 16-bit caches, else the torch reference. Prompt chunks:
FlashAttention over the slot's gathered K/V for float caches, over K/V decoded in pieces for compressed ones
(CUDA), else the paged prefill kernel; without Triton kernels/cpu/causal.py over the slot's gathered blocks (the
torch reference where keys are preconditioned). The rows' new K/V are encoded into the pool first (and, for
rotated K types, preconditioned: engine/runner/keyprep.py). On the CPU these are the CPU path's kernels: the same
bits as model.forward over a SequenceKV (tests/engine/test_runner.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.models.common import HeadPrep
from kernels.attention.flash import attention_lse, flash_chunk_attention, flash_fits, merge_attention
from kernels.cpu.causal import paged_attention
from kernels.cpu.paged_decode import paged_decode

if TYPE_CHECKING:
    from engine.runner.batch import SlotBatch
    from engine.runner.keyprep import KeyPrep

DECODED_PIECE = 8192   # keys decoded at a time for a prompt chunk's attention over a compressed cache


class SlotAttention:
    """One attention layer for a SlotBatch (decode rows or one slot's prompt chunk) over the runner's paged pool.
    k, v: the runner's pool per attention layer (the same dicts); block_table: its device table [slots + 1,
    max_blocks]; keys: its KeyPreconditioner (engine/runner/keyprep.py); read_rows(cache, codec, d, slot, pos): a
    slot's stored rows decoded (Runner._read_rows). triton: the Triton kernels (else their torch references);
    prefill_dot: the Triton prefill attention's dot precision; decoded_prefill: prompt chunks over compressed caches
    as decoded pieces through FlashAttention (_prefill_decoded); n_split, decode_dot: the decode kernel's split-K
    programs per row and its dot precision, fixed for the runner's life (a row's reduction order must not depend on
    the others)."""

    def __init__(self, spec, k: dict, v: dict, codec_k, codec_v, block_table: torch.Tensor, block_size: int, keys,
                 read_rows, *, triton: bool, prefill_dot: str, decoded_prefill: bool, n_split: int, decode_dot: str):
        self.spec, self.k, self.v = spec, k, v
        self.codec_k, self.codec_v = codec_k, codec_v
        self.block_table, self.block_size = block_table, block_size
        self.keys, self.kprep, self.segment = keys, keys.layers, keys.segment
        self._read_rows = read_rows
        self.triton, self._impl = triton, "triton" if triton else "auto"
        self.prefill_dot, self.decoded_prefill = prefill_dot, decoded_prefill
        self.n_split, self._decode_dot = n_split, decode_dot

    def _kernel_writes(self, device: torch.device) -> bool:
        """Whether new K/V rows go into the pool by write_kv_rows (or norm_rope_write_kv): the Triton path
        and float cache types (bf16 on the GPU only: Triton's interpreter truncates to bf16 where torch and
        the GPU round to nearest). One kernel instead of two casts and two index_copy_ (torch kernels, outside
        the step's programmatic dependent launch), the same bits: the 27B's 1-row step 8.09 -> 7.99 ms on the
        H200 (docs/decisions/kv-write-kernel.md). The others encode and index_copy_."""
        types = ("f16", "f32", "bf16") if device.type == "cuda" else ("f16", "f32")
        return self.triton and self.codec_k.name in types and self.codec_v.name in types

    def attend(self, b: SlotBatch, il, q, k, v, scale, window):
        s = self.spec
        kc, vc = self.k[il], self.v[il]
        ck, cv = self.codec_k, self.codec_v
        kp = self.kprep.get(il)
        q_orig = q
        bias, seg_len = None, 0
        if kp is not None:
            if b.decode:
                if b.centers:
                    self.keys.decode_centers(kp, kc, b, window)
            else:
                self.keys.prefill_kprep(kp, kc, b, q, k, window)
            k, q, bias = self.keys.precondition(kp, b, q, k)
            seg_len = self.segment
        flat = b.rows()                                                # each row's place in the pool
        if self._kernel_writes(k.device):
            from kernels.attention.kv_write import write_kv_rows
            write_kv_rows(k, v, kc, vc, flat, ck.dtype, cv.dtype)
        else:
            kc.view(-1, s.n_head_kv, kc.shape[-1]).index_copy_(0, flat, ck.encode(k, self._impl))
            vc.view(-1, s.n_head_kv, vc.shape[-1]).index_copy_(0, flat, cv.encode(v, self._impl))
        return self._attend_stored(b, il, q, q_orig, bias, seg_len, scale, window, kp)

    def attend_prepared(self, b: SlotBatch, il, q, k, v, prep: HeadPrep, scale, window, gate=None, out_dtype=None):
        """Decode rows whose q and k still need `prep` (their norms and rope): over a float cache without
        key preconditioning, one kernel does prep, writes K and V into the pool and hands back the queries
        (kernels/attention/kv_write.py: norm_rope_write_kv), then they attend (times sigmoid(gate) in
        out_dtype, when given, in the attention's merge kernel). None: not this case (the caller preps and
        attends as usual)."""
        if not (il not in self.kprep and self._kernel_writes(q.device)
                and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
            return None
        from kernels.attention.kv_write import norm_rope_write_kv
        q = norm_rope_write_kv(q, k, v, prep.q_norm, prep.k_norm, prep.eps, prep.cos, prep.sin, prep.rope.dim,
                               prep.rope.neox, self.k[il], self.v[il], b.rows(), self.codec_k.dtype,
                               self.codec_v.dtype)
        return self._decode_attention(b, il, q, scale, window, gate=gate, out_dtype=out_dtype)

    def _decode_attention(self, b: SlotBatch, il, q, scale, window, bias=None, seg_len=0, gate=None,
                          out_dtype=None):
        """Decode rows over the pool with the Triton kernel (their K and V written)."""
        from kernels.attention.paged import paged_decode_attention
        return paged_decode_attention(q, self.k[il], self.v[il], b.tables(), b.lengths(), self.codec_k,
                                      self.codec_v, scale, self.spec.head_dim_v, window, n_split=self.n_split,
                                      seg_bias=bias, seg_len=seg_len, precision=self._decode_dot, gate=gate,
                                      out_dtype=out_dtype)

    def _attend_stored(self, b: SlotBatch, il, q, q_orig, bias, seg_len, scale, window, kp):
        """The rows' attention once their keys and values are in the pool (q preconditioned as the keys
        were when kp is given; q_orig: as the model made it)."""
        s = self.spec
        kc, vc = self.k[il], self.v[il]
        ck, cv = self.codec_k, self.codec_v
        tk = self.triton
        if b.decode:
            if tk:
                return self._decode_attention(b, il, q, scale, window, bias, seg_len)
            return paged_decode(q, kc, vc, b.tables(), b.lengths(), ck, cv, scale, s.head_dim_v, window,
                                seg_bias=bias, seg_len=seg_len)
        bt = self.block_table[b.slot]
        if b.bidirectional:
            return self._prefill_two_way(b, il, q_orig, kp, scale, window)
        if q.is_cuda and ck.name in ("f16", "bf16") and cv.name == ck.name:
            return self._prefill_sdpa(b, kc, vc, q, scale, window)
        if self.decoded_prefill and not window and "f32" not in (ck.name, cv.name):   # (f32: full precision)
            return self._prefill_decoded(b, kc, vc, q_orig, scale, kp)
        if tk:
            from kernels.attention.paged import paged_prefill_attention
            n = q.shape[0]
            cu = torch.tensor([0, n], dtype=torch.int32)
            starts = torch.tensor([b.start], dtype=torch.int32)
            return paged_prefill_attention(q, kc, vc, bt[None], cu, starts, ck, cv, scale, s.head_dim_v, window,
                                           seg_bias=bias, seg_len=seg_len, precision=self.prefill_dot, longest=n)
        return paged_attention(q, kc, vc, bt, b.start, ck, cv, scale, s.head_dim_v, window,
                               seg_bias=bias, seg_len=seg_len)

    def _prefill_sdpa(self, b: SlotBatch, kc, vc, q, scale, window):
        """A chunk's queries over its slot's float KV with torch's fused attention (cuDNN / memory-efficient
        kernels). The slot's blocks are gathered into one contiguous copy first (one layer's context at a
        time: 94 MB for 23K tokens of the 27B in f16, less than the GQA expansion below)."""
        s, T = self.spec, q.shape[0]
        end = b.start + T
        dt = self.codec_k.dtype
        blocks = self.block_table[b.slot, :-(-end // self.block_size)].long()
        K = kc.index_select(0, blocks).view(-1, s.n_head_kv, kc.shape[-1])[:end].view(dt)
        V = vc.index_select(0, blocks).view(-1, s.n_head_kv, vc.shape[-1])[:end].view(dt)
        if flash_fits(q, K, V):
            return flash_chunk_attention(q.to(dt), K, V, scale, window).float()
        return self._masked_attention(q, K, V, b.start, scale, window, dt)

    def _masked_attention(self, q, K, V, start, scale, window, dt, spans=()):
        """Queries at start.. over the keys and values of positions 0.. (K, V [S, Hkv, D]) with torch's fused
        attention and an explicit mask: causal, windowed, and (spans [lo, hi)) both ways inside each span
        (kernels/attention/ref.py's causal_attention mask); in dt, the result float32."""
        s, end = self.spec, K.shape[0]
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(end, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= qpos - kpos < window
        for lo, hi in spans:
            mask |= (qpos >= lo) & (qpos < hi) & (kpos >= lo) & (kpos < hi)
        G = s.n_head // s.n_head_kv
        out = F.scaled_dot_product_attention(
            q.to(dt).transpose(0, 1)[None], K.to(dt).repeat_interleave(G, 1).transpose(0, 1)[None],
            V.to(dt).repeat_interleave(G, 1).transpose(0, 1)[None], attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1).float()

    def _prefill_two_way(self, b: SlotBatch, il, q, kp: KeyPrep | None, scale, window):
        """A prompt chunk holding spans attended both ways (Gemma 3's image tokens, b.bidirectional): the
        slot's keys and values decoded (original domain, any cache type; q as the model made it) and one
        masked attention, causal and windowed as usual but for pairs of positions inside one span
        (kernels/attention/ref.py's causal_attention mask). Rare (an image's chunk), so not fused."""
        pos = torch.arange(b.start + q.shape[0], device=q.device)
        K = self.keys.stored_keys(kp, self.k[il], b.slot, pos)
        V = self._read_rows(self.v[il], self.codec_v, self.spec.head_dim_v, b.slot, pos)
        dt = torch.float16 if q.is_cuda and "f32" not in (self.codec_k.name, self.codec_v.name) else torch.float32
        return self._masked_attention(q, K, V, b.start, scale, window, dt, b.bidirectional)

    def _prefill_decoded(self, b: SlotBatch, kc, vc, q, scale, kp: KeyPrep | None):
        """A prompt chunk over a compressed cache: the slot's K/V decoded to fp16 one piece of
        DECODED_PIECE keys at a time (original domain; keys un-preconditioned: stored * w + their
        segment's center), each piece through FlashAttention with its log-sum-exp (the last piece, which
        holds the chunk, causal), the pieces merged. Each stored value is decoded once per chunk, where
        the paged kernel decodes it again for every tile of queries. q: the chunk's queries as the model
        made them (not preconditioned)."""
        s, T = self.spec, q.shape[0]
        end = b.start + T
        piece = max(DECODED_PIECE, T)             # (so that only the last piece holds the chunk's own keys)
        dt = torch.float16 if q.is_cuda else torch.float32   # (FlashAttention takes fp16; the CPU's math f32)
        qh = q.to(dt)
        acc = None                                # (out, lse) of the pieces so far
        hi = end
        while hi > 0:
            lo = max(0, hi - piece)
            pos = torch.arange(lo, hi, device=q.device)
            K = self.keys.stored_keys(kp, kc, b.slot, pos)
            V = self._read_rows(vc, self.codec_v, s.head_dim_v, b.slot, pos)
            acc = merge_attention(acc, attention_lse(qh, K.to(dt), V.to(dt), scale, causal=hi == end))
            hi = lo
        return acc[0]
