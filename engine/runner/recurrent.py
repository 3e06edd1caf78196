"""The recurrent (Gated DeltaNet, qwen35) layers' states of the runner's slots, and a drafting step's commit.

Per recurrent layer: conv windows [slots, K-1, conv_dim] and delta-rule states S [slots, Hv, D, D] (none for the
scratch slot: padding rows leave recurrent states untouched, kernels/gdn), views of one tensor per kind stacked
by layer. A decode step with several rows of one slot (a token and its drafts, consecutive rows at consecutive
positions) runs each slot's rows in order through kernels/gdn/verify.py in one pass (so the step keeps the
shapes of its rows bucket and runs as a CUDA graph): every row's output is the one successive one-row steps
would give, slots with one row move on as in decode, and the drafting slots' states wait, their rows' inputs
kept, until `commit` applies the rows verification accepted (all layers in one launch). An empty
RecurrentSlots (a model without recurrent layers) is false.
"""
from __future__ import annotations

import logging

import torch

from kernels.gdn import gdn_decode, gdn_gates
from kernels.gdn.block import conv_rule_pieces, conv_rule_rows
from kernels.gdn.verify import delta_block_v, gdn_commit, gdn_verify


log = logging.getLogger("hivejet.engine")


class RecurrentSlots:
    """model: the DecoderModel (its spec, conv_dim, n_v_heads, n_k_heads, d_state); max_rows: the most rows of a
    decode step (the replay buffers' size)."""

    def __init__(self, model, n_slots: int, device: torch.device, max_rows: int):
        s = model.spec
        self.model, self.spec, self.n_slots, self.device, self.max_rows = model, s, n_slots, device, max_rows
        self.layers = [il for il in range(s.n_layer) if s.is_recurrent(il)]
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        self._conv_all = self._ssm_all = None
        if self.layers:
            n = len(self.layers)
            self._conv_all = torch.zeros(n, n_slots, s.ssm_d_conv - 1, model.conv_dim, dtype=torch.float32,
                                         device=device)
            self._ssm_all = torch.zeros(n, n_slots, model.n_v_heads, model.d_state, model.d_state,
                                        dtype=torch.float32, device=device)
            self.conv = {il: self._conv_all[i] for i, il in enumerate(self.layers)}
            self.ssm = {il: self._ssm_all[i] for i, il in enumerate(self.layers)}
        # a drafting step: per drafting slot (its first position, first row, row count); the kept inputs its
        # rows wrote and its tile width (kept_buffers, delta_block_v: the commit's), the graphs' kept buffers,
        # and the layers' conv weights stacked for the reference's commit
        self.pending: dict[int, tuple[int, int, int]] = {}
        self._pending_step: tuple | None = None
        self._kept: tuple[torch.Tensor, ...] | None = None
        self._step_kept: tuple[torch.Tensor, ...] | None = None
        self._conv_w_all: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.conv)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.conv.values()) + list(self.ssm.values())

    def reset(self, slot: int) -> None:
        self.pending.pop(slot, None)
        for t in self.tensors():
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        self.settle()
        for il in self.conv:
            self.conv[il][dst].copy_(self.conv[il][src])
            self.ssm[il][dst].copy_(self.ssm[il][src])

    def clear(self) -> None:
        for d in (self.conv, self.ssm, self.pending):
            d.clear()
        self._kept = self._step_kept = self._conv_w_all = self._pending_step = None
        self._conv_all = self._ssm_all = None

    def delta_net(self, b, il, shape, L, qkv, alpha_x, beta_x):
        """One layer's Gated DeltaNet rows of the step's SlotBatch b (engine/runner/batch.py) from the raw
        projections qkv, alpha_x, beta_x (the decode kernel makes the gates itself; other paths make them with
        torch first)."""
        cs, S = self.conv[il], self.ssm[il]
        gate = (L["dt"].dense, L["a"].dense)
        if b.decode and b.layout is None:
            return gdn_decode(qkv, L["conv"], cs, S, b.state_slots(), alpha_x, beta_x, shape.n_k_heads,
                              shape.d_state, shape.eps, gate=gate)
        if b.decode:
            # several rows of one slot (drafts): each slot's rows in order in one pass (kernels/gdn/verify.py)
            kept = tuple(t[self.layers.index(il)] for t in self._step_kept or self.kept_buffers())
            return gdn_verify(qkv, L["conv"], cs, S, b.layout, alpha_x, beta_x, shape.n_k_heads, shape.d_state,
                              shape.eps, kept, gate=gate)
        g, beta = gdn_gates(alpha_x, beta_x, *gate)
        # a padded pass: padding rows decay 1 and update nothing
        if b.valid is not None:
            g, beta = g * b.valid[:, None], beta * b.valid[:, None]
        if b.pieces is not None:
            # one or several slots' pieces, each through its own window and state (engine/runner/prefill.py)
            return conv_rule_pieces(shape, L["conv"], qkv, g, beta, cs, S, b.pieces)
        # a prompt chunk of one slot, its state read and written through a device index (so a captured
        # chunk serves every slot; a slot starting at 0 was reset to zeros)
        idx = b.slots[:1]
        state = (cs.index_select(0, idx)[0], S.index_select(0, idx)[0])
        o, (c_new, S_new) = conv_rule_rows(shape, L["conv"], qkv, g, beta, state, keep=b.keep)
        cs.index_copy_(0, idx, c_new[None])
        S.index_copy_(0, idx, S_new[None])
        return o

    def begin_step(self, lay: list[list[int]] | None, positions: list[int], rows: int) -> bool:
        """Before a decode step of `rows` rows (its graph's bucket, or its own rows run eagerly) whose rows have
        the layout `lay` (kernels/gdn/verify.py draft_layout; None: no slot has several rows): whether it
        drafts, and then each drafting slot's rows recorded for `commit`. The previous step's drafting slots
        not cut back take all their rows first. A slot's rows must be at consecutive positions."""
        self.settle()
        self._step_kept = None
        if lay is None:
            return False
        drafting = {}   # slot -> (first position, first row, rows): checked before anything is recorded
        for gi, n in enumerate(lay[5]):
            if n > 1:
                first = lay[4][gi]
                p0 = positions[first]
                if positions[first:first + n] != list(range(p0, p0 + n)):
                    raise ValueError(f"slot {lay[3][gi]}'s rows are not at consecutive positions")
                drafting[lay[3][gi]] = (p0, first, n)
        # (the graphs' buffers; an eager step with more rows than a graph holds gets its own for this step)
        kept = self._step_kept = self.kept_buffers(None if rows <= self.max_rows else rows)
        m = self.model
        self._pending_step = (kept, delta_block_v(rows, m.n_v_heads, m.d_state))
        self.pending.update(drafting)
        return True

    def use_graph_buffers(self) -> None:
        """Before capturing a drafting graph: its rows' inputs go to the graphs' kept buffers."""
        self._step_kept = self.kept_buffers()

    def kept_buffers(self, rows: int | None = None) -> tuple[torch.Tensor, ...]:
        """The drafting rows' kept inputs (conv outputs and qkv [layers, rows, conv_dim], g and beta [layers,
        rows, Hv], float32: kernels/gdn/verify.py).
        rows None: the graphs' set of max_rows rows, made once before any drafting graph is captured (the
        graphs keep writing into it); else a set of its own."""
        if rows is None and self._kept is not None:
            return self._kept
        n, R, m = len(self.layers), rows or self.max_rows, self.model
        kept = (torch.zeros(n, R, m.conv_dim, dtype=torch.float32, device=self.device),
                torch.zeros(n, R, m.conv_dim, dtype=torch.float32, device=self.device),
                torch.zeros(n, R, m.n_v_heads, dtype=torch.float32, device=self.device),
                torch.zeros(n, R, m.n_v_heads, dtype=torch.float32, device=self.device))
        if rows is None:
            self._kept = kept
        return kept

    def commit(self, slot: int, n: int) -> bool:
        """After a drafting step: slot's states as after its first n positions (the rows verification accepted,
        applied in every layer). False when slot did not draft in the step."""
        rec = self.pending.pop(slot, None)
        if rec is None:
            return False
        p0, first, count = rec
        kept, block_v = self._pending_step
        if self._conv_w_all is None and self.device.type != "cuda":   # (the reference's; the kernel reads kept x)
            self._conv_w_all = torch.stack([self.model.layers[il]["conv"] for il in self.layers])
        m = self.model
        gdn_commit(self._conv_w_all, self._conv_all, self._ssm_all, kept, slot, first,
                   max(0, min(count, n - p0)), m.n_k_heads, m.d_state, self.spec.rms_eps, block_v=block_v)
        return True

    def warm_up(self, rows: list[int]) -> None:
        """Compile the commit's kernels (CUDA) for drafting steps of these row counts ahead of the first commit
        (else the first drafting request waits for it). A failure costs only that wait: logged, not raised."""
        if self.device.type != "cuda" or not self.layers:
            return
        from kernels.gdn.verify import gdn_commit_triton
        m, kept = self.model, self.kept_buffers()
        try:
            for bv in sorted({delta_block_v(r, m.n_v_heads, m.d_state) for r in rows}):
                gdn_commit_triton(None, self._conv_all, self._ssm_all, kept, 0, 0, 1, m.n_k_heads, m.d_state,
                                  self.spec.rms_eps, block_v=bv, warmup=True)
        except Exception as e:   # noqa: BLE001 (an optimisation: the kernels compile at first use instead)
            log.warning("the drafting commit's kernels were not compiled ahead: %s", e)

    def settle(self) -> None:
        """Commit every row of drafting slots whose commit did not come (their states as if all were accepted)."""
        for slot, (p0, _first, count) in list(self.pending.items()):
            self.commit(slot, p0 + count)
