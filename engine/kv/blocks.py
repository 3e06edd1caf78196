"""Host-side bookkeeping of paged KV blocks: a free list and a reference count per block, so that
sequences with a common prefix reference the same blocks and a block returns to the free list when its
last user lets go. Used by the GPU path's shared pool (engine/runner/runner.py: every attention layer uses the
same block ids) and by the CPU path's layer groups (engine/kv/pool.py, which grow it). Nothing here
touches the device, so a step never waits on the host's allocation decisions (they are made before the
step is launched).
"""
from __future__ import annotations


class PoolFullError(RuntimeError):
    """No free KV block is left (and the pool cannot grow)."""


class BlockAllocator:
    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))   # pop() gives the lowest id first

    def grow(self, n_blocks: int) -> None:
        """Blocks n_blocks.. become available (after the ones already free, lowest id first)."""
        if n_blocks > self.n_blocks:
            self.refs += [0] * (n_blocks - self.n_blocks)
            self._free = list(range(n_blocks - 1, self.n_blocks - 1, -1)) + self._free
            self.n_blocks = n_blocks

    def alloc(self) -> int:
        if not self._free:
            raise PoolFullError(f"KV pool full: all {self.n_blocks} blocks are in use")
        b = self._free.pop()
        self.refs[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.refs[b] <= 0:
            raise ValueError(f"block {b} is not allocated")
        self.refs[b] += 1

    def decref(self, b: int) -> None:
        """Drop one reference; a block nobody references is free again."""
        if self.refs[b] <= 0:
            raise ValueError(f"block {b} freed twice")
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._free.append(b)

    def shared(self, b: int) -> bool:
        return self.refs[b] > 1

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    @property
    def n_shared(self) -> int:
        return sum(1 for r in self.refs if r > 1)
