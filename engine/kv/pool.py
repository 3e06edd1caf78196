"""The paged KV pool: one pool for all sequences of a model.

K and V live in fixed-size blocks of `block_size` tokens. Per attention layer the pool holds two
byte tensors, K and V: [n_blocks, block_size, n_head_kv, row_bytes] in the layer's cache type
(kernels/kvcodec; K and V may use different types). Layers that attend over the same span share
block ids and form a *group*: the full-attention layers are one group; sliding-window layers
(gemma3) another, whose sequences keep only the blocks their window still needs. Layers without
KV (qwen35's Gated DeltaNet) are not in the pool.

A group hands out block ids from a free list and counts references per block (`alloc`, `incref`,
`free`), so a block can be shared by several sequences (a common prefix) and is only reused when
its last user lets go; a shared block is copied before it is written (copy-on-write, in
engine/kv/sequence.py). `n_blocks=None` makes a group grow on demand (CPU); with a fixed
`n_blocks` (the memory planner's figure on a GPU) running out raises PoolFullError.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.kv.blocks import BlockAllocator, PoolFullError
from kernels.kvcodec import KVCodec, cache_type_name, get_codec

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class LayerKV:
    """Shape of one attention layer's KV: heads, K and V head sizes, sliding window (0: none), and
    the keys' RoPE pairs (for the key preconditioning of engine/kv/sequence.py): `partner[c]`, the
    channel RoPE rotates channel c with (c itself where not rotated); None: unknown."""

    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    window: int = 0
    partner: tuple[int, ...] | None = None


def rope_key_pairs(head_dim: int, rope_dim: int, neox: bool, inv_freq=None, horizon: int = 0,
                   max_angle: float = 1.0) -> tuple[int, ...]:
    """partner[c] of a head whose first `rope_dim` channels RoPE rotates in pairs: (i, i + rope_dim/2)
    for NEOX, (2i, 2i+1) otherwise, at inv_freq[i] radians per position. A pair that turns less than
    `max_angle` over `horizon` positions (the model's context), and unrotated channels, are their own
    partners: their energy stays where it is."""
    partner = list(range(head_dim))
    half = rope_dim // 2
    for i in range(half):
        if inv_freq is not None and float(inv_freq[i]) * horizon < max_angle:
            continue
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        partner[a], partner[b] = b, a
    return tuple(partner)


class LayerGroup:
    """Layers sharing block ids: storage per layer, and their blocks' free list and reference counts
    (a BlockAllocator, grown with the storage)."""

    def __init__(self, pool: "KVPool", gid: int, window: int, n_blocks: int | None):
        self.pool, self.gid, self.window = pool, gid, window
        self.layers: list[int] = []
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.fixed = n_blocks is not None
        self.limit: int | None = None   # growing pools stop here (KVPool.set_limit); then PoolFullError
        self.blocks = BlockAllocator(n_blocks or 0)

    @property
    def capacity(self) -> int:
        return self.blocks.n_blocks

    @property
    def refcount(self) -> list[int]:
        return self.blocks.refs

    # ----- storage -----
    def _make(self, layer: int, spec: LayerKV) -> None:
        p = self.pool
        shape_k = (self.capacity, p.block_size, spec.n_head_kv, p.codec_k.row_bytes(spec.head_dim_k))
        shape_v = (self.capacity, p.block_size, spec.n_head_kv, p.codec_v.row_bytes(spec.head_dim_v))
        self.k[layer] = torch.zeros(shape_k, dtype=torch.uint8, device=p.device)
        self.v[layer] = torch.zeros(shape_v, dtype=torch.uint8, device=p.device)

    def _grow(self, need: int) -> None:
        if self.fixed or (self.limit is not None and self.capacity + need > self.limit):
            raise PoolFullError(f"KV pool full: {need} more blocks of {self.pool.block_size} tokens needed, "
                                f"{self.blocks.n_free} of {self.limit or self.capacity} free")
        new_cap = max(2 * self.capacity, self.capacity + need, 16)
        if self.limit is not None:
            new_cap = min(new_cap, self.limit)
        for store in (self.k, self.v):
            for layer, t in store.items():
                grown = torch.zeros((new_cap,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                grown[: self.capacity] = t
                store[layer] = grown
        self.blocks.grow(new_cap)

    # ----- blocks -----
    def alloc(self, n: int) -> list[int]:
        with self.pool.lock:
            if self.blocks.n_free < n:
                self._grow(n - self.blocks.n_free)
            return [self.blocks.alloc() for _ in range(n)]

    def incref(self, ids) -> None:
        with self.pool.lock:
            for b in ids:
                if b >= 0:
                    self.blocks.incref(b)

    def free(self, ids) -> None:
        """Drop one reference to each block; blocks nobody references go back to the free list."""
        with self.pool.lock:
            for b in ids:
                if b >= 0:
                    self.blocks.decref(b)

    def copy_block(self, src: int, dst: int) -> None:
        for store in (self.k, self.v):
            for t in store.values():
                t[dst] = t[src]

    @property
    def n_free(self) -> int:
        return self.blocks.n_free

    @property
    def n_used(self) -> int:
        return self.blocks.n_used


class KVPool:
    """Paged K/V storage for all attention layers of a model (see the module docstring).

    layers: {layer index: LayerKV}; a layer not listed is added on its first write, as a
    full-attention layer shaped like the rows written (for caches built without a model spec).
    """

    def __init__(self, layers: dict[int, LayerKV] | None = None, cache_type_k: str = "f16",
                 cache_type_v: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | dict[int, int] | None = None, device: str | torch.device = "cpu"):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.cache_type_k = cache_type_name(cache_type_k)
        self.cache_type_v = cache_type_name(cache_type_v if cache_type_v is not None else cache_type_k)
        self.codec_k: KVCodec = get_codec(self.cache_type_k)
        self.codec_v: KVCodec = get_codec(self.cache_type_v)
        self.block_size = block_size
        self.device = torch.device(device)
        self.lock = threading.RLock()
        self._n_blocks = n_blocks
        self.layers: dict[int, LayerKV] = {}
        self.groups: list[LayerGroup] = []
        self._group_of: dict[int, LayerGroup] = {}
        for il, spec in sorted((layers or {}).items()):
            self.add_layer(il, spec)

    @classmethod
    def for_model(cls, spec, cache_type_k: str = "f16", cache_type_v: str | None = None, rope=None,
                  **kw) -> "KVPool":
        """A pool for a ModelSpec: its attention layers only (not qwen35's recurrent layers), with
        gemma3's sliding-window layers in their own group. rope(il) -> (rope_dim, neox, inv_freq) or
        None: the layer's key RoPE (the model knows it), for the key preconditioning."""
        layers = {}
        for il in range(spec.n_layer):
            if spec.is_recurrent(il):
                continue
            window = spec.sliding_window if spec.is_swa(il) else 0
            r = rope(il) if rope is not None else None
            partner = rope_key_pairs(spec.head_dim, *r, horizon=spec.context_length) if r is not None else None
            layers[il] = LayerKV(spec.n_head_kv, spec.head_dim, spec.head_dim_v, window, partner)
        return cls(layers, cache_type_k, cache_type_v, **kw)

    def add_layer(self, layer: int, spec: LayerKV) -> LayerGroup:
        with self.lock:
            if layer in self.layers:
                return self._group_of[layer]
            self.codec_k.stored_dim(spec.head_dim_k)   # validates the head size for the cache type
            self.codec_v.stored_dim(spec.head_dim_v)
            g = next((g for g in self.groups if g.window == spec.window), None)
            if g is None:
                n = self._n_blocks.get(spec.window) if isinstance(self._n_blocks, dict) else self._n_blocks
                g = LayerGroup(self, len(self.groups), spec.window, n)
                self.groups.append(g)
            g.layers.append(layer)
            g._make(layer, spec)
            self.layers[layer] = spec
            self._group_of[layer] = g
            return g

    def group(self, layer: int) -> LayerGroup:
        return self._group_of[layer]

    def block_capacity(self) -> int | None:
        """Blocks per layer: the first group's capacity, or what its groups will get before any layer is
        added (None: grown on demand)."""
        if self.groups:
            return self.groups[0].capacity
        n = self._n_blocks
        return next(iter(n.values()), None) if isinstance(n, dict) else n

    def has_layer(self, layer: int) -> bool:
        return layer in self._group_of

    def set_limit(self, max_tokens: int) -> None:
        """Let every group grow to at most max_tokens tokens of blocks (a memory budget: the pool
        then raises PoolFullError instead of growing)."""
        with self.lock:
            for g in self.groups:
                if not g.fixed:
                    g.limit = max(g.capacity, -(-max_tokens // self.block_size))

    @property
    def max_tokens(self) -> int | None:
        """Tokens one group can hold at most (None: unbounded)."""
        caps = [g.capacity if g.fixed else g.limit for g in self.groups]
        if not caps or any(c is None for c in caps):
            return None
        return min(caps) * self.block_size

    def bytes_per_token(self) -> int:
        """K + V bytes one token takes in all layers (padding of rotated types included)."""
        return sum(s.n_head_kv * (self.codec_k.row_bytes(s.head_dim_k) + self.codec_v.row_bytes(s.head_dim_v))
                   for s in self.layers.values())

    def nbytes(self) -> int:
        return sum(t.numel() for g in self.groups for store in (g.k, g.v) for t in store.values())

    def stats(self) -> dict:
        return {"block_size": self.block_size, "cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v,
                "groups": [{"window": g.window, "layers": len(g.layers), "capacity": g.capacity, "used": g.n_used}
                           for g in self.groups],
                "bytes": self.nbytes()}
