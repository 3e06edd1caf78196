"""Triton attention over the paged KV pool, for every cache type.

Both kernels read K and V straight from the pool's bytes ([n_blocks, block_size, Hkv, row_bytes]
per layer) through each sequence's block table, decoding tiles in registers with
kernels/kvcodec/triton_decode.load_values, and run an online softmax (flash attention). Query heads
of one KV head are processed together (GQA: query head i uses KV head i // G). For rotated cache
types the caller's query is rotated first and the output rotated back afterwards (the wrappers
here do both), so the kernels never rotate.

- `paged_decode_attention`: one query per sequence (decode), split-K over the context
  (flash-decoding): each program reduces one slice of the keys for all G heads of one KV head and
  writes a partial (max, sum, acc); the partials are combined in a fixed order. How a row's keys are
  split depends on its length alone (not on the other rows).
- `paged_prefill_attention`: a chunk of queries per sequence (several sequences in one launch)
  against all earlier KV and causal inside the chunk.
Both take a sliding window (keys with p - p' < window) and qwen35's output gate (out * sigmoid(gate)).

The query must be given as the keys were stored: engine/kv's SequenceKV centers and smooths keys
of rotated cache types per sequence, so its `prep_query(layer, q)` (q times the channel weights)
is what goes in, with `score_bias(layer, q)` (q . the center of each key segment, added to the
score of every key of that segment). engine/runner/runner.py keeps the centers of every slot in one buffer and
makes a decode step's table with `segment_bias` (Triton, row by row).
"""
from __future__ import annotations


import torch

from kernels.family import FAMILIES, Family, by_family, device_family
from kernels.fused import _last_contig
from kernels.kvcodec import KVCodec
from kernels.kvcodec.base import placeholder

try:
    import triton
    import triton.language as tl
    from kernels.kvcodec.triton_decode import load_values
    from kernels.pdl import pdl_enter
except ImportError:  # CPU-only installs use kernels.attention.ref
    triton = None

