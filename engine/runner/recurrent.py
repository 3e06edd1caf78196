"""The recurrent (Gated DeltaNet, qwen35) layers' states of the runner's slots, and a drafting step's rollback.

Per recurrent layer: conv windows [slots, K-1, conv_dim] and delta-rule states S [slots, Hv, D, D] (none for the
scratch slot: padding rows leave recurrent states untouched, kernels/gdn). A decode step with several rows of one
slot (a token and its drafts) runs the rows in waves (`draft_waves`: every slot's first row, then every second,
..), each wave over all rows with the others masked, so the step keeps fixed shapes and runs as a CUDA graph; the
drafting slots' states are copied before the step and the step's inputs kept, from which `replay` restores the
states of the rows verification accepted (the same kernel on the same inputs: the states successive one-row steps
would have left). An empty RecurrentSlots (a model without recurrent layers) is false.
"""
from __future__ import annotations

import torch

from kernels.gdn import gdn_decode, gdn_gates


class RecurrentSlots:
    """model: the DecoderModel (its spec, conv_dim, n_v_heads, n_k_heads, d_state); max_rows: the most rows of a
    decode step (the replay buffers' size)."""

    def __init__(self, model, n_slots: int, device: torch.device, max_rows: int):
        s = model.spec
        self.model, self.spec, self.n_slots, self.device, self.max_rows = model, s, n_slots, device, max_rows
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for il in range(s.n_layer):
            if s.is_recurrent(il):
                self.conv[il] = torch.zeros(n_slots, s.ssm_d_conv - 1, model.conv_dim, dtype=torch.float32,
                                            device=device)
                self.ssm[il] = torch.zeros(n_slots, model.n_v_heads, model.d_state, model.d_state,
                                           dtype=torch.float32, device=device)
        # a drafting step: the states of its drafting slots before it, and its delta-rule inputs per layer
        self.snapshots: dict[int, tuple] = {}
        self.replay_inputs: dict[int, tuple] = {}
        self._replay_bufs: dict[int, tuple] = {}

    def __bool__(self) -> bool:
        return bool(self.conv)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.conv.values()) + list(self.ssm.values())

    def reset(self, slot: int) -> None:
        for t in self.tensors():
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        for il in self.conv:
            self.conv[il][dst].copy_(self.conv[il][src])
            self.ssm[il][dst].copy_(self.ssm[il][src])

    def clear(self) -> None:
        for d in (self.conv, self.ssm, self.snapshots, self.replay_inputs, self._replay_bufs):
            d.clear()

    def delta_net(self, b, il, L, qkv, alpha_x, beta_x):
        """One layer's Gated DeltaNet rows of the step's SlotBatch b (engine/runner/batch.py) from the raw
        projections qkv, alpha_x, beta_x (the decode kernel makes the gates itself; other paths make them with
        torch first)."""
        model = self.model
        cs, S = self.conv[il], self.ssm[il]
        gate = (L["dt"].dense, L["a"].dense)
        if b.decode and b.waves is None:
            return gdn_decode(qkv, L["conv"], cs, S, b.state_slots(), alpha_x, beta_x, model.n_k_heads,
                              model.d_state, self.spec.rms_eps, gate=gate)
        g, beta = gdn_gates(alpha_x, beta_x, *gate)
        if b.decode:
            # several rows of one slot (drafts): wave w updates every slot's w-th row (the other rows run
            # with slot -1: no state update, output unused), so each row's update starts from its slot's
            # state after the rows before it, as in successive one-row steps. Every wave has all the rows:
            # fixed shapes, so such steps are CUDA graphs too. The inputs are kept for replay.
            self._keep_replay_inputs(il, qkv, g, beta, L["conv"])
            o = None
            for w in range(b.waves.shape[0]):
                ow = gdn_decode(qkv, L["conv"], cs, S, b.waves[w], g, beta, model.n_k_heads, model.d_state,
                                self.spec.rms_eps)
                act = (b.waves[w] >= 0).view((-1,) + (1,) * (ow.dim() - 1))
                o = ow if o is None else torch.where(act, ow, o)
            return o
        # a padded pass: padding rows decay 1 and update nothing
        if b.valid is not None:
            g, beta = g * b.valid[:, None], beta * b.valid[:, None]
        if b.pieces is not None:
            # one or several slots' pieces, each through its own window and state (engine/runner/prefill.py)
            return model.delta_net_pieces(L, qkv, g, beta, cs, S, b.pieces)
        # a prompt chunk of one slot, its state read and written through a device index (so a captured
        # chunk serves every slot; a slot starting at 0 was reset to zeros)
        idx = b.slots[:1]
        state = (cs.index_select(0, idx)[0], S.index_select(0, idx)[0])
        o, (c_new, S_new) = model.delta_net_rows(L, qkv, g, beta, state, keep=b.keep)
        cs.index_copy_(0, idx, c_new[None])
        S.index_copy_(0, idx, S_new[None])
        return o

    def draft_waves(self, slots: list[int], positions: list[int]) -> list[list[int]] | None:
        """A step with several rows of one slot (a token and its drafts, at consecutive positions): per wave
        (every slot's first row, then every second row, ..) each row's slot when the row is in that wave, else
        -1; and a snapshot of those slots' states before the step, from which `replay` restores the rows it
        keeps. None when every slot has one row (the usual step)."""
        self.snapshots.clear()
        self.replay_inputs.clear()
        if len(set(slots)) == len(slots):
            return None
        waves, by_slot = [], {}
        for r, sl in enumerate(slots):
            rows = by_slot.setdefault(sl, [])
            if len(rows) == len(waves):
                waves.append([-1] * len(slots))
            if 0 <= sl < self.n_slots:      # (padding rows: in no wave)
                waves[len(rows)][r] = sl
            rows.append(r)
        for sl, rows in by_slot.items():
            if len(rows) > 1 and 0 <= sl < self.n_slots:
                self.snapshots[sl] = (positions[rows[0]], rows,
                                      {il: t[sl].clone() for il, t in self.conv.items()},
                                      {il: t[sl].clone() for il, t in self.ssm.items()})
        return waves

    def _keep_replay_inputs(self, il: int, qkv, g, beta, conv_w) -> None:
        """A drafting step's Gated DeltaNet inputs of layer il, copied into buffers of their own (so they outlive a
        graph replay's next use of its memory) for replay."""
        buf = self._replay_bufs.get(il)
        if buf is None or buf[0].shape[0] < qkv.shape[0]:
            n = max(self.max_rows, qkv.shape[0])
            buf = self._replay_bufs[il] = tuple(torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype,
                                                            device=t.device) for t in (qkv, g, beta))
        n = qkv.shape[0]
        for dst, src in zip(buf, (qkv, g, beta)):
            dst[:n].copy_(src)
        self.replay_inputs[il] = buf + (conv_w,)

    def replay(self, slot: int, n: int) -> bool:
        """After a drafting step: slot's states as after its first n positions (the rows verification accepted),
        restored from the snapshot and the kept rows replayed. False when there was nothing to do (no snapshot
        of slot, or every row kept)."""
        snap = self.snapshots.pop(slot, None)
        if snap is None:
            return False
        p0, rows, conv, ssm = snap
        keep = n - p0
        if keep >= len(rows):
            return False
        for il in self.conv:
            self.conv[il][slot].copy_(conv[il])
            self.ssm[il][slot].copy_(ssm[il])
        sl = torch.tensor([slot], dtype=torch.long, device=self.device)
        m = self.model
        for r in rows[:keep]:
            for il, (qkv, g, beta, conv_w) in self.replay_inputs.items():
                gdn_decode(qkv[r:r + 1], conv_w, self.conv[il], self.ssm[il], sl, g[r:r + 1],
                           beta[r:r + 1], m.n_k_heads, m.d_state, self.spec.rms_eps)
        return True
