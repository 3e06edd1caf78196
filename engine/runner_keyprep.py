"""Key preconditioning on the GPU path (rotated K cache types; docs/KV_CACHE.md): the runner's form of
engine/kv/sequence.py's SequenceKV.kprep, for every slot in static device buffers. Keys are stored as
(k - c_s) / w (c_s: the center of the key's segment of SEGMENT positions, w: per-channel smoothing weights
from the slot's first chunk), queries are multiplied by w, and attention adds q . c_s to each key's score.
Decode rows make a segment's center on the device (no host decision: the step stays one CUDA graph).
`KeyPrepMixin` holds the Runner's methods for it (engine/runner.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.quant.ref import wide_einsum

if TYPE_CHECKING:
    from engine.runner import SlotBatch


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


class KeyPrepMixin:
    """Runner methods: the preconditioned keys and queries of a batch's rows, the centers a prompt chunk
    or a decode row makes, the smoothing weights of a slot's first chunk."""

    def _precondition(self, kp: KeyPrep, b: SlotBatch, q, k):
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

    def _decode_centers(self, kp: KeyPrep, kc, b: SlotBatch, window) -> None:
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
        K = self._stored_keys(kp, kc, slots[:, None], prev)                 # [B, SEG, Hkv, D]
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

    def _prefill_kprep(self, kp: KeyPrep, kc, b: SlotBatch, q, k, window) -> None:
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
        self._ncent[slot] = max(self._ncent[slot], (end - 1) // SEG + 1)
        if start == 0 and n >= self.prep_min_tokens:
            self._smoothing_weights(kp, slot, q, kf - kp.centers[slot, b.positions.long() // SEG])

    def _recent_key_mean(self, kp: KeyPrep, kc, slot: int, pos: int, start: int, kf, window) -> torch.Tensor:
        """Mean of the keys at positions pos - SEGMENT .. pos: the stored ones (decoded and
        un-preconditioned) and this chunk's (SequenceKV._recent_key_mean)."""
        lo = max(0, pos - self.segment)
        parts = []
        lo2 = max(lo, self._first_kept(start, window))
        if lo2 < start:
            parts.append(self._stored_keys(kp, kc, slot, torch.arange(lo2, start, device=kf.device)))
        if pos > start:
            parts.append(kf[max(0, lo - start):pos - start])
        if sum(p.shape[0] for p in parts) == 0:
            return kp.centers[slot, pos // self.segment - 1].clone()
        return torch.cat(parts).mean(0)

    def _stored_keys(self, kp: KeyPrep | None, kc, slots, pos: torch.Tensor) -> torch.Tensor:
        """The keys stored at (slot, position) pairs, decoded and un-preconditioned (stored (k - c) / w
        times w plus the center of the position's segment): [..., Hkv, D]."""
        K = self._read_rows(kc, self.codec_k, self.spec.head_dim, slots, pos)
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
