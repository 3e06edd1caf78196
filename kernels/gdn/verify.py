"""A drafting step's Gated DeltaNet (qwen35): each slot's rows - its token and its drafts, consecutive rows at
consecutive positions - through the causal conv and the delta rule in order, in one pass; and the commit that
afterwards applies the rows verification accepted.

Verifying k drafts needs every row's output as successive one-row steps would give it, but the states after
only the accepted rows. `gdn_verify` therefore leaves the states of multi-row slots as they were and keeps
those rows' inputs (their conv outputs, raw qkv rows and gates); `gdn_commit` later runs a slot's first `keep`
kept rows through its states, for all recurrent layers in one launch of the delta rule and one of the conv
windows (the states and kept inputs stacked by layer). A slot with one row in the step (a sequence that does
not draft) is updated in place, as by the decode step (recurrent.py). Each row goes through the decode step's
own code (`_conv_tile`, `_delta_step`) with its tile settings for a step of as many rows (`block_v`), and the
commit reuses the step's conv outputs and settings, so the outputs and states are those of one-row steps run
with those settings.

The step's layout, int64 [6, B] (B rows, device memory so a captured graph serves every layout):
  0 slot of row r (< 0: padding), 1 its index among its slot's rows, 2 its slot's row count;
  3-5 per group (a slot's rows, or one padding row; unused entries count 0): slot, first row, row count.
Shapes as recurrent.py's; kept = (x_keep [>= B, C] (the rows' conv outputs, normed), qkv_keep [>= B, C] (the
raw rows), g_keep [>= B, Hv], beta_keep [>= B, Hv]), float32, rows as the step's. For gdn_commit every tensor
has a leading layer axis: conv_w [L, C, K], conv_state [L, n_slots, K-1, C], S [L, n_slots, Hv, D, D], the kept
[L, R, ..].
"""
from __future__ import annotations

import torch

from kernels.gdn.recurrent import _check, _next_pow2, delta_block_v, delta_warps, gdn_gates, ref_gdn_decode

try:
    import triton
    import triton.language as tl
    from kernels._interpreter_compat import apply as _fix_interpreter
    from kernels.gdn.recurrent import _conv_tile, _delta_step, _softplus
    _fix_interpreter()
    HAVE_TRITON = True
except ImportError:   # CPU-only installs use the references
    triton = None
    HAVE_TRITON = False


def draft_layout(slots: list[int], scratch: int | None = None, always: bool = False) -> list[list[int]] | None:
    """The layout rows (module doc) of a step whose rows have the given slots (scratch, or any slot < 0:
    padding rows), or, unless always, None when every slot has one row. ValueError when a slot's rows are
    not consecutive."""
    B = len(slots)
    real = [s for s in slots if s >= 0 and s != scratch]
    if len(set(real)) == len(real) and not always:
        return None
    lay = [[-1] * B, [0] * B, [1] * B, [-1] * B, [0] * B, [0] * B]
    r, gi = 0, 0
    seen = set()
    while r < B:
        s = slots[r]
        pad = s < 0 or s == scratch
        n = 1
        while not pad and r + n < B and slots[r + n] == s:
            n += 1
        if not pad:
            if s in seen:
                raise ValueError(f"slot {s}'s rows are not consecutive in the step")
            seen.add(s)
        for j in range(n):
            lay[0][r + j], lay[1][r + j], lay[2][r + j] = (-1 if pad else s), j, n
        lay[3][gi], lay[4][gi], lay[5][gi] = (-1 if pad else s), r, n
        r, gi = r + n, gi + 1
    return lay


def ref_gdn_verify(qkv, conv_w, conv_state, S, layout, g, beta, n_k_heads, d_state, eps, kept,
                   gate=None, block_v=None) -> torch.Tensor:
    """Torch reference of `gdn_verify` (module doc): row by row through ref_gdn_decode, multi-row slots on
    copies of their states. Reads the layout on the host. Keeps the raw rows and gates (its commit computes
    the conv again, in the CPU's float64: ref_gdn_decode), not x_keep; block_v is the kernel's."""
    if gate is not None:
        g, beta = gdn_gates(g, beta, *gate)
    B, C, K, Hk, Hv, D = _check(qkv, conv_w, conv_state, S, layout[0], g, beta, n_k_heads, d_state)
    o = torch.zeros(B, Hv, D, dtype=torch.float32, device=qkv.device)
    lay = layout.tolist()
    one = torch.zeros(1, dtype=torch.long, device=qkv.device)
    for gi in range(B):
        slot, first, n = lay[3][gi], lay[4][gi], lay[5][gi]
        if n == 0 or slot < 0:
            continue
        if n == 1:
            sl = torch.tensor([slot], dtype=torch.long, device=qkv.device)
            o[first] = ref_gdn_decode(qkv[first:first + 1], conv_w, conv_state, S, sl, g[first:first + 1],
                                      beta[first:first + 1], Hk, D, eps)[0]
            continue
        cs, st = conv_state[slot:slot + 1].clone(), S[slot:slot + 1].clone()
        for r in range(first, first + n):
            o[r] = ref_gdn_decode(qkv[r:r + 1], conv_w, cs, st, one, g[r:r + 1], beta[r:r + 1], Hk, D, eps)[0]
        for dst, src in zip(kept[1:], (qkv, g, beta)):
            dst[first:first + n].copy_(src[first:first + n])
    return o


