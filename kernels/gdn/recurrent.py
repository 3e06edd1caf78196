"""One decode step of Qwen3.5's Gated DeltaNet (the recurrent part: causal conv, L2 norm, delta rule)
for B sequences of one token each, their state in static per-slot buffers (CUDA-graph friendly).

Shapes (C = conv_dim = (2 Hk + Hv) D, K = the conv kernel size, 4 in Qwen3.5):
  qkv [B, C]                  the fused projection of the new token (q | k | v channels)
  conv_w [C, K]               the depthwise causal conv (tap K-1 multiplies the new token)
  conv_state [n_slots, K-1, C] float32, the last K-1 inputs of each slot (updated in place)
  S [n_slots, Hv, D, D]        float32, the delta-rule state [head, k-dim, v-dim] (updated in place)
  slots [B] int32/int64       each row's slot; < 0: a padding row (state untouched, o = 0)
  g [B, Hv]                   log decay (softplus(alpha x + dt_bias) * a, <= 0); beta [B, Hv] (sigmoid'ed)
Returns o [B, Hv, D] float32 (before the gated RMSNorm). Semantics as engine/models/qwen35.py for
one token: conv = silu(sum_t xin[t] w[:, t]) over xin = [conv_state; qkv]; q, k L2-normed (eps),
V head j uses K head j % Hk (GGUF's tiled order), q scaled by D^-1/2; S <- S exp(g);
S <- S + k (beta (v - S^T k))^T; o = S^T q; the new conv_state is xin[1:].

The Triton path is two launches, no host synchronisation (capturable in a CUDA graph):
1. `_conv_kernel`, grid (B, 2 Hk + Hv), one program per (row, head of q, k or v channels): the
   conv + SiLU of its D channels, the L2 norm (and q's scale) for q/k heads, written to a small
   scratch [B, C]; it also shifts its channels of conv_state in place. Each channel has exactly one
   owner, so the in-place update cannot race with a reader - which it would if every delta-rule
   program recomputed the conv of its (shared) q/k channels from conv_state while another program
   of the same row had already shifted them (there is no grid-wide barrier inside one kernel).
   The scratch is B * C * 4 bytes, ~0.3% of the bytes of S.
2. `_delta_kernel`, grid (B, Hv, D / BV), one program per (row, v-head, slice of BV v-columns):
   loads q, k (its K head) and its slice of v from the scratch, reads its [D, BV] tile of S once,
   decays, applies the delta rule, writes the tile back once, and writes o[b, h, slice].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
    from kernels._interpreter_compat import apply as _fix_interpreter
    from kernels.pdl import pdl_enter
    _fix_interpreter()
except ImportError:  # CPU-only installs use ref_gdn_decode
    triton = None
    HAVE_TRITON = False

from kernels.pdl import pdl_args


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(qkv, conv_w, conv_state, S, slots, g, beta, n_k_heads, d_state):
    """Validates shapes (metadata only: no host sync). Returns B, C, K, Hk, Hv, D."""
    if qkv.ndim != 2:
        raise ValueError(f"qkv must be [B, conv_dim], got {tuple(qkv.shape)}")
    B, C = qkv.shape
    Hk, D = int(n_k_heads), int(d_state)
    if g.ndim != 2 or g.shape[0] != B or beta.shape != g.shape:
        raise ValueError(f"g and beta must be [B, Hv] with B = {B}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    Hv = g.shape[1]
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"n_v_heads ({Hv}) must be a multiple of n_k_heads ({Hk})")
    if C != (2 * Hk + Hv) * D:
        raise ValueError(f"conv_dim {C} != (2 * {Hk} + {Hv}) * {D}")
    if conv_w.ndim != 2 or conv_w.shape[0] != C:
        raise ValueError(f"conv_w must be [conv_dim, K], got {tuple(conv_w.shape)}")
    K = conv_w.shape[1]
    if conv_state.ndim != 3 or conv_state.shape[1:] != (K - 1, C):
        raise ValueError(f"conv_state must be [n_slots, {K - 1}, {C}], got {tuple(conv_state.shape)}")
    if S.ndim != 4 or S.shape[1:] != (Hv, D, D):
        raise ValueError(f"S must be [n_slots, {Hv}, {D}, {D}], got {tuple(S.shape)}")
    if slots.shape != (B,):
        raise ValueError(f"slots must be [{B}], got {tuple(slots.shape)}")
    return B, C, K, Hk, Hv, D


def ref_gdn_decode(qkv: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, S: torch.Tensor,
                   slots: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, n_k_heads: int, d_state: int,
                   eps: float) -> torch.Tensor:
    """Torch reference of the decode step (see the module doc). Updates conv_state[slots] and
    S[slots] in place and returns o [B, Hv, D] float32 (zeros for padding rows, slot < 0).
    Selects the valid rows with nonzero(): a host sync on CUDA, so not for graph capture.
    Slots of valid rows must be distinct."""
    B, C, K, Hk, Hv, D = _check(qkv, conv_w, conv_state, S, slots, g, beta, n_k_heads, d_state)
    o = torch.zeros(B, Hv, D, dtype=torch.float32, device=qkv.device)
    rows = (slots >= 0).nonzero().squeeze(1)
    n = rows.numel()
    if n == 0:
        return o
    sl = slots[rows].long()
    key_dim = Hk * D
    # on the CPU in float64, rounded once into S and o: torch's float32 sums and exp differ with the CPU's
    # instruction set and with the number of rows (docs/ACCURACY.md; the prompt rows' path, block.py's
    # conv_rule_rows, does the same)
    wt = torch.float64 if qkv.device.type == "cpu" else torch.float32
    xin = torch.cat([conv_state[sl].to(wt), qkv[rows].to(wt)[:, None, :]], dim=1)        # [n, K, C]
    conv = F.silu((xin.transpose(1, 2) * conv_w.to(wt)).sum(-1))                        # [n, C]
    q = conv[:, :key_dim].reshape(n, Hk, D)
    k = conv[:, key_dim:2 * key_dim].reshape(n, Hk, D)
    v = conv[:, 2 * key_dim:].reshape(n, Hv, D)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps)
    if Hv != Hk:  # tiled V-head order: V head j uses K head j % Hk
        q = q.repeat(1, Hv // Hk, 1)
        k = k.repeat(1, Hv // Hk, 1)
    q = q * D ** -0.5
    decay = g[rows].double().exp().to(wt)   # (float64: the same bits however many rows, as gdn_gates)
    St = S[sl].to(wt) * decay[:, :, None, None]                                          # [n, Hv, D, D]
    kv_mem = torch.einsum("nhkv,nhk->nhv", St, k)
    delta = (v - kv_mem) * beta[rows].to(wt)[:, :, None]
    St = St + k[:, :, :, None] * delta[:, :, None, :]
    o[rows] = torch.einsum("nhkv,nhk->nhv", St, q).float()
    S[sl] = St.to(S.dtype)
    conv_state[sl] = xin[:, 1:].to(conv_state.dtype)
    return o


if HAVE_TRITON:
    @triton.jit
    def _conv_tile(xin, w_ptr, ch, md, hh, HK, eps, scale, K: tl.constexpr, KP: tl.constexpr):
        """Channels ch of head hh (q 0..HK-1, k HK..2HK-1, v after) from their K conv inputs xin [KP, len(ch)]:
        the conv, SiLU, and for q and k the L2 norm (q also times scale); masked channels give 0. (The
        drafting step's kernels, verify.py, compute their rows with it too: the same bits.)"""
        r = tl.arange(0, KP)
        w = tl.load(w_ptr + ch[None, :].to(tl.int64) * K + r[:, None], mask=(r[:, None] < K) & md[None, :],
                    other=0.0).to(tl.float32)
        conv = tl.sum(xin * w, axis=0)
        conv = conv / (1.0 + tl.exp(-conv))    # SiLU (padded channels stay 0)
        nrm = tl.where(hh < 2 * HK, 1.0 / tl.sqrt(tl.sum(conv * conv, axis=0) + eps), 1.0)
        fac = tl.where(hh < HK, nrm * scale, nrm)
        return conv * fac

    @triton.jit
    def _conv_kernel(qkv_ptr, w_ptr, cs_ptr, slot_ptr, x_ptr, C, stride_qkv, HK, D, eps, scale,
                     K: tl.constexpr, KP: tl.constexpr, DP: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        b = tl.program_id(0)
        hh = tl.program_id(1)                      # head of channels: q 0..HK-1, k HK..2HK-1, v after
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, DP)
            md = d < D
            ch = hh * D + d                        # [DP] channels
            r = tl.arange(0, KP)                   # [KP] taps: rows 0..K-2 of the state, K-1 the new token
            cs = cs_ptr + slot * (K - 1) * C
            row = b.to(tl.int64) * C
            qrow = b.to(tl.int64) * stride_qkv     # (qkv may be a row-strided view of a stacked product)
            mstate = (r[:, None] < K - 1) & md[None, :]
            mnew = (r[:, None] == K - 1) & md[None, :]
            xin = (tl.load(cs + r[:, None] * C + ch[None, :], mask=mstate, other=0.0)
                   + tl.load(qkv_ptr + qrow + ch[None, :] + 0 * r[:, None], mask=mnew, other=0.0)).to(tl.float32)
            # the new state: row r <- xin[r + 1], read before anything is written
            mstate1 = (r[:, None] + 1 < K - 1) & md[None, :]
            mnew1 = (r[:, None] + 1 == K - 1) & md[None, :]
            nxt = (tl.load(cs + (r[:, None] + 1) * C + ch[None, :], mask=mstate1, other=0.0)
                   + tl.load(qkv_ptr + qrow + ch[None, :] + 0 * r[:, None], mask=mnew1, other=0.0)).to(tl.float32)
            tl.store(x_ptr + row + ch, _conv_tile(xin, w_ptr, ch, md, hh, HK, eps, scale, K, KP), mask=md)
            tl.debug_barrier()                     # all reads of this slot's channels precede the shift
            tl.store(cs + r[:, None] * C + ch[None, :], nxt, mask=mstate)

    @triton.jit
    def _softplus(x):
        """torch's softplus (threshold 20): log1p(exp(x)), with log1p by Goldberg's correction (u = 1 + e
        rounds e away; log(u) * e / (u - 1) puts it back), which Triton's math library lacks."""
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        return tl.where(x > 20.0, x, lp)

    @triton.jit
    def _delta_step(s, q, k, v, gg, bb):
        """One token through a [D, BV] slice of a head's state s (float32): decay by exp(gg), the delta rule
        with beta bb, and the token's output columns S^T q (q already scaled). Returns (s, o)."""
        s = s * tl.exp(gg)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * bb
        s = s + k[:, None] * delta[None, :]
        return s, tl.sum(s * q[:, None], axis=0)

    @triton.jit
    def _delta_kernel(x_ptr, s_ptr, slot_ptr, g_ptr, beta_ptr, o_ptr, dt_ptr, a_ptr, C, HK, HV, D,
                      stride_g, stride_beta, DP: tl.constexpr, BV: tl.constexpr, RAW_GATES: tl.constexpr,
                      PDL: tl.constexpr = False):
        pdl_enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        dv = vb * BV + tl.arange(0, BV)
        mv = dv < D
        orow = (b * HV + h).to(tl.int64) * D
        if slot >= 0:
            dk = tl.arange(0, DP)
            mk = dk < D
            row = b.to(tl.int64) * C
            hk = h % HK
            q = tl.load(x_ptr + row + hk * D + dk, mask=mk, other=0.0)                 # normed, scaled
            k = tl.load(x_ptr + row + HK * D + hk * D + dk, mask=mk, other=0.0)        # normed
            v = tl.load(x_ptr + row + 2 * HK * D + h * D + dv, mask=mv, other=0.0)
            gg = tl.load(g_ptr + b * stride_g + h).to(tl.float32)
            bb = tl.load(beta_ptr + b * stride_beta + h).to(tl.float32)
            if RAW_GATES:   # the projections themselves: g = softplus(alpha x + dt_bias) * a, beta = sigmoid(beta x)
                gg = _softplus(gg + tl.load(dt_ptr + h)) * tl.load(a_ptr + h)
                bb = 1.0 / (1.0 + tl.exp(-bb))
            sp = s_ptr + (slot * HV + h) * D * D + dk[:, None] * D + dv[None, :]
            ms = mk[:, None] & mv[None, :]
            s, o = _delta_step(tl.load(sp, mask=ms, other=0.0), q, k, v, gg, bb)      # [DP, BV], [BV]
            tl.store(sp, s, mask=ms)
            tl.store(o_ptr + orow + dv, o, mask=mv)
        else:
            tl.store(o_ptr + orow + dv, tl.zeros((BV,), tl.float32), mask=mv)


def delta_block_v(B: int, Hv: int, D: int) -> int:
    """The v-columns per delta-rule program for a step of B rows (DELTA_CONFIG's, else 16 while the step has
    fewer than 256 programs' worth of columns, then 32); the drafting step and its commit (verify.py) take
    the same for the same rows, so their sums are the decode step's."""
    DP = _next_pow2(D)
    bv = DELTA_CONFIG["block_v"] or (16 if B * Hv * max(1, DP // 32) < 256 else 32)
    return min(_next_pow2(bv), DP)


def delta_warps(DP: int, BV: int) -> int:
    """The delta-rule kernel's warps for [DP, BV] state tiles."""
    return DELTA_CONFIG["num_warps"] or max(1, min(8, DP * BV // 1024))


def gdn_decode_triton(qkv: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, S: torch.Tensor,
                      slots: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, n_k_heads: int, d_state: int,
                      eps: float, block_v: int | None = None, num_warps: int | None = None,
                      gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The Triton decode step (module doc). block_v: v-columns per delta-rule program (a power of two;
    default DELTA_CONFIG's); num_warps: for the delta-rule kernel. gate = (dt_bias [Hv], a [Hv]): g and
    beta are the raw projections (alpha x, beta x), made into the log decay and the sigmoid'ed beta
    inside the kernel (gdn_gates) instead of four small torch launches per layer."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    B, C, K, Hk, Hv, D = _check(qkv, conv_w, conv_state, S, slots, g, beta, n_k_heads, d_state)
    if conv_state.dtype != torch.float32 or S.dtype != torch.float32:
        raise ValueError("conv_state and S must be float32")
    if not (conv_state.is_contiguous() and S.is_contiguous()):
        raise ValueError("conv_state and S must be contiguous (they are updated in place)")
    o = torch.empty(B, Hv, D, dtype=torch.float32, device=qkv.device)
    if B == 0:
        return o
    DP = _next_pow2(D)
    BV = min(_next_pow2(block_v), DP) if block_v is not None else delta_block_v(B, Hv, D)
    if num_warps is None:
        num_warps = delta_warps(DP, BV)
    qkv_c = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    w = conv_w.contiguous()
    sl = slots.contiguous()
    g_c = g if g.stride(-1) == 1 else g.contiguous()            # (row-strided views of a stacked product)
    beta_c = beta if beta.stride(-1) == 1 else beta.contiguous()
    if gate is not None:
        dt_c, a_c = (t.float().contiguous() for t in gate)
        if dt_c.shape != (Hv,) or a_c.shape != (Hv,):
            raise ValueError(f"gate must be (dt_bias [{Hv}], a [{Hv}])")
    else:
        dt_c = a_c = g_c
    x = torch.empty(B, C, dtype=torch.float32, device=qkv.device)   # conv + norm output (scratch)
    pdl = pdl_args(qkv_c)
    _conv_kernel[(B, 2 * Hk + Hv)](qkv_c, w, conv_state, sl, x, C, qkv_c.stride(0), Hk, D, float(eps), float(D ** -0.5),
                                   K=K, KP=_next_pow2(K), DP=DP, num_warps=max(1, min(4, DP * _next_pow2(K) // 256)),
                                   **pdl)
    _delta_kernel[(B, Hv, triton.cdiv(D, BV))](x, S, sl, g_c, beta_c, o, dt_c, a_c, C, Hk, Hv, D,
                                               g_c.stride(0), beta_c.stride(0), DP=DP, BV=BV,
                                               RAW_GATES=gate is not None, num_warps=num_warps, **pdl)
    return o


def gdn_gates(alpha_x: torch.Tensor, beta_x: torch.Tensor, dt_bias: torch.Tensor,
              a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of the gates from the raw projections: g = softplus(alpha_x + dt_bias) * a (the log
    decay, <= 0), beta = sigmoid(beta_x), as engine/models/qwen35.py computes them. On the CPU in float64:
    torch's vectorized and scalar exp/log differ in the last bit, and which one an element gets depends
    on the tensor's size (a step of one row against several), so in float32 a row's gates moved with the
    rows beside it; in float64 they round to the same float32 (kernels/quant/ref.py: matmul_row_invariant)."""
    if alpha_x.device.type == "cpu" and alpha_x.dtype == torch.float32:
        g, beta = gdn_gates(alpha_x.double(), beta_x.double(), dt_bias.double(), a.double())
        return g.float(), beta.float()
    return F.softplus(alpha_x + dt_bias) * a, torch.sigmoid(beta_x)


def gdn_decode(qkv: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, S: torch.Tensor,
               slots: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, n_k_heads: int, d_state: int,
               eps: float, impl: str = "auto", gate: tuple[torch.Tensor, torch.Tensor] | None = None,
               **kw) -> torch.Tensor:
    """The decode step: Triton for CUDA tensors (impl="auto"), else `ref_gdn_decode`; impl "ref" or
    "triton" forces one (the tests run "triton" on the CPU, in Triton's interpreter). `kw`
    (block_v, num_warps) go to the Triton path. The slots of non-padding rows must be distinct.
    gate = (dt_bias, a): g and beta are the raw projections (gdn_gates makes the real ones)."""
    if impl not in ("auto", "ref", "triton"):
        raise ValueError(f"impl must be 'auto', 'ref' or 'triton', not {impl!r}")
    if impl == "triton" or (impl == "auto" and HAVE_TRITON and qkv.is_cuda):
        return gdn_decode_triton(qkv, conv_w, conv_state, S, slots, g, beta, n_k_heads, d_state, eps,
                                 gate=gate, **kw)
    if gate is not None:
        g, beta = gdn_gates(g, beta, *gate)
    return ref_gdn_decode(qkv, conv_w, conv_state, S, slots, g, beta, n_k_heads, d_state, eps)


# the delta-rule kernel's settings (None: the defaults in gdn_decode_triton), from .ci/gpu/sweep_gdn.py
DELTA_CONFIG: dict = {"block_v": None, "num_warps": None}
