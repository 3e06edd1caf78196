"""Qwen3.5's Gated DeltaNet block between its projections and its output norm, for prompt rows: the causal
conv over each sequence's kept window, q and k L2-normed, and the delta rule in the form that fits the rows
(one row: the recurrence; a small chunk on the GPU: one launch, rows.py; otherwise the chunkwise form,
rule.py); a padded pass's pieces of several slots at once (`conv_rule_pieces`). The decode step's rows take
recurrent.py's fused kernel instead. On the CPU the block computes in float64 and rounds its outputs once:
torch's float32 exp, sums and products change with the instruction set (docs/ACCURACY.md)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.gdn.rows import delta_rule_pieces, delta_rule_rows, pieces_kernel_applies, rows_kernel_applies
from kernels.gdn.rule import delta_rule_chunked, delta_rule_recurrent, l2_norm


class GdnShape(NamedTuple):
    """A Gated DeltaNet layer's sizes: K heads, V heads (in GGUF's tiled order: V head j reads K head
    j % n_k_heads), the state's head dim, the conv's kernel length, and the norm's eps."""
    n_k_heads: int
    n_v_heads: int
    d_state: int
    d_conv: int
    eps: float

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.d_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.n_v_heads * self.d_state


def _wide(*ts: torch.Tensor) -> bool:
    """Whether the block computes these (CPU float32) tensors in float64 (the module's docstring)."""
    return ts[0].device.type == "cpu" and ts[0].dtype == torch.float32


def conv_heads(shape: GdnShape, xin: torch.Tensor, conv_w: torch.Tensor, m: int,
               sel: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (L2-normed, in the V heads' tiled order) and v [m, Hv, D] from the conv over xin (rows with
    their windows before them); sel: the windows to keep (default: the last m)."""
    Hk, Hv, D, K = shape.n_k_heads, shape.n_v_heads, shape.d_state, shape.d_conv
    conv = F.silu((xin.unfold(0, K, 1) * conv_w).sum(-1))               # [windows, conv_dim]
    conv = conv.index_select(0, sel) if sel is not None else conv[-m:]
    q = l2_norm(conv[:, :shape.key_dim].reshape(m, Hk, D), shape.eps)
    k = l2_norm(conv[:, shape.key_dim:2 * shape.key_dim].reshape(m, Hk, D), shape.eps)
    v = conv[:, 2 * shape.key_dim:].reshape(m, Hv, D)
    if Hv != Hk:  # tiled V-head order: V head j uses K head j % Hk (ggml_repeat)
        q = q.repeat(1, Hv // Hk, 1)
        k = k.repeat(1, Hv // Hk, 1)
    return q, k, v


def rule_for(q: torch.Tensor):
    """The delta rule's form for a run of q.shape[0] tokens of one sequence."""
    if q.shape[0] == 1:
        return delta_rule_recurrent
    if rows_kernel_applies(q):   # a small prompt chunk on the GPU: one launch (rows.py)
        return delta_rule_rows
    return delta_rule_chunked


def conv_rule_rows(shape: GdnShape, conv_w: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: tuple[torch.Tensor, torch.Tensor] | None,
                   keep: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    """One sequence's m consecutive rows (qkv [m, conv_dim], log decay g and beta [m, Hv]) through the conv
    and the delta rule, from `state` (conv window [K-1, conv_dim], S [Hv, D, D]; None: zeros). Returns o
    [m, Hv, D] and the new state. keep: the rows of [conv window; qkv] that make the new window (default
    the last K-1; a padded prompt chunk, engine/runner/prefill.py, keeps those ending at its last real row)."""
    m, K = qkv.shape[0], shape.d_conv
    if state is None:
        conv_state = qkv.new_zeros((K - 1, shape.conv_dim))
        S = qkv.new_zeros((shape.n_v_heads, shape.d_state, shape.d_state))
    else:
        conv_state, S = state
    wide = _wide(qkv)
    if wide:
        qkv, conv_state, S, g, beta, conv_w = (t.double() for t in (qkv, conv_state, S, g, beta, conv_w))
    xin = torch.cat([conv_state, qkv], dim=0)                            # [K-1+m, conv_dim]
    q, k, v = conv_heads(shape, xin, conv_w, m)
    o, S = rule_for(q)(q, k, v, g, beta, S)
    window = xin[-(K - 1):].clone() if keep is None else xin.index_select(0, keep)
    if wide:
        o, window, S = o.float(), window.float(), S.float()
    return o, (window, S)


def conv_rule_pieces(shape: GdnShape, conv_w: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     conv_states: torch.Tensor, S: torch.Tensor, pieces) -> torch.Tensor:
    """A padded pass's rows, several slots' pieces (engine/runner/prefill.py: PromptPieces), through the
    conv and the delta rule: each piece from its slot's conv window and state in conv_states [n_slots,
    K-1, conv_dim] and S [n_slots, Hv, D, D], which it updates in place. g and beta are 0 on padding
    rows. Returns o [rows, Hv, D]. The GPU: the windows gathered and the delta rule in one launch for
    all pieces (delta_rule_pieces), from the layout's device buffers alone (a captured pass serves every
    layout). The CPU: each piece's real rows as conv_rule_rows runs them (float64; pieces.bounds)."""
    n, K = qkv.shape[0], shape.d_conv
    kernel = pieces_kernel_applies(qkv)
    if not kernel and pieces.bounds is None:
        raise ValueError("conv_rule_pieces: a captured pass needs the pieces kernel (Triton on CUDA)")
    wins = conv_states.index_select(0, pieces.slots)                      # [P, K-1, conv_dim]
    wide = not kernel and _wide(qkv)
    if wide:
        qkv, wins, g, beta, conv_w = (t.double() for t in (qkv, wins, g, beta, conv_w))
    xin = torch.cat([wins.reshape(-1, wins.shape[-1]), qkv]).index_select(0, pieces.gather)
    q, k, v = conv_heads(shape, xin, conv_w, n, pieces.sel)
    if kernel:
        o = delta_rule_pieces(q, k, v, g, beta, S, pieces.slots, pieces.cu)
    else:
        o = q.new_zeros(n, shape.n_v_heads, shape.d_state)
        for slot, lo, hi in pieces.bounds:
            St = S[slot].double() if wide else S[slot]
            o[lo:hi], St = rule_for(q[lo:hi])(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], St)
            S[slot].copy_(St)
    new = xin.index_select(0, pieces.keep.flatten()).view(-1, K - 1, xin.shape[-1])
    conv_states.index_copy_(0, pieces.slots, new.to(conv_states.dtype))
    return o.float()
