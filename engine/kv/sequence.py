"""One sequence's cache: its block tables into the shared KVPool, and (qwen35) its recurrent states.

`SequenceKV` keeps the surface the models and tests use: `append(layer, start, k, v) -> (K, V)`
float, `.length`, `truncate`, `snapshot` / `restore` of recurrent states (`recurrent[layer]`,
`recurrent_length`). `attend(...)` is what the models call: write the chunk's K and V, then attend
its queries over the stored (decoded) KV. With a rotated cache type (turbo*) that happens in the
rotated domain: the query is rotated, the stored keys and values are used as decoded, and only the
attention output is rotated back.

Key preconditioning (rotated K cache types only), exact for attention:
- centering: the keys of a head share a large common component (35-75 % of their energy in
  SmolLM2 and Gemma-3), which the rotation would spread over every coordinate, so its quantization
  error would land on the part that matters. The codec stores k - c_s, c_s the center of the key's
  segment (SEGMENT = 256 positions): the mean of that segment's keys when the chunk writing it
  brings at least 64 of them, else of the previous 256 stored keys. Attention adds q . c_s to the
  score of each key of segment s (`score_bias`), which restores q . k exactly. Centers per segment
  because RoPE turns most channels: one mean taken at the start goes stale thousands of positions
  later (measured: one center for the whole sequence wrecked 8K-token passkey retrieval).
- smoothing: the codec stores (k - c) / w and the query is multiplied by w (`prep_query`), w per
  channel, sqrt(rms(k - c) / rms(q)) over the first chunk with each RoPE pair's two channels pooled
  (RoPE moves energy within a pair, so the pooled weights hold at every position), within 1/2..2
  of its geometric mean: q.k is unchanged, and the quantization noise, white in the stored domain,
  weighs less where the queries are large.
Both are per-sequence constants (a sequence's numbers do not depend on other sequences); a fork
shares them with its blocks. (Centering V, adding its mean back to the output, measured worse:
attention-sink tokens have small values far from the mean.)

Blocks are released when the sequence is released (`release()`) or garbage-collected.
"""
from __future__ import annotations

import weakref

import torch

from engine.kv.pool import KVPool, LayerGroup, LayerKV
from kernels.cpu.causal import causal_attention   # numba where it applies, else the torch reference (the same bits)
from kernels.cpu import paged_decode
from kernels.kvcodec import cache_type_name
from kernels.quant.ref import wide_einsum


class BlockTable:
    """Logical block i of a sequence (tokens i*block_size ..) -> block id in its group; -1 where a
    sliding-window group has dropped a block that no query can see any more."""

    def __init__(self, group: LayerGroup):
        self.group = group
        self.blocks: list[int] = []
        self._tensor: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def first_kept(self) -> int:
        """Index of the first block still held."""
        for i, b in enumerate(self.blocks):
            if b >= 0:
                return i
        return len(self.blocks)

    def tensor(self) -> torch.Tensor:
        if self._tensor is None or self._tensor.numel() != len(self.blocks):
            self._tensor = torch.tensor(self.blocks, dtype=torch.long)
        return self._tensor

    def _changed(self) -> None:
        self._tensor = None

    def release(self) -> None:
        self.group.free(self.blocks)
        self.blocks = []
        self._changed()


def _release_tables(tables: dict) -> None:
    for t in tables.values():
        t.release()
    tables.clear()