def ref_gdn_commit(conv_w, conv_state, S, kept, slot: int, first: int, keep: int, n_k_heads: int, d_state: int,
                   eps: float, block_v=None) -> None:
    """Torch reference of `gdn_commit`: every layer's kept rows first..first+keep-1 through slot's states,
    one row at a time (ref_gdn_decode, from the raw rows)."""
    _x_keep, qkv_keep, g_keep, beta_keep = kept
    sl = torch.tensor([slot], dtype=torch.long, device=conv_state.device)
    for il in range(conv_state.shape[0]):
        for r in range(first, first + keep):
            ref_gdn_decode(qkv_keep[il, r:r + 1], conv_w[il], conv_state[il], S[il], sl, g_keep[il, r:r + 1],
                           beta_keep[il, r:r + 1], n_k_heads, d_state, eps)


if HAVE_TRITON:
    @triton.jit
    def _xin_tile(cs, qkv_ptr, stride_qkv, row0, c0, ch, md, C, K: tl.constexpr, KP: tl.constexpr):
        """The conv's K inputs [KP, DP] of channels ch for the row whose inputs start at combined index c0 of
        [the slot's K-1 kept inputs (cs); the rows from row0 on] (a row j of its slot: c0 = j)."""
        r = tl.arange(0, KP)
        c = c0 + r
        mstate = ((c < K - 1) & (r < K))[:, None] & md[None, :]
        mrow = ((c >= K - 1) & (r < K))[:, None] & md[None, :]
        src = (row0 + c - (K - 1)).to(tl.int64) * stride_qkv
        return (tl.load(cs + c[:, None] * C + ch[None, :], mask=mstate, other=0.0)
                + tl.load(qkv_ptr + src[:, None] + ch[None, :], mask=mrow, other=0.0)).to(tl.float32)

    @triton.jit
    def _verify_conv_kernel(qkv_ptr, w_ptr, cs_ptr, lay_ptr, x_ptr, kq_ptr, C, stride_qkv, B, HK, D, eps, scale,
                            K: tl.constexpr, KP: tl.constexpr, DP: tl.constexpr):
        b = tl.program_id(0)
        hh = tl.program_id(1)                      # head of channels: q 0..HK-1, k HK..2HK-1, v after
        slot = tl.load(lay_ptr + b)
        j = tl.load(lay_ptr + B + b)
        n = tl.load(lay_ptr + 2 * B + b)
        if slot >= 0:
            d = tl.arange(0, DP)
            md = d < D
            ch = hh * D + d
            cs = cs_ptr + slot * (K - 1) * C
            xin = _xin_tile(cs, qkv_ptr, stride_qkv, b - j, j, ch, md, C, K, KP)
            tl.store(x_ptr + b.to(tl.int64) * C + ch, _conv_tile(xin, w_ptr, ch, md, hh, HK, eps, scale, K, KP),
                     mask=md)
            if n == 1:                             # a slot without drafts: its window moves on, as in decode
                nxt = _xin_tile(cs, qkv_ptr, stride_qkv, b, 1, ch, md, C, K, KP)
                r = tl.arange(0, KP)
                tl.debug_barrier()                 # all reads of this slot's channels precede the shift
                tl.store(cs + r[:, None] * C + ch[None, :], nxt, mask=(r[:, None] < K - 1) & md[None, :])
            else:                                  # kept for the commit
                tl.store(kq_ptr + b.to(tl.int64) * C + ch,
                         tl.load(qkv_ptr + b.to(tl.int64) * stride_qkv + ch, mask=md, other=0.0), mask=md)

    @triton.jit
    def _verify_delta_kernel(x_ptr, s_ptr, lay_ptr, g_ptr, beta_ptr, o_ptr, dt_ptr, a_ptr, kg_ptr, kb_ptr,
                             C, B, HK, HV, D, stride_g, stride_beta,
                             DP: tl.constexpr, BV: tl.constexpr, RAW_GATES: tl.constexpr):
        gi = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(lay_ptr + 3 * B + gi)
        first = tl.load(lay_ptr + 4 * B + gi)
        n = tl.load(lay_ptr + 5 * B + gi)
        dv = vb * BV + tl.arange(0, BV)
        mv = dv < D
        dk = tl.arange(0, DP)
        mk = dk < D
        hk = h % HK
        if slot >= 0:
            sp = s_ptr + (slot * HV + h) * D * D + dk[:, None] * D + dv[None, :]
            ms = mk[:, None] & mv[None, :]
            s = tl.load(sp, mask=ms, other=0.0)
            for i in range(0, n):
                b = first + i
                row = b.to(tl.int64) * C
                q = tl.load(x_ptr + row + hk * D + dk, mask=mk, other=0.0)
                k = tl.load(x_ptr + row + HK * D + hk * D + dk, mask=mk, other=0.0)
                v = tl.load(x_ptr + row + 2 * HK * D + h * D + dv, mask=mv, other=0.0)
                gg = tl.load(g_ptr + b * stride_g + h).to(tl.float32)
                bb = tl.load(beta_ptr + b * stride_beta + h).to(tl.float32)
                if RAW_GATES:
                    gg = _softplus(gg + tl.load(dt_ptr + h)) * tl.load(a_ptr + h)
                    bb = 1.0 / (1.0 + tl.exp(-bb))
                s, o = _delta_step(s, q, k, v, gg, bb)
                tl.store(o_ptr + (b * HV + h).to(tl.int64) * D + dv, o, mask=mv)
                if (n > 1) & (vb == 0):            # kept for the commit
                    tl.store(kg_ptr + b * HV + h, gg)
                    tl.store(kb_ptr + b * HV + h, bb)
            if n == 1:
                tl.store(sp, s, mask=ms)
        else:
            for i in range(0, n):
                tl.store(o_ptr + ((first + i) * HV + h).to(tl.int64) * D + dv, tl.zeros((BV,), tl.float32),
                         mask=mv)

    @triton.jit(do_not_specialize=["slot", "first", "keep"])
    def _commit_delta_kernel(kx_ptr, s_ptr, kg_ptr, kb_ptr, slot, first, keep, C, HK, HV, D, n_slots, R,
                             DP: tl.constexpr, BV: tl.constexpr):
        il = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        dv = vb * BV + tl.arange(0, BV)
        mv = dv < D
        dk = tl.arange(0, DP)
        mk = dk < D
        hk = h % HK
        sp = s_ptr + ((il * n_slots + slot) * HV + h) * D * D + dk[:, None] * D + dv[None, :]
        ms = mk[:, None] & mv[None, :]
        s = tl.load(sp, mask=ms, other=0.0)
        for i in range(0, keep):   # the kept rows' conv outputs and gates, as the step's delta rule read them
            row = (il * R + first + i) * C
            q = tl.load(kx_ptr + row + hk * D + dk, mask=mk, other=0.0)
            k = tl.load(kx_ptr + row + HK * D + hk * D + dk, mask=mk, other=0.0)
            v = tl.load(kx_ptr + row + 2 * HK * D + h * D + dv, mask=mv, other=0.0)
            gg = tl.load(kg_ptr + (il * R + first + i) * HV + h)
            bb = tl.load(kb_ptr + (il * R + first + i) * HV + h)
            s, _o = _delta_step(s, q, k, v, gg, bb)
        tl.store(sp, s, mask=ms)

    @triton.jit(do_not_specialize=["slot", "first", "keep"])
    def _commit_window_kernel(kq_ptr, cs_ptr, slot, first, keep, C, D, n_slots, R, K: tl.constexpr,
                              KP: tl.constexpr, DP: tl.constexpr):
        il = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        d = tl.arange(0, DP)
        md = d < D
        ch = hh * D + d
        cs = cs_ptr + (il * n_slots + slot) * (K - 1) * C
        nxt = _xin_tile(cs, kq_ptr + il * R * C, C, first, keep, ch, md, C, K, KP)
        r = tl.arange(0, KP)
        tl.debug_barrier()
        tl.store(cs + r[:, None] * C + ch[None, :], nxt, mask=(r[:, None] < K - 1) & md[None, :])


