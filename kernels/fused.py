"""Small fused ops of a decode step: torch references (`ref_*`, readable, any device) and Triton
kernels (`triton_*`, same signatures), with a dispatcher of the plain name that runs the Triton
kernel when the input is on CUDA (or when forced: `force_triton()`, for tests under Triton's
interpreter) and the reference otherwise.

Each replaces a few separate torch ops (and their round trips through memory) of the layer code in
engine/models, with the same semantics (the kernels in fp32; the references, which are that code, in float64
rounded once: `_round`):

- `rms_norm(x [N, E], w | None, eps)`: every pre-norm (attn_norm, ffn_norm, post_norm,
  output_norm) of llama/qwen2/qwen3 (engine/models/llama.py), gemma3 and qwen35;
  engine.models.common.rms_norm.
- `add_rms_norm(x, residual, w, eps, x_norm_w=None) -> (normed, new_residual)`: the residual add
  followed by the next norm (`x = x + attn_out; h = rms_norm(x, ffn_norm)`), one pass reading
  both inputs once. With `x_norm_w`, `x` is RMS-normed before the add: gemma3's
  `x = x + rms_norm(a, post_attn_norm); h = rms_norm(x, ffn_norm)` (and post_ffn_norm followed by
  the next layer's attn_norm).
- `head_rms_norm(x [N, H, D], w [D] | None, eps)`: per-head Q/K RMSNorm (qwen3, gemma3, qwen35).
- `rope(x [N, H, D], cos, sin, rope_dim, neox)`: engine.models.common.Rope.apply: rotary
  embedding over the first `rope_dim` dims of each head (partial rotary: the rest pass through);
  neox=False rotates adjacent pairs (x0,x1),(x2,x3).. (llama), neox=True (x_i, x_{i+rope_dim/2})
  (qwen2/3, gemma3, qwen35's M-RoPE, whose cos/sin tables already hold each pair's axis).
  cos/sin [N, rope_dim/2] are the tables of `Rope.cos_sin(positions)`.
- `qk_norm_rope(x, w | None, eps, cos, sin, rope_dim, neox)`: head_rms_norm (only when `w` is
  given) then rope, in one kernel: Q and K of every attention layer.
- `silu_mul(gate, up)` (SwiGLU FFN of llama/qwen*), `gelu_tanh_mul(gate, up)` (gemma3's GeGLU,
  F.gelu(approximate="tanh")), and `silu_mul_cat` / `gelu_tanh_mul_cat` taking one [N, 2F]
  tensor (gate | up halves, e.g. from a concatenated gate+up matmul).
- `gated_sum_parts(parts, gate_col, up_col, n, op)`: silu / gelu_tanh(gate) * up where gate and up are
  columns of a matmul's split-K partial sums (kernels.quant.packed.packed_matmul's `partials`,
  [split, N, total]), added here in slice order: the matmul's own sum, the same bits, without its
  slices' arrival counts (engine.models.common.StackedWeights.gated).
- `sigmoid_gate_mul(a, gate)`: a * sigmoid(gate), qwen35's gated attention output. `gate` may have
  another shape with as many values, read in place: a [N, H*D] with gate = `qg[..., hd:]`
  ([N, H, D], a strided view of the joint Q|gate projection), as in qwen35's
  `a * sigmoid(gate.reshape(n, H*D))`.
- `argmax_rows(logits [N, V]) -> long [N]`: greedy sampling, torch.argmax semantics (lowest index
  wins ties, NaN counts as the maximum), as a two-pass blocked reduction: pass 1 reduces chunks of
  each row in parallel (a few hundred programs for V = 250K), pass 2 the chunk winners in order.

All kernels are safe inside CUDA graphs: launch geometry comes from tensor shapes only, outputs
are allocated with torch.empty, nothing reads a value back to the host. (Compile each kernel
variant once before capture, as for any Triton kernel.) Inputs may be strided views as long as the
last dim is contiguous (otherwise they are copied); outputs are contiguous.

tanh-GELU: the kernel evaluates 0.5*x*(1 + tanh(u)), u = sqrt(2/pi)*(x + 0.044715*x^3), as
x * sigmoid(2u), which is the same function (1 + tanh(u) = 2*sigmoid(2u)) without the cancellation
of 1 + tanh(u) for negative x; it matches torch's to ~1e-7 of the output's scale.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from kernels._interpreter_compat import apply as _fix_interpreter
    from kernels.pdl import pdl_enter
    _fix_interpreter()
except ImportError:  # CPU-only installs run the references
    triton = None

from kernels.pdl import pdl_args

HAVE_TRITON = triton is not None

__all__ = [
    "add_rms_norm", "argmax_rows", "force_triton", "gated_sum_parts", "gelu_tanh_mul", "gelu_tanh_mul_cat",
    "head_rms_norm", "ref_gated_sum_parts",
    "qk_norm_rope", "ref_add_rms_norm", "ref_argmax_rows", "ref_gelu_tanh_mul", "ref_head_rms_norm",
    "ref_qk_norm_rope", "ref_rms_norm", "ref_rope", "ref_sigmoid_gate_mul", "ref_silu_mul", "rms_norm", "rope",
    "sigmoid_gate_mul", "silu_mul", "silu_mul_cat", "triton_add_rms_norm", "triton_argmax_rows",
    "triton_gelu_tanh_mul", "triton_head_rms_norm", "triton_qk_norm_rope", "triton_rms_norm", "triton_rope",
    "triton_sigmoid_gate_mul", "triton_silu_mul", "use_triton",
]

# ---------------------------------------------------------------------------------------------
# torch references (the model code's own formulas)
# ---------------------------------------------------------------------------------------------


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim (engine.models.common.rms_norm), rounded to
    out_dtype when given (else to x's dtype)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return _round(y * w.double() if w is not None else y, x, out_dtype)


def _round(y: torch.Tensor, like: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """The references compute in float64 and round once, here: torch's float32 reductions and
    transcendental functions differ with the CPU's instruction set (AVX2 / AVX-512 / scalar kernels sum
    in other orders, exp and tanh come from other approximations), and the CPU path's 8-bit activation
    rounding turns such 1e-7 differences into different tokens (docs/ACCURACY.md). In float64 they are
    ~1e-16, and the float32 result hardly ever depends on them."""
    return y.to(out_dtype or like.dtype)


def ref_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor | None, eps: float,
                     x_norm_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (x first RMS-normed with x_norm_w when given, gemma3's post-norms);
    returns (rms_norm(new_residual, w, eps), new_residual)."""
    if x_norm_w is not None:
        x = ref_rms_norm(x, x_norm_w, eps)
    r = residual + x
    return ref_rms_norm(r, w, eps), r