from kernels.pdl import pdl_args


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:
    @triton.jit
    def _row_split(len_ptr, b, NSPLIT, WINDOW: tl.constexpr, MIN_KEYS: tl.constexpr, BLOCK_T: tl.constexpr,
                   SHORT_KEYS: tl.constexpr = 0, SHORT_SPLITS: tl.constexpr = 8):
        """Row b's keys (L: its length, lo: its first visible key) and the keys per split-K program: the
        lo..L keys spread over NSPLIT programs, at least MIN_KEYS each (short rows use fewer programs),
        whole key tiles. SHORT_KEYS > 0: a row too short for SHORT_SPLITS programs of MIN_KEYS keys gets
        about SHORT_SPLITS programs of at least SHORT_KEYS keys instead (a short row alone on the GPU
        waits on one program's chain of key tiles otherwise). Depends on the row alone, so a row's result
        does not depend on the other rows of the step (batch invariance)."""
        L = tl.load(len_ptr + b)
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(L - WINDOW, 0)
        fewest = MIN_KEYS
        if SHORT_KEYS > 0:
            fewest = tl.minimum(tl.maximum(tl.cdiv(tl.cdiv(L - lo, SHORT_SPLITS), BLOCK_T) * BLOCK_T, SHORT_KEYS),
                                MIN_KEYS)
        per = tl.maximum(tl.cdiv(tl.cdiv(L - lo, NSPLIT), BLOCK_T) * BLOCK_T, fewest)
        return L, lo, per

    @triton.jit
    def _dot(a, b, DOT: tl.constexpr):
        if DOT == "f16":      # tensor cores on fp16 inputs, fp32 accumulation (flash attention's usual)
            return tl.dot(a.to(tl.float16), b.to(tl.float16))
        else:
            return tl.dot(a, b, input_precision=DOT)

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, cbk_ptr, cbv_ptr, acc_ptr, ml_ptr, sb_ptr,
                       scale, H, HKV, MAXB, RBK, RBV, NSPLIT, NSEG, WINDOW: tl.constexpr, SEG: tl.constexpr,
                       G: tl.constexpr, G_PAD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BS: tl.constexpr, BLOCK_T: tl.constexpr, MIN_KEYS: tl.constexpr,
                       CODEC_K: tl.constexpr, CODEC_V: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr = False,
                       SHORT_KEYS: tl.constexpr = 0):
        pdl_enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        L, lo, per = _row_split(len_ptr, b, NSPLIT, WINDOW, MIN_KEYS, BLOCK_T, SHORT_KEYS)
        s0 = lo + sp * per
        if s0 < L:          # unused splits write nothing: _combine_kernel reads only the used ones
            s1 = tl.minimum(L, s0 + per)
            g = tl.arange(0, G_PAD)
            mg = g < G
            qh = h * G + g
            dk = tl.arange(0, DK)
            dv = tl.arange(0, DV)
            q = tl.load(q_ptr + (b * H + qh)[:, None].to(tl.int64) * DK + dk[None, :], mask=mg[:, None], other=0.0)
            m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
            l_i = tl.zeros((G_PAD,), tl.float32)
            acc = tl.zeros((G_PAD, DV), tl.float32)
            for t0 in range(s0, s1, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                mt = t < s1
                blk = tl.load(bt_ptr + b * MAXB + t // BS, mask=mt, other=0)
                blk = tl.maximum(blk, 0).to(tl.int64)
                row = (blk * BS + t % BS) * HKV + h
                kt = load_values(k_ptr, row * RBK, dk, mt, cbk_ptr, CODEC_K)            # [BLOCK_T, DK]
                s = _dot(q, tl.trans(kt), DOT)                                        # [G_PAD, BLOCK_T]
                if SEG > 0:   # the keys' per-segment centers: q . center of the key's segment
                    s += tl.load(sb_ptr + (b * H + qh)[:, None].to(tl.int64) * NSEG + (t // SEG)[None, :],
                                 mask=mg[:, None] & mt[None, :], other=0.0)
                s = s * scale
                s = tl.where(mt[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = load_values(v_ptr, row * RBV, dv, mt, cbv_ptr, CODEC_V)            # [BLOCK_T, DV]
                acc = acc * alpha[:, None] + _dot(p, vt, DOT)
                m_i = m_new
            o = ((b * H + qh) * NSPLIT + sp).to(tl.int64)
            tl.store(acc_ptr + o[:, None] * DV + dv[None, :], acc, mask=mg[:, None])
            tl.store(ml_ptr + o * 2, m_i, mask=mg)
            tl.store(ml_ptr + o * 2 + 1, l_i, mask=mg)

    @triton.jit
    def _combine_kernel(acc_ptr, ml_ptr, len_ptr, out_ptr, gate_ptr, H, NSPLIT, stride_gb, stride_gh,
                        WINDOW: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, MIN_KEYS: tl.constexpr,
                        GATE: tl.constexpr = False, PDL: tl.constexpr = False, SHORT_KEYS: tl.constexpr = 0):
        """One query head of one row: its used splits' partial (max, sum, acc) merged in split order; GATE:
        times sigmoid(gate[b, head]) (Qwen3.5's gated attention), stored in out's dtype."""
        pdl_enter(PDL)
        b = tl.program_id(0)
        qh = tl.program_id(1)
        L, lo, per = _row_split(len_ptr, b, NSPLIT, WINDOW, MIN_KEYS, BLOCK_T, SHORT_KEYS)
        used = tl.cdiv(L - lo, per)
        dv = tl.arange(0, DV)
        m = -float("inf")
        l_ = 0.0
        acc = tl.zeros((DV,), tl.float32)
        base = (b * H + qh).to(tl.int64) * NSPLIT
        for sp in range(0, used):
            ms = tl.load(ml_ptr + (base + sp) * 2)
            ls = tl.load(ml_ptr + (base + sp) * 2 + 1)
            m_new = tl.maximum(m, ms)
            alpha = tl.exp(m - m_new)
            beta = tl.exp(ms - m_new)
            acc = acc * alpha + tl.load(acc_ptr + (base + sp) * DV + dv) * beta
            l_ = l_ * alpha + ls * beta
            m = m_new
        o = acc / l_
        if GATE:
            g = tl.load(gate_ptr + b.to(tl.int64) * stride_gb + qh * stride_gh + dv).to(tl.float32)
            o = o * (1.0 / (1.0 + tl.exp(-g)))      # (kernels/fused.py's a * sigmoid(b), in float32)
        tl.store(out_ptr + (b * H + qh).to(tl.int64) * DV + dv, o)

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, start_ptr, cbk_ptr, cbv_ptr, out_ptr, sb_ptr,
                        scale, H, HKV, MAXB, RBK, RBV, NSEG, WINDOW: tl.constexpr, SEG: tl.constexpr,
                        G: tl.constexpr, G_PAD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                        CODEC_K: tl.constexpr, CODEC_V: tl.constexpr, DOT: tl.constexpr):
        b = tl.program_id(0)
        tile = tl.program_id(1)
        h = tl.program_id(2)
        row0 = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - row0
        if tile * BLOCK_M < n:
            qs = tl.load(start_ptr + b)
            R: tl.constexpr = BLOCK_M * G_PAD
            r = tl.arange(0, R)
            i = tile * BLOCK_M + r // G_PAD                      # token within the chunk
            g = r % G_PAD
            mrow = (i < n) & (g < G)
            qpos = qs + i
            dk = tl.arange(0, DK)
            dv = tl.arange(0, DV)
            qrow = ((row0 + i) * H + h * G + g).to(tl.int64)
            q = tl.load(q_ptr + qrow[:, None] * DK + dk[None, :], mask=mrow[:, None], other=0.0)
            hi = qs + tl.minimum(n, (tile + 1) * BLOCK_M)          # keys < hi
            lo = 0
            if WINDOW > 0:
                lo = tl.maximum(qs + tile * BLOCK_M - WINDOW + 1, 0)
            m_i = tl.full((R,), float("-inf"), tl.float32)
            l_i = tl.zeros((R,), tl.float32)
            acc = tl.zeros((R, DV), tl.float32)
            for t0 in range((lo // BLOCK_T) * BLOCK_T, hi, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                mt = (t < hi) & (t >= lo)
                blk = tl.load(bt_ptr + b * MAXB + t // BS, mask=mt, other=0)
                blk = tl.maximum(blk, 0).to(tl.int64)
                krow = (blk * BS + t % BS) * HKV + h
                kt = load_values(k_ptr, krow * RBK, dk, mt, cbk_ptr, CODEC_K)
                s = tl.dot(q, tl.trans(kt), input_precision=DOT)                 # [R, BLOCK_T]
                if SEG > 0:
                    s += tl.load(sb_ptr + qrow[:, None] * NSEG + (t // SEG)[None, :],
                                 mask=mrow[:, None] & mt[None, :], other=0.0)
                s = s * scale
                vis = mt[None, :] & (t[None, :] <= qpos[:, None])
                if WINDOW > 0:
                    vis = vis & (qpos[:, None] - t[None, :] < WINDOW)
                s = tl.where(vis, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = load_values(v_ptr, krow * RBV, dv, mt, cbv_ptr, CODEC_V)
                acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=DOT)
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + qrow[:, None] * DV + dv[None, :], out, mask=mrow[:, None])


if triton is not None:
    @triton.jit
    def _seg_bias_kernel(q_ptr, c_ptr, slot_ptr, out_ptr, H, HKV, NSEG, G: tl.constexpr, G_PAD: tl.constexpr,
                         D: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
        ms = s < NSEG
        slot = tl.load(slot_ptr + b).to(tl.int64)
        g = tl.arange(0, G_PAD)
        mg = g < G
        d = tl.arange(0, D)
        qrow = (b * H + h * G + g).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=mg[:, None], other=0.0)
        c = tl.load(c_ptr + ((slot * NSEG + s) * HKV + h)[:, None] * D + d[None, :], mask=ms[:, None], other=0.0)
        out = tl.dot(q, tl.trans(c), input_precision="ieee")                  # [G_PAD, BLOCK_S]
        tl.store(out_ptr + qrow[:, None] * NSEG + s[None, :], out, mask=mg[:, None] & ms[None, :])


def segment_bias(q: torch.Tensor, centers: torch.Tensor, slots: torch.Tensor, block_s: int = 32) -> torch.Tensor:
    """The score correction of per-segment key centers for one query per row: q [B, H, D] (original
    domain), centers [n_slots, n_seg, Hkv, D] float32, slots [B] -> [B, H, n_seg] with
    out[b, i, s] = q[b, i] . centers[slots[b], s, i // G] (engine/runner/runner.py; SequenceKV.score_bias on
    the CPU path). Triton, one program per (row, KV head, segment block): a row's numbers do not
    depend on the other rows."""
    B, H, D = q.shape
    _, n_seg, hkv, dc = centers.shape
    if dc != D or D < 16 or D & (D - 1):
        raise ValueError(f"head size {D} must equal the centers' ({dc}) and be a power of two >= 16")
    G = H // hkv
    out = torch.empty(B, H, n_seg, dtype=torch.float32, device=q.device)
    if B:
        _seg_bias_kernel[(B, hkv, triton.cdiv(n_seg, block_s))](
            q.float().contiguous(), centers.contiguous(), slots.contiguous(), out, H, hkv, n_seg,
            G=G, G_PAD=max(16, _next_pow2(G)), D=D, BLOCK_S=block_s)
    return out


def _finish(out_st: torch.Tensor, codec_v: KVCodec, head_dim_v: int, gate: torch.Tensor | None) -> torch.Tensor:
    out = codec_v.from_stored(out_st, head_dim_v)
    return out * torch.sigmoid(gate.float()) if gate is not None else out


def _seg_args(seg_bias, seg_len, q):
    if seg_bias is None or not seg_len:
        return placeholder(q.device), 1, 0
    sb = seg_bias.float().contiguous()
    return sb, sb.shape[-1], int(seg_len)


def _check(k_cache, v_cache, codec_k, codec_v, q_st_dim):
    nblk, bs, hkv, rbk = k_cache.shape
    dk = rbk // codec_k.group_bytes * codec_k.group
    dv = v_cache.shape[3] // codec_v.group_bytes * codec_v.group
    if dk != q_st_dim:
        raise ValueError(f"query has {q_st_dim} values per head in the cache's domain, the K cache {dk}")
    for d in (dk, dv):
        if d < 16 or d & (d - 1):
            raise ValueError(f"head size {d} (as stored) must be a power of two >= 16 for the Triton kernels")
    return bs, hkv, dk, dv


# the decode kernel's launch: keys per tile, warps, pipeline stages, fewest keys per split-K program;
# and what engine/runner/runner.py asks for on CUDA: the most split-K programs per row and KV head, the dots'
# input precision
DECODE_CONFIG = dict(block_t=16, num_warps=4, num_stages=1, min_keys=64, max_split=64, dot="f16")
# K and V both fp16/bf16 rows, read with 16-byte loads: longer tiles, pipelined (H200, 27B shape, inside
# CUDA graphs: one row at 23K 67.7 -> 43.6 us, four at 23K 165.7 -> 126.2, one at 128K 306 -> 151.5;
# .ci/gpu/sweep_attn.py, docs/PERFORMANCE.md). The coded types decode bytes per value and
# are slower with these settings (twice as slow for turbo4), so they keep DECODE_CONFIG.
# A row under 8 * 256 keys gets about 8 programs of at least 64 keys (short_keys; H200, 27B shape, in CUDA
# graphs, us a layer: one row at 512 keys 17.0 -> 9.0, four 17.3 -> 10.0; the 27B's 1-row step 7.81 ->
# 7.73-7.76 ms; a fixed 64 for every row lost at 16 rows of 2-4K keys, 46.8 -> 60.9; .ci/gpu/
# sweep_attn.py --short, docs/decisions/short-rows-attention-split.md).
SHORT_KEYS = 64
FLOAT_DECODE_CONFIG = dict(DECODE_CONFIG, block_t=64, num_warps=8, num_stages=2, min_keys=256, short_keys=SHORT_KEYS)


# the decode kernel's settings by GPU family (kernels/family.py, docs/GPU_FAMILIES.md): "float" for fp16/bf16
# K and V, "coded" for the rest
DECODE_SETTINGS: dict[str, dict] = {
    "sm80": dict(float=FLOAT_DECODE_CONFIG, coded=DECODE_CONFIG),
    "sm86": dict(float=FLOAT_DECODE_CONFIG, coded=DECODE_CONFIG),
    "sm90": dict(float=FLOAT_DECODE_CONFIG, coded=DECODE_CONFIG),
    "sm100": dict(float=FLOAT_DECODE_CONFIG, coded=DECODE_CONFIG),
    "sm120": dict(float=FLOAT_DECODE_CONFIG, coded=DECODE_CONFIG),
}


def decode_config(codec_k: KVCodec, codec_v: KVCodec, family: Family | None = None) -> dict:
    """The decode kernel's settings for a pair of cache types on a GPU family (default sm90; fixed per runner:
    min_keys sets how a row's keys are split)."""
    row = by_family(DECODE_SETTINGS, family or FAMILIES["sm90"])
    if codec_k.name in ("f16", "bf16") and codec_v.name in ("f16", "bf16"):
        return row["float"]
    return row["coded"]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, codec_k: KVCodec, codec_v: KVCodec, scale: float, head_dim_v: int,
                           window: int = 0, gate: torch.Tensor | None = None, n_split: int | None = None,
                           block_t: int | None = None, seg_bias: torch.Tensor | None = None, seg_len: int = 0,
                           precision: str = "ieee", min_keys: int | None = None,
                           out_dtype: torch.dtype | None = None, short_keys: int | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at position seq_lens[b] - 1, its K/V already written);
    block_tables int [B, max_blocks] (-1: dropped); seq_lens int [B]; seg_bias [B, H, n_seg] and
    seg_len: the key centers' score correction (SequenceKV.score_bias). n_split: the most split-K
    programs per row and KV head (a row uses fewer when it has under min_keys keys per split; keep it
    fixed across steps: it sets how a row's keys are split). precision: the dots' inputs ("ieee": fp32,
    "tf32", "f16": tensor cores). gate [B, H, head_dim_v]: the output times sigmoid(gate) (in the merge
    kernel where V is not rotated). Returns [B, H, head_dim_v], float32 or out_dtype."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    B, H, _ = q.shape
    q_st = codec_k.to_stored(q).contiguous()
    bs, hkv, dk, dv = _check(k_cache, v_cache, codec_k, codec_v, q_st.shape[-1])
    G = H // hkv
    cfg = decode_config(codec_k, codec_v, device_family(q.device) if q.is_cuda else None)
    block_t = block_t or cfg["block_t"]
    min_keys = -(-(min_keys or cfg["min_keys"]) // block_t) * block_t
    short_keys = cfg.get("short_keys", 0) if short_keys is None else short_keys
    short_keys = -(-short_keys // block_t) * block_t if 0 < short_keys < min_keys else 0
    if n_split is None:
        longest = int(seq_lens.max()) if B else 0
        n_split = max(1, min(16, -(-longest // 512)))      # about 512+ keys per program
    bt = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).to(q.device).contiguous()
    acc = torch.empty(B, H, n_split, dv, dtype=torch.float32, device=q.device)
    ml = torch.empty(B, H, n_split, 2, dtype=torch.float32, device=q.device)
    # the gate in the merge kernel where the stored values are the output's (no rotation, no padding)
    fuse = gate is not None and not codec_v.rotated and dv == head_dim_v and tuple(gate.shape) == (B, H, dv)
    out_st = torch.empty(B, H, dv, dtype=(out_dtype or torch.float32) if fuse else torch.float32, device=q.device)
    sb, nseg, seg = _seg_args(seg_bias, seg_len, q)
    if B:
        pdl = pdl_args(q_st)
        _decode_kernel[(B, hkv, n_split)](
            q_st, k_cache, v_cache, bt, lens, codec_k.codebook(q.device), codec_v.codebook(q.device), acc, ml, sb,
            float(scale), H, hkv, bt.shape[1], k_cache.shape[3], v_cache.shape[3], n_split, nseg, WINDOW=int(window),
            SEG=seg, G=G, G_PAD=max(16, _next_pow2(G)), DK=dk, DV=dv, BS=bs, BLOCK_T=block_t, MIN_KEYS=min_keys,
            CODEC_K=codec_k.codec_id, CODEC_V=codec_v.codec_id, DOT=precision, SHORT_KEYS=short_keys,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
        g = _last_contig(gate) if fuse else out_st      # (a tensor the kernel does not read without the gate)
        _combine_kernel[(B, H)](acc, ml, lens, out_st, g, H, n_split, g.stride(0), g.stride(1), WINDOW=int(window),
                                DV=dv, BLOCK_T=block_t, MIN_KEYS=min_keys, GATE=fuse, SHORT_KEYS=short_keys, **pdl)
    if fuse:
        return out_st
    out = _finish(out_st, codec_v, head_dim_v, gate)
    return out if out_dtype is None else out.to(out_dtype)


# the prompt kernel's settings by GPU family (kernels/family.py, docs/GPU_FAMILIES.md): q_values, the most
# query values (positions x padded heads x head size) a program holds, and block_t, the keys per step.
# sm90: 16K values, 32 keys (the 27B's head_dim 256 with 6 heads per KV head in blocks of 8 positions: 16 asked
# for 297 KB of shared memory on the H200, whose limit is 227 KB). Compiled for sm_86 (tests/kernels/aot.py), a
# rotated cache type (turbo*) at head_dim 256 with 6 heads per KV head asks for 201 KB with those, 164.5 KB at 8K
# values, 132.5 KB at 16K values and 16 keys, 98.25-99 KB at 8K values and 16 keys (99.25-99.5 KB for sm_120: over
# its 99 KB), 81 KB at 4K values and 16 keys: sm80 (163 KB) keeps the 16K-value query block with 16 keys a step,
# sm86 and sm120 (99 KB) take 4K values and 16 keys (four times the programs, each reading every key up to its
# rows; not timed on a card).
PREFILL_SETTINGS: dict[str, dict] = {
    "sm80": dict(q_values=16384, block_t=16),
    "sm86": dict(q_values=4096, block_t=16),
    "sm90": dict(q_values=16384, block_t=32),
    "sm100": dict(q_values=16384, block_t=32),
    "sm120": dict(q_values=4096, block_t=16),
}


def prefill_block_m(block_m: int, g: int, dk: int, dv: int, q_values: int) -> int:
    """The prompt kernel's query positions per program: block_m halved until block_m x G_PAD heads x the
    larger head size is at most q_values (a program holds its queries and their fp32 accumulator)."""
    while block_m > 1 and block_m * _next_pow2(g) * max(dk, dv) > q_values:
        block_m //= 2
    return block_m


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens: torch.Tensor, q_starts: torch.Tensor, codec_k: KVCodec, codec_v: KVCodec,
                            scale: float, head_dim_v: int, window: int = 0, gate: torch.Tensor | None = None,
                            block_m: int = 16, block_t: int | None = None, seg_bias: torch.Tensor | None = None,
                            seg_len: int = 0, precision: str = "ieee", longest: int | None = None) -> torch.Tensor:
    """Chunks of several sequences: q [N, H, D], rows cu_seqlens[b]..cu_seqlens[b+1] belong to
    sequence b and sit at positions q_starts[b]..; each attends causally over its KV up to its last
    row (already written). seg_bias [N, H, n_seg], seg_len: as for paged_decode_attention.
    precision: the dot products' input precision ("ieee": fp32; "tf32": tensor cores, 10-bit
    mantissa inputs, several times faster over long contexts). longest: the longest chunk, when the
    caller knows it (saves reading cu_seqlens back). block_m, block_t: query positions and keys per program
    and step, at most (default block_t and the query block's size: PREFILL_SETTINGS' row for the device's
    family). Returns float32 [N, H, head_dim_v]."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    N, H, _ = q.shape
    q_st = codec_k.to_stored(q).contiguous()
    bs, hkv, dk, dv = _check(k_cache, v_cache, codec_k, codec_v, q_st.shape[-1])
    G = H // hkv
    cu = cu_seqlens.to(torch.int32).to(q.device).contiguous()
    starts = q_starts.to(torch.int32).to(q.device).contiguous()
    B = cu.numel() - 1
    if longest is None:
        longest = int((cu[1:] - cu[:-1]).max()) if B else 0
    bt = block_tables.to(torch.int32).contiguous()
    out_st = torch.zeros(N, H, dv, dtype=torch.float32, device=q.device)
    row = by_family(PREFILL_SETTINGS, device_family(q.device) if q.is_cuda else FAMILIES["sm90"])
    block_m = prefill_block_m(block_m, G, dk, dv, row["q_values"])
    block_t = block_t or row["block_t"]
    sb, nseg, seg = _seg_args(seg_bias, seg_len, q)
    if N:
        _prefill_kernel[(B, -(-longest // block_m), hkv)](
            q_st, k_cache, v_cache, bt, cu, starts, codec_k.codebook(q.device), codec_v.codebook(q.device), out_st,
            sb, float(scale), H, hkv, bt.shape[1], k_cache.shape[3], v_cache.shape[3], nseg, WINDOW=int(window),
            SEG=seg, G=G, G_PAD=_next_pow2(G), DK=dk, DV=dv, BS=bs, BLOCK_M=block_m, BLOCK_T=block_t,
            CODEC_K=codec_k.codec_id, CODEC_V=codec_v.codec_id, DOT=precision)
    return _finish(out_st, codec_v, head_dim_v, gate)
