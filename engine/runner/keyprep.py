"""Key preconditioning on the GPU path (rotated K cache types; docs/KV_CACHE.md): the runner's form of
engine/kv/sequence.py's SequenceKV.kprep, for every slot in static device buffers. Keys are stored as
(k - c_s) / w (c_s: the center of the key's segment of SEGMENT positions, w: per-channel smoothing weights
from the slot's first chunk), queries are multiplied by w, and attention adds q . c_s to each key's score.
Decode rows make a segment's center on the device (no host decision: the step stays one CUDA graph).
`KeyPreconditioner` holds every layer's buffers and the rule; the runner owns one (`Runner.keys`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from engine.kv.pool import rope_key_pairs
from engine.kv.sequence import SequenceKV
from kernels.quant.ref import wide_einsum

if TYPE_CHECKING:
    from engine.runner.batch import SlotBatch


def _sum_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, n, ...] summed over dim 1 by halving (elementwise adds in a fixed order): unlike a torch
    reduction, whose kernel and order depend on the tensor's shape, a row's sum does not depend on B."""
    n = x.shape[1]
    p2 = 1 << max(0, (n - 1).bit_length())
    if p2 != n:
        x = torch.cat([x, x.new_zeros((x.shape[0], p2 - n) + x.shape[2:])], 1)
    while x.shape[1] > 1:
        h = x.shape[1] // 2
        x = x[:, :h] + x[:, h:]
    return x[:, 0]


class KeyPrep:
    """One attention layer's key preconditioning for every slot, in static device buffers (the
    runner's form of SequenceKV.kprep): w [slots, Hkv, D] (ones: no smoothing), centers [slots,
    n_seg, Hkv, D], ncent [slots] (segments 0..ncent-1 have a center; a segment's center, once made,
    stays until the slot restarts at position 0, like a SequenceKV's)."""

    def __init__(self, n_slots: int, n_seg: int, hkv: int, d: int, partner, device):
        self.w = torch.ones(n_slots, hkv, d, dtype=torch.float32, device=device)
        self.centers = torch.zeros(n_slots, n_seg, hkv, d, dtype=torch.float32, device=device)
        self.ncent = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.partner = None if partner is None else torch.tensor(partner, dtype=torch.long, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.w, self.centers, self.ncent]


