"""The runner's block tables: which blocks of the shared pool each slot holds, on the host (the truth) and in a
device table [slots + 1, max_blocks] that the step's kernels read.

Blocks are taken on the host before a step writes positions that need them (prefill, decode), and the changed
table entries reach the device with a small copy queued before the step (`sync`), so nothing in a step waits for
the host. A table entry a slot does not hold points at the scratch block (after the pool's), so a stray write
never reaches another sequence. Slots with a common prefix reference the same blocks (`share`, reference counts
in the BlockAllocator); a shared block is copied before it is written (copy-on-write, `reserve`). A caller that
must not fail mid-step asks `needed` first and makes room; running out anyway raises PoolFullError before
anything changed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kv.blocks import BlockAllocator, PoolFullError


class SlotTables:
    """n_slots slots (and the scratch slot, n_slots, whose row points only at the scratch block) over a pool of
    n_blocks blocks of block_size positions, a slot holding at most max_blocks. copy_block(a, b): copy block a's
    K/V into block b in every layer (copy-on-write and a shared prefix's partial last block)."""

    def __init__(self, n_slots: int, n_blocks: int, max_blocks: int, block_size: int, device: torch.device,
                 copy_block: Callable[[int, int], None]):
        self.block_size, self.n_blocks = block_size, n_blocks
        self.scratch_block = n_blocks
        self.pool = BlockAllocator(n_blocks)
        self.blocks: list[list[int]] = [[] for _ in range(n_slots)]
        self._dirty: dict[int, int] = {}        # slot -> first table entry the device has not seen
        self._dev_len = [0] * n_slots           # entries the device row holds that are not scratch
        self.table = torch.full((n_slots + 1, max_blocks), self.scratch_block, dtype=torch.int32, device=device)
        self._copy_block = copy_block

    def held(self, slot: int) -> int:
        """Blocks slot references (shared ones included)."""
        return len(self.blocks[slot])

    def held_alone(self, slot: int) -> int:
        """Blocks only slot references: what releasing it frees."""
        return sum(1 for b in self.blocks[slot] if not self.pool.shared(b))

    def needed(self, slot: int, start: int, end: int) -> int:
        """New blocks a write of positions [start, end) into slot takes: blocks up to `end` it does not hold yet
        and copies of the shared blocks it writes."""
        bs, have = self.block_size, self.blocks[slot]
        top = -(-end // bs)
        cow = sum(1 for i in range(start // bs, min(top, len(have))) if self.pool.shared(have[i]))
        return max(0, top - len(have)) + cow

    def check_free(self, need: int) -> None:
        if need > self.pool.n_free:
            raise PoolFullError(f"KV pool full: {need} blocks of {self.block_size} tokens needed, "
                                f"{self.pool.n_free} of {self.n_blocks} free")

    def truncate(self, slot: int, n: int) -> None:
        """Keep only the blocks slot's first n positions need."""
        have = self.blocks[slot]
        keep = -(-n // self.block_size)
        if keep >= len(have):
            return
        for b in have[keep:]:
            self.pool.decref(b)
        del have[keep:]
        self._mark(slot, keep)

    def reserve(self, slot: int, start: int, end: int) -> None:
        """Make slot hold private blocks for writing positions [start, end) and blocks for every position before;
        PoolFullError, with nothing changed, when the free blocks do not suffice."""
        self.check_free(self.needed(slot, start, end))
        have, bs = self.blocks[slot], self.block_size
        for i in range(start // bs, min(-(-end // bs), len(have))):
            if self.pool.shared(have[i]):
                self._copy_on_write(slot, i)
        while len(have) < -(-end // bs):
            have.append(self.pool.alloc())
            self._mark(slot, len(have) - 1)

    def share(self, src: int, dst: int, n: int) -> None:
        """dst (holding no blocks) references src's first n // block_size blocks; a partial last block is copied
        into one of dst's own."""
        full, part = divmod(n, self.block_size)
        self.check_free(1 if part else 0)
        shared = self.blocks[src][:full]
        for b in shared:
            self.pool.incref(b)
        self.blocks[dst].extend(shared)
        if part:
            self.blocks[dst].append(self.pool.alloc())
            self._copy_block(self.blocks[src][full], self.blocks[dst][full])
        self._mark(dst, 0)

    def _copy_on_write(self, slot: int, i: int) -> None:
        """Slot's i-th block is shared and about to be written: give slot a copy of its own."""
        old, new = self.blocks[slot][i], self.pool.alloc()
        self._copy_block(old, new)
        self.pool.decref(old)
        self.blocks[slot][i] = new
        self._mark(slot, i)

    def _mark(self, slot: int, i: int) -> None:
        self._dirty[slot] = min(i, self._dirty.get(slot, i))

    def sync(self) -> None:
        """Copy the table entries that changed on the host to the device (queued on the stream before the step that
        reads them; a pageable source is staged at once, so no host sync)."""
        for slot, lo in self._dirty.items():
            have = self.blocks[slot]
            hi = max(len(have), self._dev_len[slot])
            if hi > lo:
                row = (have + [self.scratch_block] * (hi - len(have)))[lo:hi]
                self.table[slot, lo:hi].copy_(torch.tensor(row, dtype=torch.int32), non_blocking=True)
            self._dev_len[slot] = len(have)
        self._dirty.clear()

    def stats(self) -> dict:
        """The pool's blocks: in use, free, referenced by more than one slot; and its size in tokens."""
        p = self.pool
        return dict(blocks=self.n_blocks, block_size=self.block_size, used=p.n_used, free=p.n_free,
                    shared=p.n_shared, tokens=self.n_blocks * self.block_size)

    def rows(self, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Each (slot, position)'s row in a cache viewed as [blocks * block_size, Hkv, row_bytes], through the
        device table (device ops only: fine inside a CUDA graph)."""
        bs = self.block_size
        return self.table[slots, pos // bs].long() * bs + pos % bs