def gdn_verify_triton(qkv, conv_w, conv_state, S, layout, g, beta, n_k_heads, d_state, eps, kept,
                      gate=None, block_v=None) -> torch.Tensor:
    """The Triton drafting step (module doc): two launches, no host synchronisation. The rows' conv outputs
    go to x_keep (the delta rule reads them there)."""
    B, C, K, Hk, Hv, D = _check(qkv, conv_w, conv_state, S, layout[0], g, beta, n_k_heads, d_state)
    if layout.shape != (6, B) or not layout.is_contiguous():
        raise ValueError(f"layout must be a contiguous [6, {B}] tensor, got {tuple(layout.shape)}")
    kx, kq, kg, kb = kept
    if (kx.shape[0] < B or kx.shape[1:] != (C,) or kq.shape[0] < B or kq.shape[1:] != (C,)
            or kg.shape[1:] != (Hv,) or kb.shape[1:] != (Hv,)):
        raise ValueError("kept buffers must be [>= B, conv_dim] twice, [>= B, Hv], [>= B, Hv]")
    o = torch.empty(B, Hv, D, dtype=torch.float32, device=qkv.device)
    if B == 0:
        return o
    DP = _next_pow2(D)
    KP = _next_pow2(K)
    qkv_c = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    g_c = g if g.stride(-1) == 1 else g.contiguous()
    beta_c = beta if beta.stride(-1) == 1 else beta.contiguous()
    dt_c, a_c = (t.float().contiguous() for t in gate) if gate is not None else (g_c, g_c)
    _verify_conv_kernel[(B, 2 * Hk + Hv)](qkv_c, conv_w.contiguous(), conv_state, layout, kx, kq, C, qkv_c.stride(0),
                                          B, Hk, D, float(eps), float(D ** -0.5), K=K, KP=KP, DP=DP,
                                          num_warps=max(1, min(4, DP * KP // 256)))
    BV = block_v or delta_block_v(B, Hv, D)
    _verify_delta_kernel[(B, Hv, triton.cdiv(D, BV))](kx, S, layout, g_c, beta_c, o, dt_c, a_c, kg, kb, C, B, Hk,
                                                      Hv, D, g_c.stride(0), beta_c.stride(0), DP=DP, BV=BV,
                                                      RAW_GATES=gate is not None, num_warps=delta_warps(DP, BV))
    return o


def gdn_commit_triton(conv_w, conv_state, S, kept, slot: int, first: int, keep: int, n_k_heads: int, d_state: int,
                      eps: float, block_v=None, warmup: bool = False) -> None:
    """The Triton commit (module doc): two launches over all layers (conv_w and eps are the reference's: the
    kept conv outputs are used as they are). block_v: the step's (default: a one-row step's). warmup: only
    compile the kernels for these settings (so that no step waits for it)."""
    kx, kq, kg, kb = kept
    L, n_slots, K1, C = conv_state.shape
    Hv, D, K = S.shape[2], int(d_state), K1 + 1
    Hk = int(n_k_heads)
    R = kq.shape[1]
    if not 0 <= first <= first + keep <= R:
        raise ValueError(f"rows {first}..{first + keep - 1} are outside the kept {R}")
    if keep <= 0 and not warmup:
        return
    DP = _next_pow2(D)
    KP = _next_pow2(K)
    BV = block_v or delta_block_v(1, Hv, D)
    def launch(kernel, grid):
        if not warmup:
            return kernel[grid]

        def compile_only(*a, **kw):
            ck = kernel.warmup(*a, grid=grid, **kw)
            init = getattr(ck, "_init_handles", None)   # (loads it and builds its launcher, as a first launch does)
            if init is not None:
                init()
        return compile_only
    launch(_commit_delta_kernel, (L, Hv, triton.cdiv(D, BV)))(kx, S, kg, kb, slot, first, keep, C, Hk, Hv, D,
                                                              n_slots, R, DP=DP, BV=BV, num_warps=delta_warps(DP, BV))
    launch(_commit_window_kernel, (L, 2 * Hk + Hv))(kq, conv_state, slot, first, keep, C, D, n_slots, R, K=K, KP=KP,
                                                    DP=DP, num_warps=max(1, min(4, DP * KP // 256)))


def _use_triton(impl: str, t: torch.Tensor) -> bool:
    if impl not in ("auto", "ref", "triton"):
        raise ValueError(f"impl must be 'auto', 'ref' or 'triton', not {impl!r}")
    return impl == "triton" or (impl == "auto" and HAVE_TRITON and t.is_cuda)


def gdn_verify(qkv, conv_w, conv_state, S, layout, g, beta, n_k_heads, d_state, eps, kept, gate=None,
               block_v=None, impl: str = "auto") -> torch.Tensor:
    """A drafting step's rows (module doc): Triton on CUDA tensors, else the reference. Returns o [B, Hv, D].
    block_v: the delta rule's tile width (default: delta_block_v of the step's rows)."""
    f = gdn_verify_triton if _use_triton(impl, qkv) else ref_gdn_verify
    return f(qkv, conv_w, conv_state, S, layout, g, beta, n_k_heads, d_state, eps, kept, gate=gate, block_v=block_v)


def gdn_commit(conv_w, conv_state, S, kept, slot: int, first: int, keep: int, n_k_heads: int, d_state: int,
               eps: float, block_v=None, impl: str = "auto") -> None:
    """Apply a drafting slot's first `keep` kept rows to its states in every layer (module doc); block_v: the
    drafting step's."""
    f = gdn_commit_triton if _use_triton(impl, S) else ref_gdn_commit
    f(conv_w, conv_state, S, kept, slot, first, keep, n_k_heads, d_state, eps, block_v=block_v)