class KeyPreconditioner:
    """Every attention layer's key preconditioning for the runner's slots (rotated K cache types only: `layers`
    is empty otherwise), with the rule's constants (engine/kv/sequence.py's, so that both paths follow the same
    rule) and the host's copy of ncent. read_keys(cache, slots, positions): the stored keys there, decoded
    (the runner's pool reader)."""

    def __init__(self, model, attn_layers, n_slots: int, max_ctx: int, block_size: int, rotated: bool,
                 triton: bool, read_keys: Callable, device: torch.device):
        s, S = model.spec, SequenceKV
        self.segment, self.seg_min_keys, self.prep_min_tokens = S.SEGMENT, S.SEG_MIN_KEYS, S.PREP_MIN_TOKENS
        self.smooth_clamp = S.SMOOTH_CLAMP
        self.n_seg = max(1, -(-max_ctx // self.segment))
        self.block_size, self.triton, self.read_keys = block_size, triton, read_keys
        self.layers: dict[int, KeyPrep] = {}
        if rotated and S.PRECONDITION_KEYS:
            for il in attn_layers:
                r = model.kv_rope(il)
                partner = rope_key_pairs(s.head_dim, *r, horizon=s.context_length) if r is not None else None
                self.layers[il] = KeyPrep(n_slots, self.n_seg, s.n_head_kv, s.head_dim, partner, device)
            self._seg_offsets = torch.arange(-self.segment, 0, device=device)
        # the host's copy of KeyPrep.ncent (the same for every layer): a decode step makes centers only
        # when one of its rows is in a segment without one (decode_centers costs a pass over SEGMENT
        # stored keys per row and layer: ~3 ms of a 27B step at 23K on the H200)
        self.ncent = [0] * n_slots

    def tensors(self) -> list[torch.Tensor]:
        return [t for kp in self.layers.values() for t in kp.tensors()]

    def reset(self, slot: int) -> None:
        """slot starts over at position 0: no smoothing, no centers."""
        for kp in self.layers.values():
            kp.w[slot] = 1.0
            kp.ncent[slot] = 0
        self.ncent[slot] = 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst takes src's smoothing weights and the centers of the segments src's first n positions reach;
        later segments' centers are cleared (dst makes its own from its own keys, as a cold run would)."""
        n_seg = -(-n // self.segment)
        for kp in self.layers.values():
            if src != dst:
                kp.w[dst].copy_(kp.w[src])
                kp.centers[dst, :n_seg].copy_(kp.centers[src, :n_seg])
            kp.centers[dst, n_seg:].zero_()
            kp.ncent[dst] = kp.ncent[src].clamp_max(n_seg)
        self.ncent[dst] = min(self.ncent[src], n_seg)

    def draft_room(self, pos: int, most: int) -> int:
        """How many draft rows may follow a row at `pos` in one decode step: inside one segment that already
        has its center (a row at a segment's first position makes the center from the keys before it, which
        the rows of its own step have not written yet); `most` without preconditioning."""
        if not self.layers:
            return most
        seg = self.segment
        return 0 if pos % seg == 0 else seg - 1 - pos % seg

    def needs_centers(self, slots: list[int], positions: list[int], n_slots: int) -> bool:
        """Whether a decode step has a row in a segment whose key center is not made yet (then the step
        makes it, decode_centers); the host's copy of ncent follows what the step does on the device."""
        if not self.layers:
            return False
        need = False
        for s, p in zip(slots, positions):
            if 0 <= s < n_slots:
                seg = p // self.segment
                if seg >= self.ncent[s]:
                    need = True
                    self.ncent[s] = seg + 1
        return need

    def precondition(self, kp: KeyPrep, b: SlotBatch, q, k):
        """The rows' keys as stored ((k - c) / w), the queries as the stored keys need them (q * w), and
        the score correction q . c_s for every segment s of the row's slot (SequenceKV._prep_keys,
        prep_query, score_bias)."""
        slots, pos = b.slots.long(), b.positions.long()
        n, H, D = q.shape
        hkv = k.shape[1]
        G = H // hkv
        w = kp.w.index_select(0, slots)                                     # [n, Hkv, D]
        k_st = (k.float() - kp.centers[slots, pos // self.segment]) / w
        q_st = q.float() * w.repeat_interleave(G, dim=1)
        qg = q.float()[..., :D].reshape(n, hkv, G, D)
        if b.decode:   # every segment of the slot: a fixed shape for the graphs (unused ones are masked)
            if self.triton and D >= 16 and not D & (D - 1):   # (the kernel's tl.dot needs a power of two)
                from kernels.attention.paged import segment_bias
                bias = segment_bias(q, kp.centers, slots)
            else:
                cs = kp.centers.index_select(0, slots)                      # [n, n_seg, Hkv, D]
                bias = wide_einsum("nkgd,nskd->nkgs", qg, cs).reshape(n, H, self.n_seg)
        else:
            n_seg = -(-(b.start + n) // self.segment)
            bias = wide_einsum("nkgd,skd->nkgs", qg, kp.centers[b.slot, :n_seg]).reshape(n, H, n_seg)
        return k_st, q_st, bias

    def _first_kept(self, start, window):
        """The first position SequenceKV still holds when a chunk starts at `start` (a sliding-window
        layer drops whole blocks before the first query's window); int or tensor."""
        if not window:
            return 0
        bs = self.block_size
        if isinstance(start, torch.Tensor):
            return (start - window + 1).clamp_min(0) // bs * bs
        return max(0, start - window + 1) // bs * bs

    def decode_centers(self, kp: KeyPrep, kc, b: SlotBatch, window) -> None:
        """A decode row at the first position of a segment that has no center yet makes it, as
        SequenceKV does for a chunk that brings fewer than SEG_MIN_KEYS keys of the segment: the mean
        of the stored keys of the previous SEGMENT positions (decoded, un-preconditioned); segment 0
        gets zeros. Computed for every row and kept only where needed (torch.where): no host decision,
        so the step stays one CUDA graph. Costs one pass over SEGMENT stored keys per row and layer."""
        SEG = self.segment
        slots, pos = b.slots.long(), b.positions.long()
        seg = pos // SEG
        prev = pos[:, None] + self._seg_offsets[None]                       # [B, SEG] positions before
        valid = prev >= 0
        if window:
            valid &= prev >= self._first_kept(pos, window)[:, None]
        prev = prev.clamp_min(0)
        K = self.stored_keys(kp, kc, slots[:, None], prev)                 # [B, SEG, Hkv, D]
        if window:
            cnt = valid.sum(1)
            cand = _sum_rows(K * valid[..., None, None]) / cnt.clamp_min(1)[:, None, None]
            last = kp.centers[slots, (seg - 1).clamp_min(0)]                # no key left: the previous center
            cand = torch.where((cnt == 0)[:, None, None], last, cand)
        else:
            cand = _sum_rows(K) / SEG
        cand = torch.where((seg == 0)[:, None, None], torch.zeros_like(cand), cand)
        new = seg >= kp.ncent.index_select(0, slots)
        kp.centers[slots, seg] = torch.where(new[:, None, None], cand, kp.centers[slots, seg])
        kp.ncent[slots] = torch.maximum(kp.ncent.index_select(0, slots), seg + 1)

    def prefill_kprep(self, kp: KeyPrep, kc, b: SlotBatch, q, k, window) -> None:
        """A prefill chunk's segment centers and, for the slot's first chunk, its smoothing weights:
        SequenceKV._add_centers and _first_kprep over the slot's buffers. Which segments already have a
        center is known on the device only (ncent), so the choice is a torch.where."""
        SEG = self.segment
        slot, start, n = b.slot, b.start, k.shape[0]
        end = start + n
        kf = k.float()
        for s in range(start // SEG, (end - 1) // SEG + 1):
            lo, hi = max(s * SEG, start), min((s + 1) * SEG, end)
            own = kf[lo - start:hi - start]
            if own.shape[0] >= (self.prep_min_tokens if s == 0 else self.seg_min_keys):
                cand = own.mean(0)
            elif s == 0:
                cand = torch.zeros_like(kf[0])
            else:
                cand = self._recent_key_mean(kp, kc, slot, s * SEG, start, kf, window)
            kp.centers[slot, s] = torch.where(kp.ncent[slot] > s, kp.centers[slot, s], cand)
        kp.ncent[slot] = torch.clamp_min(kp.ncent[slot], (end - 1) // SEG + 1)
        self.ncent[slot] = max(self.ncent[slot], (end - 1) // SEG + 1)
        if start == 0 and n >= self.prep_min_tokens:
            self._smoothing_weights(kp, slot, q, kf - kp.centers[slot, b.positions.long() // SEG])

    def _recent_key_mean(self, kp: KeyPrep, kc, slot: int, pos: int, start: int, kf, window) -> torch.Tensor:
        """Mean of the keys at positions pos - SEGMENT .. pos: the stored ones (decoded and
        un-preconditioned) and this chunk's (SequenceKV._recent_key_mean)."""
        lo = max(0, pos - self.segment)
        parts = []
        lo2 = max(lo, self._first_kept(start, window))
        if lo2 < start:
            parts.append(self.stored_keys(kp, kc, slot, torch.arange(lo2, start, device=kf.device)))
        if pos > start:
            parts.append(kf[max(0, lo - start):pos - start])
        if sum(p.shape[0] for p in parts) == 0:
            return kp.centers[slot, pos // self.segment - 1].clone()
        return torch.cat(parts).mean(0)

    def stored_keys(self, kp: KeyPrep | None, kc, slots, pos: torch.Tensor) -> torch.Tensor:
        """The keys stored at (slot, position) pairs, decoded and un-preconditioned (stored (k - c) / w
        times w plus the center of the position's segment): [..., Hkv, D]."""
        K = self.read_keys(kc, slots, pos)
        if kp is None:
            return K
        return K * kp.w[slots] + kp.centers[slots, pos // self.segment]

    def _smoothing_weights(self, kp: KeyPrep, slot: int, q, kc) -> None:
        """w per channel = sqrt(rms(k - c) / rms(q)) over the first chunk, RoPE pairs pooled, within
        1/SMOOTH_CLAMP..SMOOTH_CLAMP of its geometric mean (SequenceKV._first_kprep)."""
        hkv, d = kc.shape[1], kc.shape[2]
        qg = q.float()[..., :d].reshape(q.shape[0], hkv, -1, d)
        ek = kc.pow(2).mean(0)
        eq = qg.pow(2).mean((0, 2))
        if kp.partner is not None:
            ek = (ek + ek[:, kp.partner]) / 2
            eq = (eq + eq[:, kp.partner]) / 2
        w = (ek.sqrt().clamp_min(1e-12) / eq.sqrt().clamp_min(1e-12)).sqrt()
        gm = w.log().mean(-1, keepdim=True).exp()
        kp.w[slot] = (w / gm).clamp(1 / self.smooth_clamp, self.smooth_clamp)