class SequenceKV:
    """A sequence's KV in a paged pool.

    SequenceKV(n_layer, dtype) makes a private pool with that float cache type;
    models pass their shared pool: SequenceKV(pool=model.kv_pool(...)). `cache_type_k/v` choose the
    private pool's cache types by name instead of `dtype`.
    """

    def __init__(self, n_layer: int | None = None, dtype: torch.dtype | str | None = None, *,
                 pool: KVPool | None = None, cache_type_k: str | None = None, cache_type_v: str | None = None):
        if pool is None:
            kt = cache_type_name(cache_type_k or dtype or torch.float16)
            vt = cache_type_name(cache_type_v or dtype or kt)
            pool = KVPool(cache_type_k=kt, cache_type_v=vt)
        self.pool = pool
        self.n_layer = n_layer
        self.tables: dict[int, BlockTable] = {}
        self.length = 0  # tokens stored (committed after each forward)
        self.recurrent: dict[int, tuple[torch.Tensor, ...]] = {}
        self.recurrent_length = 0  # tokens the recurrent states have consumed
        self.row_states: dict[int, list] = {}  # layer -> state after each row of a rowwise chunk (drafts)
        self.kprep: dict[int, dict] = {}  # layer -> key preconditioning: {"w": weights, "centers": [per segment]}
        self._finalizer = weakref.finalize(self, _release_tables, self.tables)

    @property
    def dtype(self) -> torch.dtype | None:
        """The float dtype of a float cache type (f32/f16/bf16), else None."""
        return getattr(self.pool.codec_k, "dtype", None)

    @property
    def cache_types(self) -> tuple[str, str]:
        return self.pool.cache_type_k, self.pool.cache_type_v

    # ----- blocks -----
    def _table(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> BlockTable:
        if not self.pool.has_layer(layer):
            self.pool.add_layer(layer, LayerKV(k.shape[1], k.shape[2], v.shape[2]))
        g = self.pool.group(layer)
        t = self.tables.get(g.gid)
        if t is None:
            t = self.tables[g.gid] = BlockTable(g)
        return t

    def _prepare(self, t: BlockTable, start: int, end: int, window_from: int | None = None) -> None:
        """Blocks for positions start..end: allocate missing ones, copy shared ones about to be
        written (copy-on-write), and let a sliding-window group drop blocks before the window of
        the first query (position `start`, or `window_from` when earlier: draft rows written one at a
        time keep what the first of them needs, since the sequence may roll back to it). Idempotent:
        the first layer of a group does the work."""
        g, bs = t.group, self.pool.block_size
        if g.window > 0:
            keep_from = max(0, min(start, start if window_from is None else window_from) - g.window + 1)
            first_needed = keep_from // bs
            if first_needed < len(t.blocks) and any(b < 0 for b in t.blocks[first_needed: -(-start // bs)]):
                raise ValueError(f"the sliding-window KV before position {start} was dropped; "
                                 "cannot go back that far")
            drop = [i for i in range(min(first_needed, len(t.blocks))) if t.blocks[i] >= 0]
            if drop:
                g.free([t.blocks[i] for i in drop])
                for i in drop:
                    t.blocks[i] = -1
                t._changed()
        n_need = -(-end // bs)
        if n_need > len(t.blocks):
            first_new = len(t.blocks)
            t.blocks.extend(g.alloc(n_need - len(t.blocks)))
            if g.window > 0:  # blocks wholly before the window are never written nor read
                for i in range(first_new, min(n_need, max(0, start - g.window + 1) // bs)):
                    g.free([t.blocks[i]])
                    t.blocks[i] = -1
            t._changed()
        for i in range(start // bs, n_need):
            b = t.blocks[i]
            if b >= 0 and g.refcount[b] > 1:
                (nb,) = g.alloc(1)
                g.copy_block(b, nb)
                g.free([b])
                t.blocks[i] = nb
                t._changed()

    PRECONDITION_KEYS = True   # False: the plain codec (for measuring what centering + smoothing buy)
    SMOOTH_CLAMP = 2.0         # channel weights within 1/2..2 of their geometric mean
    PREP_MIN_TOKENS = 16       # a first chunk shorter than this gets no smoothing (and centers need 16 keys)
    SEGMENT = 256              # positions per key center
    SEG_MIN_KEYS = 64          # a segment's own keys give its center when a chunk brings this many

    def _kp(self, layer: int) -> dict | None:
        return self.kprep.get(layer)

    def _first_kprep(self, layer: int, start: int, k: torch.Tensor, q: torch.Tensor | None) -> dict | None:
        """The layer's key preconditioning, made on its first write: channel weights from this chunk
        (RoPE pairs pooled), and the list of segment centers."""
        if not self.pool.codec_k.rotated or not self.PRECONDITION_KEYS:
            return None
        kp = self.kprep.get(layer)
        if kp is None:
            kp = self.kprep[layer] = {"w": None, "centers": [], "stacked": None}
            self._add_centers(layer, kp, start, k)
            n = k.shape[0]
            if q is not None and n >= self.PREP_MIN_TOKENS:
                spec = self.pool.layers[layer]
                hkv, d = k.shape[1], k.shape[2]
                kc = k.float() - self._centers_at(kp, start, n)
                qg = q.float()[..., :d].reshape(q.shape[0], hkv, -1, d)          # [n, Hkv, G, D]
                ek = kc.pow(2).mean(0)
                eq = qg.pow(2).mean((0, 2))
                if spec.partner is not None:        # RoPE turns each pair: pool its energy, so the
                    part = torch.tensor(spec.partner)   # weights hold at every position
                    ek = (ek + ek[:, part]) / 2
                    eq = (eq + eq[:, part]) / 2
                w = (ek.sqrt().clamp_min(1e-12) / eq.sqrt().clamp_min(1e-12)).sqrt()
                gm = w.log().mean(-1, keepdim=True).exp()
                kp["w"] = (w / gm).clamp(1 / self.SMOOTH_CLAMP, self.SMOOTH_CLAMP).to(self.pool.device)
        return kp

    def _add_centers(self, layer: int, kp: dict, start: int, k: torch.Tensor) -> None:
        """Centers for every segment the rows start..start+n reach that has none yet: the mean of the
        segment's own keys in this chunk when there are SEG_MIN_KEYS of them (or, for the first
        segment, PREP_MIN_TOKENS), else of the stored keys of the previous SEGMENT positions."""
        seg, n = self.SEGMENT, k.shape[0]
        end = start + n
        cs = kp["centers"]
        while len(cs) * seg < end:
            s = len(cs)
            lo, hi = max(s * seg, start), min((s + 1) * seg, end)
            own = k[lo - start:hi - start].float() if hi > lo else k[:0].float()
            if own.shape[0] >= (self.PREP_MIN_TOKENS if s == 0 else self.SEG_MIN_KEYS):
                c = own.mean(0)
            elif s == 0:
                c = torch.zeros_like(k[0], dtype=torch.float32)
            else:
                c = self._recent_key_mean(layer, kp, s * seg, start, k)
            cs.append(c.to(self.pool.device))
            kp["stacked"] = None

    def _recent_key_mean(self, layer: int, kp: dict, pos: int, start: int, k: torch.Tensor) -> torch.Tensor:
        """Mean of the keys at positions pos - SEGMENT .. pos: stored ones (decoded) and this chunk's."""
        lo = max(0, pos - self.SEGMENT)
        parts = []
        if lo < start:
            t = self.tables[self.pool.group(layer).gid]
            first, kp_rows, _ = self._gather(layer, t, start)
            lo2 = max(lo, first)
            if lo2 < start:
                rows = kp_rows[lo2 - first:]
                dec = self.pool.codec_k.decode(rows, k.shape[-1])
                parts.append(self._unprep_keys(layer, lo2, dec))
        if pos > start:
            parts.append(k[max(0, lo - start):pos - start].float())
        if not parts or sum(p.shape[0] for p in parts) == 0:
            return kp["centers"][-1].clone() if kp["centers"] else torch.zeros_like(k[0], dtype=torch.float32)
        return torch.cat(parts).mean(0)

    def _stacked(self, kp: dict) -> torch.Tensor:
        if kp["stacked"] is None or kp["stacked"].shape[0] != len(kp["centers"]):
            kp["stacked"] = torch.stack(kp["centers"])                       # [n_seg, Hkv, D]
        return kp["stacked"]

    def _centers_at(self, kp: dict, first: int, n: int) -> torch.Tensor:
        """Each position's center: [n, Hkv, D] for positions first..first+n."""
        return self._stacked(kp)[torch.arange(first, first + n) // self.SEGMENT]

    def _prep_keys(self, layer: int, start: int, k: torch.Tensor) -> torch.Tensor:
        kp = self._kp(layer)
        if kp is None:
            return k
        k = k.float() - self._centers_at(kp, start, k.shape[0])
        return k / kp["w"] if kp["w"] is not None else k

    def _unprep_keys(self, layer: int, first: int, K: torch.Tensor) -> torch.Tensor:
        kp = self._kp(layer)
        if kp is None:
            return K
        K = K * kp["w"] if kp["w"] is not None else K
        return K + self._centers_at(kp, first, K.shape[0])

    def prep_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The query as the stored keys need it (times the layer's channel weights)."""
        kp = self._kp(layer)
        if kp is None or kp["w"] is None:
            return q
        w = kp["w"]                                                           # [Hkv, D]
        return q.float() * w.repeat_interleave(q.shape[1] // w.shape[0], dim=0)

    def score_bias(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """(bias [T, H, n_seg], SEGMENT): what to add to the score of a key in segment s (before the
        scale) to undo its centering: q . center_s. (None, 0) for a layer without centering."""
        kp = self._kp(layer)
        if kp is None:
            return None, 0
        c = self._stacked(kp)                                                 # [n_seg, Hkv, D]
        T, H, D = q.shape
        hkv = c.shape[1]
        qg = q.float()[..., :c.shape[2]].reshape(T, hkv, H // hkv, -1)
        # (wide: the bits the runner's correction has, engine/runner/keyprep.py, whatever the CPU's instruction set)
        bias = wide_einsum("tkgd,skd->tkgs", qg, c)
        return bias.reshape(T, H, c.shape[0]), self.SEGMENT

    def _write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None,
               window_from: int | None = None) -> BlockTable:
        n = k.shape[0]
        t = self._table(layer, k, v)
        self._prepare(t, start, start + n, window_from)
        if n == 0:
            return t
        g, bs, p = t.group, self.pool.block_size, self.pool
        k, v = k.to(p.device), v.to(p.device)
        kp = self._first_kprep(layer, start, k, q)
        if kp is not None:
            self._add_centers(layer, kp, start, k)
            k = self._prep_keys(layer, start, k)
        pos = torch.arange(start, start + n)
        # (non_blocking: host-to-device copies of small index tensors need not wait for the device)
        blk = t.tensor()[pos // bs].to(g.k[layer].device, non_blocking=True)
        slot = (pos % bs).to(blk.device, non_blocking=True)
        g.k[layer][blk, slot] = p.codec_k.encode(k)
        g.v[layer][blk, slot] = p.codec_v.encode(v)
        return t

    def _gather(self, layer: int, t: BlockTable, end: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Packed K, V rows of positions first..end (first: the first position still held)."""
        bs, g = self.pool.block_size, t.group
        fb = t.first_kept
        nb = -(-end // bs)
        ids = t.tensor()[fb:nb].to(g.k[layer].device, non_blocking=True)
        first = fb * bs
        kp = g.k[layer][ids].flatten(0, 1)[: end - first]
        vp = g.v[layer][ids].flatten(0, 1)[: end - first]
        return first, kp, vp

    def reserve(self, start: int, end: int) -> None:
        """Allocate (and copy-on-write) the blocks of positions start..end in every layer group before a
        forward, so a full pool (PoolFullError) is found before any layer has changed anything."""
        for g in self.pool.groups:
            t = self.tables.get(g.gid)
            if t is None:
                t = self.tables[g.gid] = BlockTable(g)
            self._prepare(t, start, end)

    # ----- the surface the models use -----
    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, Hkv, D] at positions start..start+n; return the stored K, V up to the end
        (float32, original domain; a sliding-window layer's from the first block it still holds:
        `first_position(layer)`)."""
        t = self._write(layer, start, k, v)
        first, kp, vp = self._gather(layer, t, start + k.shape[0])
        K = self._unprep_keys(layer, first, self.pool.codec_k.decode(kp, k.shape[-1]))
        return K, self.pool.codec_v.decode(vp, v.shape[-1])

    def first_position(self, layer: int) -> int:
        g = self.pool.group(layer)
        t = self.tables.get(g.gid)
        return t.first_kept * self.pool.block_size if t is not None else 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
               window: int = 0, bidirectional: list[tuple[int, int]] | None = None,
               window_from: int | None = None) -> torch.Tensor:
        """Store k, v [n, Hkv, D] at start..start+n, then causal attention of q [n, H, D] over all
        stored KV (sliding window if window > 0; `bidirectional` spans as in causal_attention).
        Returns [n, H, Dv] float32."""
        if q.shape[0] == 1 and not q.is_cuda and paged_decode.supported(self.pool.codec_k, self.pool.codec_v):
            return self._attend_row(layer, q, k, v, start, scale, window, window_from)
        t = self._write(layer, start, k, v, q, window_from)
        first, kp, vp = self._gather(layer, t, start + k.shape[0])
        ck, cv = self.pool.codec_k, self.pool.codec_v
        K = ck.decode_stored(kp)
        V = cv.decode_stored(vp)
        qs = ck.to_stored(self.prep_query(layer, q))
        bias, seg = self.score_bias(layer, q)
        out = causal_attention(qs, K, V, start, scale, window, k_start=first, bidirectional=bidirectional,
                               seg_bias=bias, seg_len=seg)
        return cv.from_stored(out, v.shape[-1])

    def _attend_row(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                    window: int, window_from: int | None) -> torch.Tensor:
        """attend() for one query row of a 16-bit float cache on the CPU: the numba kernel writes k, v into the
        row's block and attends over the blocks in place (kernels/cpu/paged_decode.py: the bits of the gather and
        causal_attention above, which unrotated cache types run without key preconditioning)."""
        t = self._table(layer, k, v)
        self._prepare(t, start, start + 1, window_from)
        g = t.group
        return paged_decode.decode_attention(q, k, v, g.k[layer], g.v[layer], t.tensor(),
                                             t.first_kept * self.pool.block_size, start, scale, window,
                                             self.pool.codec_k, self.pool.codec_v)

    def truncate(self, length: int) -> None:
        """Forget tokens from `length` on. KV entries simply get overwritten; recurrent states cannot
        be rewound, so a hybrid model needs `restore(snapshot)` to go back (its forward refuses a
        chunk that does not start where its recurrent states are)."""
        self.length = min(self.length, length)

    def keep_rows(self, start: int, n_rows: int) -> None:
        """After a rowwise chunk written at `start`: keep its first n_rows rows (the fed token and the
        accepted drafts): KV by truncation, recurrent states from the snapshot after that row."""
        self.truncate(start + n_rows)
        if self.row_states:
            for il, states in self.row_states.items():
                self.recurrent[il] = states[n_rows - 1]
            self.recurrent_length = start + n_rows
        self.row_states = {}

    def snapshot(self) -> dict:
        """What `restore` needs to return to this point: lengths and copies of the recurrent states
        (K/V beyond the restored length are overwritten by later appends, so they are not copied)."""
        return {"length": self.length, "recurrent_length": self.recurrent_length,
                "recurrent": {il: tuple(x.clone() for x in st) for il, st in self.recurrent.items()}}

    def restore(self, snap: dict) -> None:
        self.length = snap["length"]
        self.recurrent_length = snap["recurrent_length"]
        self.recurrent = {il: tuple(x.clone() for x in st) for il, st in snap["recurrent"].items()}

    # ----- sharing -----
    def fork(self) -> "SequenceKV":
        """A new sequence that shares this one's blocks (a common prefix); whichever writes into a
        shared block first gets its own copy."""
        other = SequenceKV(self.n_layer, pool=self.pool)
        for gid, t in self.tables.items():
            nt = BlockTable(t.group)
            nt.blocks = list(t.blocks)
            t.group.incref(nt.blocks)
            other.tables[gid] = nt
        other.length = self.length
        other.kprep = {il: {"w": kp["w"], "centers": list(kp["centers"]), "stacked": None}
                       for il, kp in self.kprep.items()}
        other.recurrent = {il: tuple(x.clone() for x in st) for il, st in self.recurrent.items()}
        other.recurrent_length = self.recurrent_length
        return other

    def release(self) -> None:
        """Give all blocks back to the pool now."""
        _release_tables(self.tables)

    def n_blocks(self) -> int:
        return sum(sum(1 for b in t.blocks if b >= 0) for t in self.tables.values())
