"""The gated delta rule over a short run of one sequence's tokens in one Triton launch (a small prompt chunk
on the GPU: a short request, a follow-up's new tokens; engine/runner/runner.py chunk_rows).

The chunkwise-parallel form (rule.py: delta_rule_chunked) is what long chunks need, but on a
64-row chunk it is ~80 small torch and cuBLAS kernels a layer (triangular solves, batched products, masks,
cumulative sums): about 8 of a small chunk's 31 ms on the H200 for the 27B (docs/PERFORMANCE.md).
Here one program per (v-head, block of BV v-columns) keeps its [D, BV] slice of the state in
registers and walks the tokens in order, each through the decode kernel's step (recurrent.py: _delta_step):

    S <- S exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t D^-1/2

q, k [T, H, D] (L2-normed, V heads in the tiled order, q not yet scaled), v [T, H, D], g (log decay) and
beta [T, H], S [H, D, D] float32. Rows with g = 0 and beta = 0 (a padded chunk's padding) leave S as it is.
The result is the recurrence's in float32 (`delta_rule_recurrent`), not the chunked form's rounding.

`delta_rule_pieces` is the same launch over several sequences' runs laid one after another (a padded prompt
pass that holds several slots' pieces, engine/runner/prefill.py): one more program axis for the piece, each
piece's state read from and written back to its slot in place, the layout read from device buffers (so a
captured pass serves every layout). `delta_rule_rows` is its one-piece case (scalars, no layout buffers).
"""
from __future__ import annotations


import torch

try:
    import triton
    import triton.language as tl
    from kernels._interpreter_compat import apply as _fix_interpreter
    from kernels.gdn.recurrent import _delta_step
    _fix_interpreter()
except ImportError:   # CPU-only installs keep the torch forms
    triton = None

# the most tokens one launch takes (longer runs keep the chunked form: its work grows with T / 64, this
# kernel's latency with T). Always on CUDA (H200, 27B: a 32-token prompt's pass 30 -> 26.6 ms, the same bits run
# after run; docs/decisions/shared-prompt-passes.md).
# Compiled for sm_90 here at BV 16 and 4 warps: 95 registers for one run, 114 for pieces, no spills.
ROWS_KERNEL_MAX = 64


if triton is not None:
    @triton.jit
    def _delta_pieces_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, s_out_ptr, slot_ptr, cu_ptr, o_ptr, T, H,
                             D, scale, DP: tl.constexpr, BV: tl.constexpr, PIECES: tl.constexpr):
        # program (piece p, v-head h, block vb): rows cu[p] .. cu[p + 1] of the run, from the state of slot
        # slots[p] into s_out (the same buffer: in place); a piece with no rows (a pass's unused piece) touches
        # nothing. Not PIECES: one piece, rows 0 .. T, state 0 (no layout buffers to make per call)
        p = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        lo = 0
        hi = T
        slot = 0
        if PIECES:
            lo = tl.load(cu_ptr + p)
            hi = tl.load(cu_ptr + p + 1)
            slot = tl.load(slot_ptr + p).to(tl.int64)
        if hi > lo:
            dk = tl.arange(0, DP)
            dv = vb * BV + tl.arange(0, BV)
            mk, mv = dk < D, dv < D
            ms = mk[:, None] & mv[None, :]
            st = (slot * H + h) * D * D + dk[:, None] * D + dv[None, :]
            s = tl.load(s_ptr + st, mask=ms, other=0.0)                             # [DP, BV] float32
            for t in range(lo, hi):
                row = (t * H + h).to(tl.int64) * D
                q = tl.load(q_ptr + row + dk, mask=mk, other=0.0).to(tl.float32) * scale
                k = tl.load(k_ptr + row + dk, mask=mk, other=0.0).to(tl.float32)
                v = tl.load(v_ptr + row + dv, mask=mv, other=0.0).to(tl.float32)
                gg = tl.load(g_ptr + t * H + h).to(tl.float32)
                bb = tl.load(beta_ptr + t * H + h).to(tl.float32)
                s, o = _delta_step(s, q, k, v, gg, bb)
                tl.store(o_ptr + row + dv, o, mask=mv)
            tl.store(s_out_ptr + st, s, mask=ms)


def rows_kernel_applies(q: torch.Tensor) -> bool:
    """Whether the model takes `delta_rule_rows` for this run of tokens: Triton on a CUDA tensor, 2 to
    ROWS_KERNEL_MAX tokens."""
    return triton is not None and q.is_cuda and 1 < q.shape[0] <= ROWS_KERNEL_MAX


def pieces_kernel_applies(x: torch.Tensor) -> bool:
    """Whether a padded prompt pass takes `delta_rule_pieces` (block.py: conv_rule_pieces):
    Triton on a CUDA tensor. Passes that hold several slots' pieces need it."""
    return triton is not None and x.is_cuda


def delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, block_v: int = 16, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The module doc's recurrence in one launch: o [T, H, D] float32 and the new state [H, D, D] float32
    (a new tensor; `state` is read only). Runs wherever Triton does (the CPU through its interpreter)."""
    T, H, D = q.shape
    if state.shape != (H, D, D):
        raise ValueError(f"delta_rule_rows: state [H, D, D] = {(H, D, D)}; got {tuple(state.shape)}")
    s_in = state.float().contiguous()
    s_out = torch.empty_like(s_in)
    return _launch(q, k, v, g, beta, s_in, s_out, None, None, block_v, num_warps), s_out


def delta_rule_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor, block_v: int = 16,
                      num_warps: int = 4) -> torch.Tensor:
    """Several sequences' runs in one launch (a prompt pass holding several slots' small pieces,
    engine/runner/prefill.py): piece p is rows cu[p] .. cu[p + 1] of q, k, v, g, beta [T, H, ...] and runs
    from the state of slot slots[p] in `states` [n_slots, H, D, D] (float32, contiguous), which it updates in
    place. Pieces with no rows change nothing (a pass's unused pieces: slots and cu are fixed-size device
    buffers, so a captured pass serves every layout). Returns o [T, H, D] float32; rows in no piece are
    left unwritten. Each piece gets the bits it gets in a launch of its own."""
    H, D = q.shape[1:]
    if states.dim() != 4 or states.shape[1:] != (H, D, D) or cu.shape != (slots.shape[0] + 1,):
        raise ValueError(f"delta_rule_pieces: states [n, H, D, D] = [n, {H}, {D}, {D}] and cu [P + 1] for P slots; "
                         f"got {tuple(states.shape)}, {tuple(cu.shape)}, {slots.shape[0]} slots")
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("delta_rule_pieces: the states are updated in place: float32 and contiguous")
    return _launch(q, k, v, g, beta, states, states, slots, cu.to(torch.int32), block_v, num_warps)


def _launch(q, k, v, g, beta, s_in, s_out, slots, cu, block_v, num_warps) -> torch.Tensor:
    """The kernel over one run (slots None: state s_in [H, D, D] into s_out) or over pieces."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    T, H, D = q.shape
    if k.shape != (T, H, D) or v.shape != (T, H, D) or g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(f"the delta rule's rows: q, k, v [T, H, D], g and beta [T, H]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    DP = triton.next_power_of_2(D)
    BV = min(triton.next_power_of_2(block_v), DP)
    pieces = slots is not None
    _delta_pieces_kernel[(slots.shape[0] if pieces else 1, H, triton.cdiv(D, BV))](
        q, k, v, g, beta, s_in, s_out, slots if pieces else s_in, cu if pieces else s_in, o, T, H, D,
        float(D ** -0.5), DP=DP, BV=BV, PIECES=pieces, num_warps=num_warps)
    return o
