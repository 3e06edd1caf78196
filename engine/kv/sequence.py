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
  error would land on the part that matters. The codec stores k - m, m the mean key of the
  sequence's first chunk (per layer and KV head). Scores change by q.m, the same for every key of
  a query, which softmax ignores: nothing is added back.
- smoothing: the codec stores (k - m) / w and the query is multiplied by w, w per channel
  (sqrt(rms(k - m) / rms(q)) over the first chunk, per layer and KV head, clamped to 1/8..8 around
  its geometric mean): q.k is unchanged, and the rotated-domain quantization noise, white in the
  stored domain, weighs less where the queries are large (score-error variance down 1.6x (SmolLM2)
  and 1.9x (Gemma-3) at the median head).
Both are per-sequence constants fixed by its first chunk (`kprep`; a first chunk of fewer than 16
tokens leaves the keys as they are), so a sequence's numbers do not depend on other sequences; a
fork shares them with its blocks. (Centering V, adding its mean back
to the output, measured worse: attention-sink tokens have small values far from the mean.)

Blocks are released when the sequence is released (`release()`) or garbage-collected.
"""
from __future__ import annotations

import weakref

import torch

from engine.kv.pool import KVPool, LayerGroup, LayerKV
from kernels.attention.ref import causal_attention
from kernels.kvcodec import cache_type_name


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

    SequenceKV(n_layer, dtype) (the old signature) makes a private pool with that float cache type;
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
        self.kprep: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # layer -> (key mean, channel weights)
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

    def _prepare(self, t: BlockTable, start: int, end: int) -> None:
        """Blocks for positions start..end: allocate missing ones, copy shared ones about to be
        written (copy-on-write), and let a sliding-window group drop blocks before the window of
        the first query (position `start`). Idempotent: the first layer of a group does the work."""
        g, bs = t.group, self.pool.block_size
        if g.window > 0:
            keep_from = max(0, start - g.window + 1)
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

    SMOOTH_CLAMP = 8.0
    PRECONDITION_KEYS = True   # False: the plain codec (for measuring what centering + smoothing buy)
    PREP_MIN_TOKENS = 16       # a shorter first chunk leaves the keys as they are

    def _kprep(self, layer: int, k: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The layer's key preconditioning (mean [Hkv, D], weights [Hkv, D] or None), fixed by the
        first chunk written; None when the K cache type is not rotated."""
        if not self.pool.codec_k.rotated or not self.PRECONDITION_KEYS:
            return None
        c = self.kprep.get(layer)
        if c is None and k.shape[0]:
            kf = k.float()
            w = None
            if k.shape[0] < self.PREP_MIN_TOKENS:   # too few keys to estimate from: the plain codec
                mean = torch.zeros_like(kf[0])
            else:
                mean = kf.mean(0)
            if q is not None and k.shape[0] >= self.PREP_MIN_TOKENS:
                hkv, d = k.shape[1], k.shape[2]
                qg = q.float()[..., :d].reshape(q.shape[0], hkv, -1, d)          # [n, Hkv, G, D]
                rk = (kf - mean).pow(2).mean(0).sqrt()
                rq = qg.pow(2).mean((0, 2)).sqrt()
                w = (rk.clamp_min(1e-12) / rq.clamp_min(1e-12)).sqrt()
                gm = w.log().mean(-1, keepdim=True).exp()
                w = (w / gm).clamp(1 / self.SMOOTH_CLAMP, self.SMOOTH_CLAMP)
            c = self.kprep[layer] = (mean.to(self.pool.device), None if w is None else w.to(self.pool.device))
        return c

    def _prep_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        c = self.kprep.get(layer)
        if c is None:
            return k
        mean, w = c
        k = k.float() - mean
        return k / w if w is not None else k

    def _unprep_keys(self, layer: int, K: torch.Tensor) -> torch.Tensor:
        c = self.kprep.get(layer)
        if c is None:
            return K
        mean, w = c
        return (K * w if w is not None else K) + mean

    def prep_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The query as the stored keys need it (times the layer's channel weights)."""
        c = self.kprep.get(layer)
        if c is None or c[1] is None:
            return q
        w = c[1]                                                              # [Hkv, D]
        return q.float() * w.repeat_interleave(q.shape[1] // w.shape[0], dim=0)

    def _write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None) -> BlockTable:
        n = k.shape[0]
        t = self._table(layer, k, v)
        self._prepare(t, start, start + n)
        if n == 0:
            return t
        g, bs, p = t.group, self.pool.block_size, self.pool
        k, v = k.to(p.device), v.to(p.device)
        self._kprep(layer, k, q)
        k = self._prep_keys(layer, k)
        pos = torch.arange(start, start + n)
        blk = t.tensor()[pos // bs].to(g.k[layer].device)
        slot = (pos % bs).to(blk.device)
        g.k[layer][blk, slot] = p.codec_k.encode(k)
        g.v[layer][blk, slot] = p.codec_v.encode(v)
        return t

    def _gather(self, layer: int, t: BlockTable, end: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Packed K, V rows of positions first..end (first: the first position still held)."""
        bs, g = self.pool.block_size, t.group
        fb = t.first_kept
        nb = -(-end // bs)
        ids = t.tensor()[fb:nb].to(g.k[layer].device)
        first = fb * bs
        kp = g.k[layer][ids].flatten(0, 1)[: end - first]
        vp = g.v[layer][ids].flatten(0, 1)[: end - first]
        return first, kp, vp

    # ----- the surface the models use -----
    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, Hkv, D] at positions start..start+n; return the stored K, V up to the end
        (float32, original domain; a sliding-window layer's from the first block it still holds:
        `first_position(layer)`)."""
        t = self._write(layer, start, k, v)
        _, kp, vp = self._gather(layer, t, start + k.shape[0])
        K = self._unprep_keys(layer, self.pool.codec_k.decode(kp, k.shape[-1]))
        return K, self.pool.codec_v.decode(vp, v.shape[-1])

    def first_position(self, layer: int) -> int:
        g = self.pool.group(layer)
        t = self.tables.get(g.gid)
        return t.first_kept * self.pool.block_size if t is not None else 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
               window: int = 0, bidirectional: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Store k, v [n, Hkv, D] at start..start+n, then causal attention of q [n, H, D] over all
        stored KV (sliding window if window > 0; `bidirectional` spans as in causal_attention).
        Returns [n, H, Dv] float32."""
        t = self._write(layer, start, k, v, q)
        first, kp, vp = self._gather(layer, t, start + k.shape[0])
        ck, cv = self.pool.codec_k, self.pool.codec_v
        K = ck.decode_stored(kp)
        V = cv.decode_stored(vp)
        qs = ck.to_stored(self.prep_query(layer, q))
        out = causal_attention(qs, K, V, start, scale, window, k_start=first, bidirectional=bidirectional)
        return cv.from_stored(out, v.shape[-1])

    def truncate(self, length: int) -> None:
        """Forget tokens from `length` on. KV entries simply get overwritten; recurrent states cannot
        be rewound, so a hybrid model needs `restore(snapshot)` to go back (its forward refuses a
        chunk that does not start where its recurrent states are)."""
        self.length = min(self.length, length)

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
        other.kprep = dict(self.kprep)
        other.recurrent = {il: tuple(x.clone() for x in st) for il, st in self.recurrent.items()}
        other.recurrent_length = self.recurrent_length
        return other

    def release(self) -> None:
        """Give all blocks back to the pool now."""
        _release_tables(self.tables)

    def n_blocks(self) -> int:
        return sum(sum(1 for b in t.blocks if b >= 0) for t in self.tables.values())