def ref_head_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head RMSNorm: x [N, H, D], w [D]."""
    return ref_rms_norm(x, w, eps)


def ref_head_rms_norm_silu(x: torch.Tensor, w: torch.Tensor | None, eps: float, gate: torch.Tensor,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * RMSNorm(x) per head (x, gate [N, H, D]): the gated output norm of Qwen3.5's DeltaNet."""
    return ref_silu_mul(gate, ref_head_rms_norm(x, w, eps), out_dtype)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, neox: bool) -> torch.Tensor:
    """engine.models.common.Rope.apply: x [N, H, D]; cos/sin [N, rope_dim/2]; only the first
    rope_dim dims of each head are rotated."""
    d = rope_dim
    rot, rest = x[..., :d], x[..., d:]
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        a, b = rot[..., : d // 2], rot[..., d // 2:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def ref_qk_norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     rope_dim: int, neox: bool) -> torch.Tensor:
    """Per-head RMSNorm with w (skipped when w is None), then rope over the first rope_dim dims."""
    if w is not None:
        x = ref_head_rms_norm(x, w, eps)
    return ref_rope(x, cos, sin, rope_dim, neox)


def ref_silu_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _round(F.silu(gate.double()) * up.double(), gate, out_dtype)


def ref_gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _round(F.gelu(gate.double(), approximate="tanh") * up.double(), gate, out_dtype)


def ref_gated_sum_parts(parts: torch.Tensor, gate_col: int, up_col: int, n: int, op: str = "silu",
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """act(gate) * up, gate and up summed over the split-K slices of parts [split, rows, total] in slice order
    (float32, as the matmul adds them) at columns gate_col and up_col (n each)."""
    a, b = parts[0, :, gate_col:gate_col + n], parts[0, :, up_col:up_col + n]
    for i in range(1, parts.shape[0]):
        a, b = a + parts[i, :, gate_col:gate_col + n], b + parts[i, :, up_col:up_col + n]
    return (ref_silu_mul if op == "silu" else ref_gelu_tanh_mul)(a, b, out_dtype)


def ref_sigmoid_gate_mul(a: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a * sigmoid(gate); gate may have another shape with as many values (qwen35:
    a [N, H*D] and gate [N, H, D], a strided view of the joint Q|gate projection)."""
    return _round(a.double() * torch.sigmoid(gate.reshape(a.shape).double()), a, out_dtype)


def ref_argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = gate_up.shape[-1] // 2
    if gate_up.shape[-1] != 2 * f:
        raise ValueError(f"gate|up tensor needs an even last dim, got {tuple(gate_up.shape)}")
    return gate_up[..., :f], gate_up[..., f:]


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _warps(n_elems: int, x: torch.Tensor) -> dict:
    """num_warps for one program over n_elems values (compiled GPU kernels only)."""
    if not x.is_cuda:
        return {}
    return dict(num_warps=int(min(16, max(1, n_elems // 256))))


if HAVE_TRITON:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, E, stride_x, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < E
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / E + eps)
        y = x * r
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * E + offs, y, mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, xw_ptr, w_ptr, out_ptr, res_ptr, E, stride_x, stride_r, eps,
                             HAS_XW: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < E
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        res = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_XW:
            x = x * tl.rsqrt(tl.sum(x * x, axis=0) / E + eps)
            x = x * tl.load(xw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = res + x
        tl.store(res_ptr + row * E + offs, s, mask=mask)
        y = s * tl.rsqrt(tl.sum(s * s, axis=0) / E + eps)
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * E + offs, y, mask=mask)

    @triton.jit
    def _head_tile(base, n, offs_d, mask, w_ptr, cos_ptr, sin_ptr, D, stride_cn, eps, NORM: tl.constexpr,
                   HAS_W: tl.constexpr, ROPE_DIM: tl.constexpr, NEOX: tl.constexpr):
        """Token n's heads at `base` (a [BLOCK_H, 1] block of head-row pointers), float32 [BLOCK_H, BLOCK_D]:
        optional RMSNorm over D (times w), then rotary over the first ROPE_DIM dims (0: none). Each
        value's rotation partner is loaded a second time (from cache) rather than shuffled in registers."""
        x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROPE_DIM > 0:
            HALF: tl.constexpr = ROPE_DIM // 2
            in_rot = offs_d < ROPE_DIM
            if NEOX:
                lo = offs_d < HALF
                partner = tl.where(lo, offs_d + HALF, offs_d - HALF)
                pair = tl.where(lo, offs_d, offs_d - HALF)
            else:
                lo = (offs_d % 2) == 0
                partner = tl.where(lo, offs_d + 1, offs_d - 1)
                pair = offs_d // 2
            partner = tl.where(in_rot, partner, offs_d)
            pair = tl.where(in_rot, pair, 0)
            xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            x = x * r[:, None]
            if HAS_W:
                x = x * tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)[None, :]
            if ROPE_DIM > 0:
                xp = xp * r[:, None]
                if HAS_W:
                    xp = xp * tl.load(w_ptr + partner, mask=offs_d < D, other=0.0).to(tl.float32)[None, :]
        if ROPE_DIM > 0:
            c = tl.load(cos_ptr + n * stride_cn + pair, mask=in_rot, other=1.0).to(tl.float32)[None, :]
            s = tl.load(sin_ptr + n * stride_cn + pair, mask=in_rot, other=0.0).to(tl.float32)[None, :]
            # first of a pair: a*c - b*s; second: a*s + b*c (= b*c + a*s), with x the value itself
            sign = tl.where(lo, -1.0, 1.0)[None, :]
            x = tl.where(in_rot[None, :], x * c + (sign * xp) * s, x)
        return x

    @triton.jit
    def _heads_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, gate_ptr, out_ptr, H, D, stride_xn, stride_xh, stride_cn,
                      stride_gn, stride_gh, eps, NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE_DIM: tl.constexpr,
                      NEOX: tl.constexpr, GATE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr = False):
        """One token (program_id 0) x BLOCK_H heads through _head_tile, then (GATE) times silu(gate), stored
        in out's dtype."""
        pdl_enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
        base = x_ptr + n * stride_xn + offs_h[:, None].to(tl.int64) * stride_xh
        x = _head_tile(base, n, offs_d, mask, w_ptr, cos_ptr, sin_ptr, D, stride_cn, eps, NORM, HAS_W, ROPE_DIM, NEOX)
        if GATE:
            g = tl.load(gate_ptr + n * stride_gn + offs_h[:, None].to(tl.int64) * stride_gh + offs_d[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            x = _gate(g, x, 0)
        out = out_ptr + (n * H + offs_h[:, None]) * D + offs_d[None, :]
        tl.store(out, x, mask=mask)

    @triton.jit
    def _gated_kernel(a_ptr, b_ptr, out_ptr, G, D, sa0, sa1, sb0, sb1, OP: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
        """out[n, g, :] = f(a[n, g, :], b[n, g, :]); OP 0: silu(a)*b, 1: gelu_tanh(a)*b, 2: a*sigmoid(b)."""
        pdl_enter(PDL)
        pid = tl.program_id(0)
        n = (pid // G).to(tl.int64)
        g = (pid % G).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < D
        a = tl.load(a_ptr + n * sa0 + g * sa1 + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + n * sb0 + g * sb1 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (n * G + g) * D + offs, _gate(a, b, OP), mask=mask)

    @triton.jit
    def _gate(a, b, OP: tl.constexpr):
        """OP 0: silu(a)*b, 1: gelu_tanh(a)*b, 2: a*sigmoid(b), in float32."""
        if OP == 0:
            y = a / (1.0 + tl.exp(-a)) * b
        elif OP == 1:
            u = 0.7978845608028654 * (a + 0.044715 * (a * a * a))
            y = a / (1.0 + tl.exp(-2.0 * u)) * b  # 0.5*a*(1 + tanh(u)) = a*sigmoid(2u)
        else:
            y = a * (1.0 / (1.0 + tl.exp(-b)))
        return y

    @triton.jit
    def _gated_parts_kernel(part_ptr, out_ptr, MN, T, D, gate_col, up_col, SPLIT: tl.constexpr,
                            OP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """out[n, :] = _gate(a, b) with a = part[0, n, gate_col:] + part[1, ...] + ... (in that order) and b
        likewise at up_col; part [SPLIT, N, T] float32 (MN = N * T)."""
        pdl_enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < D
        row = part_ptr + n * T + offs
        a = tl.load(row + gate_col, mask=mask, other=0.0)
        b = tl.load(row + up_col, mask=mask, other=0.0)
        for i in tl.static_range(1, SPLIT):
            a += tl.load(row + i * MN + gate_col, mask=mask, other=0.0)
            b += tl.load(row + i * MN + up_col, mask=mask, other=0.0)
        tl.store(out_ptr + n * D + offs, _gate(a, b, OP), mask=mask)

    @triton.jit
    def _argmax_merge(acc_v, acc_i, v, i):
        """Lane-wise running argmax with later indices: take the new value only if strictly larger,
        or if it is the first NaN (NaN counts as the maximum, as in torch.argmax)."""
        take = (v > acc_v) | ((v != v) & (acc_v == acc_v))
        return tl.where(take, v, acc_v), tl.where(take, i, acc_i)

    @triton.jit
    def _argmax_final(acc_v, acc_i, BIG: tl.constexpr):
        """Reduce lanes: the lowest index among NaN lanes if any, else among lanes holding the max."""
        is_nan = acc_v != acc_v
        nan_i = tl.min(tl.where(is_nan, acc_i, BIG), axis=0)
        m = tl.max(tl.where(is_nan, float("-inf"), acc_v), axis=0)
        max_i = tl.min(tl.where(acc_v == m, acc_i, BIG), axis=0)
        has_nan = nan_i < BIG
        return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_i, max_i)

    @triton.jit
    def _argmax_chunk_kernel(x_ptr, pv_ptr, pi_ptr, V, stride_x, NCHUNK, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ch = tl.program_id(1)
        BIG: tl.constexpr = 2147483647
        base = x_ptr + row * stride_x
        offs = ch * CHUNK + tl.arange(0, BLOCK)
        mask = offs < V
        acc_v = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        acc_i = tl.where(mask, offs, BIG)
        for k in range(BLOCK, CHUNK, BLOCK):
            o = ch * CHUNK + k + tl.arange(0, BLOCK)
            m = o < V
            v = tl.load(base + o, mask=m, other=float("-inf")).to(tl.float32)
            acc_v, acc_i = _argmax_merge(acc_v, acc_i, v, tl.where(m, o, BIG))
        best_v, best_i = _argmax_final(acc_v, acc_i, BIG)
        tl.store(pv_ptr + row * NCHUNK + ch, best_v)
        tl.store(pi_ptr + row * NCHUNK + ch, best_i)

    @triton.jit
    def _argmax_partials_kernel(pv_ptr, pi_ptr, out_ptr, NCHUNK, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        BIG: tl.constexpr = 2147483647
        offs = tl.arange(0, BLOCK)
        mask = offs < NCHUNK
        acc_v = tl.load(pv_ptr + row * NCHUNK + offs, mask=mask, other=float("-inf"))
        acc_i = tl.load(pi_ptr + row * NCHUNK + offs, mask=mask, other=BIG)
        for k in range(BLOCK, NCHUNK, BLOCK):
            o = k + tl.arange(0, BLOCK)
            m = o < NCHUNK
            v = tl.load(pv_ptr + row * NCHUNK + o, mask=m, other=float("-inf"))
            i = tl.load(pi_ptr + row * NCHUNK + o, mask=m, other=BIG)
            acc_v, acc_i = _argmax_merge(acc_v, acc_i, v, i)
        _, best_i = _argmax_final(acc_v, acc_i, BIG)
        tl.store(out_ptr + row, best_i.to(tl.int64))


def _need_triton():
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")


def triton_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    _need_triton()
    x = _last_contig(x)
    N, E = x.shape
    out = torch.empty((N, E), dtype=out_dtype or x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = _next_pow2(E)
    _rms_norm_kernel[(N,)](x, w if w is not None else x, out, E, x.stride(0), float(eps),
                           HAS_W=w is not None, BLOCK=block, **_warps(block, x), **pdl_args(x))
    return out


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor | None, eps: float,
                        x_norm_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _need_triton()
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    x, residual = _last_contig(x), _last_contig(residual)
    N, E = x.shape
    out = torch.empty((N, E), dtype=x.dtype, device=x.device)
    new_res = torch.empty((N, E), dtype=residual.dtype, device=x.device)
    if out.numel() == 0:
        return out, new_res
    block = _next_pow2(E)
    _add_rms_norm_kernel[(N,)](x, residual, x_norm_w if x_norm_w is not None else x, w if w is not None else x,
                               out, new_res, E, x.stride(0), residual.stride(0), float(eps),
                               HAS_XW=x_norm_w is not None, HAS_W=w is not None, BLOCK=block, **_warps(block, x),
                               **pdl_args(x))
    return out, new_res


def _heads(x, w, eps, cos, sin, rope_dim, neox, norm, gate=None, out_dtype=None):
    """x [N, H, D] per head: RMSNorm (norm, weights w), rope over the first rope_dim dims, then (gate
    [N, H, D]) times silu(gate); float32 math, the result in out_dtype (default x's)."""
    _need_triton()
    if x.dim() != 3:
        raise ValueError(f"expected x [N, H, D], got {tuple(x.shape)}")
    x = _last_contig(x)
    N, H, D = x.shape
    rope_dim = int(rope_dim)
    if rope_dim:
        if rope_dim % 2 or rope_dim > D:
            raise ValueError(f"rope_dim {rope_dim} must be even and at most the head dim {D}")
        if tuple(cos.shape) != (N, rope_dim // 2) or cos.shape != sin.shape:
            raise ValueError(f"cos/sin must be [{N}, {rope_dim // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
        cos, sin = _last_contig(cos), _last_contig(sin)
        if sin.stride(0) != cos.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and x {tuple(x.shape)} differ")
        gate = _last_contig(gate)
    out = torch.empty((N, H, D), dtype=out_dtype or x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = _next_pow2(D)
    block_h = max(1, min(_next_pow2(H), 4096 // block_d))
    grid = (N, triton.cdiv(H, block_h))
    g = gate if gate is not None else x
    _heads_kernel[grid](x, w if w is not None else x, cos if rope_dim else x, sin if rope_dim else x, g, out,
                        H, D, x.stride(0), x.stride(1), cos.stride(0) if rope_dim else 0, g.stride(0), g.stride(1),
                        float(eps), NORM=norm, HAS_W=w is not None, ROPE_DIM=rope_dim, NEOX=bool(neox),
                        GATE=gate is not None, BLOCK_H=block_h, BLOCK_D=block_d, **_warps(block_h * block_d, x),
                        **pdl_args(x))
    return out


def triton_head_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _heads(x, w, eps, None, None, 0, False, True)


def triton_head_rms_norm_silu(x: torch.Tensor, w: torch.Tensor | None, eps: float, gate: torch.Tensor,
                              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _heads(x, w, eps, None, None, 0, False, True, gate=gate, out_dtype=out_dtype)


def triton_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, neox: bool) -> torch.Tensor:
    return _heads(x, None, 0.0, cos, sin, rope_dim, neox, False)


def triton_qk_norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                        rope_dim: int, neox: bool) -> torch.Tensor:
    return _heads(x, w, eps, cos, sin, rope_dim, neox, w is not None)


def _as3d(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, int]:
    """A view (N, G, D) of t with the last dim contiguous: (t, N, G, D, stride_n, stride_g)."""
    if t.dim() > 3 or t.dim() == 0:
        t = t.reshape(-1, t.shape[-1] if t.dim() else 1)  # may copy
    t = _last_contig(t)
    if t.dim() == 1:
        return t, 1, 1, t.shape[0], 0, 0
    if t.dim() == 2:
        return t, t.shape[0], 1, t.shape[1], t.stride(0), 0
    return t, t.shape[0], t.shape[1], t.shape[2], t.stride(0), t.stride(1)


def _gated(a: torch.Tensor, b: torch.Tensor, op: int, block: int = 1024,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    _need_triton()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    out = torch.empty(a.shape, dtype=out_dtype or a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    a3, N, G, D, sa0, sa1 = _as3d(a)
    b3, _, _, _, sb0, sb1 = _as3d(b)
    block = min(block, _next_pow2(D))
    _gated_kernel[(N * G, triton.cdiv(D, block))](a3, b3, out, G, D, sa0, sa1, sb0, sb1, OP=op, BLOCK=block,
                                                 **_warps(block, a), **pdl_args(a))
    return out


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _gated(gate, up, 0, out_dtype=out_dtype)


def triton_gated_sum_parts(parts: torch.Tensor, gate_col: int, up_col: int, n: int, op: str = "silu",
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    _need_triton()
    if parts.dim() != 3 or parts.dtype != torch.float32 or not parts.is_contiguous():
        raise ValueError(f"parts must be contiguous float32 [split, rows, total], got {parts.dtype} {tuple(parts.shape)}")
    split, rows, total = parts.shape
    if max(gate_col, up_col) + n > total or min(gate_col, up_col) < 0:
        raise ValueError(f"columns {gate_col} and {up_col} + {n} do not fit {total}")
    out = torch.empty((rows, n), dtype=out_dtype or torch.float32, device=parts.device)
    if out.numel() == 0:
        return out
    block = min(1024, _next_pow2(n))
    _gated_parts_kernel[(rows, triton.cdiv(n, block))](parts, out, rows * total, total, n, gate_col, up_col,
                                                       SPLIT=split, OP=_GATE_OPS[op], BLOCK=block,
                                                       **_warps(block, parts), **pdl_args(parts))
    return out


def triton_gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _gated(gate, up, 1, out_dtype=out_dtype)


def triton_sigmoid_gate_mul(a: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if a.shape != gate.shape:
        if a.numel() != gate.numel():
            raise ValueError(f"a {tuple(a.shape)} and gate {tuple(gate.shape)} differ in size")
        try:  # gate as it is (a strided view), a seen in gate's shape
            return _gated(a.view(gate.shape), gate, 2, out_dtype=out_dtype).view(a.shape)
        except RuntimeError:
            gate = gate.reshape(a.shape)
    return _gated(a, gate, 2, out_dtype=out_dtype)


def _argmax_chunk(N: int, V: int, block: int) -> int:
    """Chunk length (a multiple of block): about 256 programs in pass 1 whatever N, at most 16K each."""
    per_row = max(1, 256 // max(N, 1))
    return min(max(_next_pow2(-(-V // per_row)), block), max(16384, block))


def triton_argmax_rows(logits: torch.Tensor, *, block: int = 1024, chunk: int | None = None) -> torch.Tensor:
    """torch.argmax(logits, -1) for logits [N, V]: pass 1 reduces each chunk of `chunk` values
    (in `block`-wide steps) to its winner, pass 2 the chunk winners of a row in order."""
    _need_triton()
    logits = _last_contig(logits)
    N, V = logits.shape
    out = torch.empty((N,), dtype=torch.long, device=logits.device)
    if N == 0:
        return out
    if V == 0:
        raise ValueError("argmax of an empty row")
    block = min(block, _next_pow2(V))
    chunk = chunk or _argmax_chunk(N, V, block)
    if chunk % block:
        raise ValueError(f"chunk {chunk} must be a multiple of block {block}")
    nchunk = triton.cdiv(V, chunk)
    pv = torch.empty((N, nchunk), dtype=torch.float32, device=logits.device)
    pi = torch.empty((N, nchunk), dtype=torch.int32, device=logits.device)
    _argmax_chunk_kernel[(N, nchunk)](logits, pv, pi, V, logits.stride(0), nchunk, CHUNK=chunk, BLOCK=block,
                                      **_warps(block, logits))
    pblock = min(_next_pow2(nchunk), block)
    _argmax_partials_kernel[(N,)](pv, pi, out, nchunk, BLOCK=pblock, **_warps(pblock, logits))
    return out


# ---------------------------------------------------------------------------------------------
# dispatchers
# ---------------------------------------------------------------------------------------------

_FORCE = False   # (force_triton: tests only; no setting, docs/decisions/README.md)


@contextlib.contextmanager
def force_triton(enabled: bool = True):
    """Within the block, the dispatchers use the Triton kernels for CPU tensors too (they then run
    only under TRITON_INTERPRET=1). Process-wide, not thread-local: for tests."""
    global _FORCE
    prev, _FORCE = _FORCE, bool(enabled)
    try:
        yield
    finally:
        _FORCE = prev


def use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.is_cuda or _FORCE)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out_dtype (default x's): a matmul's fp16 input is rounded here, once, as the matmul would round it."""
    return (triton_rms_norm if use_triton(x) else ref_rms_norm)(x, w, eps, out_dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor | None, eps: float,
                 x_norm_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return (triton_add_rms_norm if use_triton(x) else ref_add_rms_norm)(x, residual, w, eps, x_norm_w)


def head_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return (triton_head_rms_norm if use_triton(x) else ref_head_rms_norm)(x, w, eps)


def head_rms_norm_silu(x: torch.Tensor, w: torch.Tensor | None, eps: float, gate: torch.Tensor,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return (triton_head_rms_norm_silu if use_triton(x) else ref_head_rms_norm_silu)(x, w, eps, gate, out_dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, neox: bool) -> torch.Tensor:
    return (triton_rope if use_triton(x) else ref_rope)(x, cos, sin, rope_dim, neox)


def qk_norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 rope_dim: int, neox: bool) -> torch.Tensor:
    return (triton_qk_norm_rope if use_triton(x) else ref_qk_norm_rope)(x, w, eps, cos, sin, rope_dim, neox)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(The CPU path's numba kernel with the reference's bits is kernels/cpu/rows.py's silu_mul, which
    engine/models/common.py calls on the CPU.)"""
    return (triton_silu_mul if use_triton(gate) else ref_silu_mul)(gate, up, out_dtype)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return (triton_gelu_tanh_mul if use_triton(gate) else ref_gelu_tanh_mul)(gate, up, out_dtype)


_GATE_OPS = {"silu": 0, "gelu_tanh": 1}


def gated_sum_parts(parts: torch.Tensor, gate_col: int, up_col: int, n: int, op: str = "silu",
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """act(gate) * up (op "silu" or "gelu_tanh") for gate and up held as split-K partial sums: columns
    gate_col and up_col (n each) of parts [split, rows, total], added in slice order first."""
    if op not in _GATE_OPS:
        raise ValueError(f"op must be one of {sorted(_GATE_OPS)}, not {op!r}")
    return (triton_gated_sum_parts if use_triton(parts) else ref_gated_sum_parts)(parts, gate_col, up_col, n, op,
                                                                                  out_dtype)


def silu_mul_cat(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2F] = gate | up (read in place, no split copy)."""
    return silu_mul(*_halves(gate_up))


def gelu_tanh_mul_cat(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up [..., 2F] = gate | up."""
    return gelu_tanh_mul(*_halves(gate_up))


def sigmoid_gate_mul(a: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return (triton_sigmoid_gate_mul if use_triton(a) else ref_sigmoid_gate_mul)(a, gate, out_dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return (triton_argmax_rows if use_triton(logits) else ref_argmax_rows)(logits)
