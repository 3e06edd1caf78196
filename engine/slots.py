"""The runner's slots (GPU path, engine/runner/runner.py): which are free, which hold a parked conversation
(a finished one whose KV blocks and recurrent states stay in place for a follow-up or a shared prefix), and
taking a slot for a sequence that starts running (continuing a parked conversation, sharing another slot's
prefix, a free slot, else the least recently parked one).

A SlotTable works on anything with the runner's slot methods (held_alone, release, truncate, find_prefix,
share_prefix, block_size, pool.n_free), so the Scheduler's room and eviction decisions can be tested with a
plain block manager (tests/engine/test_scheduler.py).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

from engine.prefix import common_prefix

if TYPE_CHECKING:
    from engine.sequence import Sequence


class SlotTable:
    """Free and parked slots of one runner. `drafters` (the Speculator, or None) keeps the model drafters'
    states of parked conversations: drop_parked(slot), mtp_from / dflash_from when a slot is taken."""

    def __init__(self, runner, n_slots: int, drafters=None):
        self.runner = runner
        self.drafters = drafters
        self.free = list(range(n_slots - 1, -1, -1))
        self.parked: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # slot -> its tokens

    def spare_blocks(self) -> int:
        """The pool's free blocks plus those only parked conversations hold (evictable)."""
        r = self.runner
        return r.pool.n_free + sum(r.held_alone(p) for p in self.parked)

    def release(self, slot: int) -> None:
        """A running sequence's slot goes back: its blocks to the pool, the slot to the free list."""
        self.runner.release(slot)
        self.free.append(slot)

    def park(self, slot: int, keys: list[int]) -> None:
        """A finished conversation stays in its slot (its blocks and states kept) until evicted."""
        self.parked[slot] = keys

    def _drop_drafters(self, slot: int) -> None:
        if self.drafters is not None:
            self.drafters.drop_parked(slot)

    def evict_lru(self) -> bool:
        """Drop the least recently used parked conversation: its slot is free, its blocks go back to the
        pool unless another slot shares them. False when none is parked."""
        if not self.parked:
            return False
        slot, _ = self.parked.popitem(last=False)
        self._drop_drafters(slot)
        self.release(slot)
        return True

    def take(self, s: Sequence, prefill_chunk: int, recurrent: bool, share: bool, running: list,
             totals: collections.Counter) -> None:
        """A finished conversation stays parked in its slot (KV blocks and recurrent states in place); a
        request whose prompt continues one (its images compared by content: prefix_keys) takes that slot over
        and computes only the rest.
        Else the longest prefix another slot holds, running or parked (agents sharing a system prompt), is
        shared with the new slot (share: Runner.find_prefix / share_prefix: a multiple of prefill_chunk, its
        blocks referenced, recurrent states from a checkpoint), and only the rest is computed, with the
        numbers a cold run gives. Else a free slot, else the least recently parked one. A sequence back
        from a pre-emption needs all its tokens but the last again (s.target). With MTP drafts, the MTP
        block's cache comes along: the parked conversation's own, or a fork of the donor's (mtp_from)."""
        r, pc = self.runner, prefill_chunk
        best, n, whole = None, 0, False
        prompt = s.prefix_keys(s.target)      # (images by content: a follow-up of a conversation with images)
        for slot, toks in self.parked.items():
            lcp = common_prefix(toks, prompt)
            if recurrent:   # the states are those after the parked tokens: all or nothing
                use = len(toks) if lcp >= len(toks) and len(toks) < s.target else 0
            else:
                use = min(lcp, s.target - 1)
                if s.vision is not None:
                    use = s.vision.safe_start(use)   # (an image attended both ways is read whole)
            if use > n:
                best, n, whole = slot, use, lcp >= len(toks)
        match = None
        if share:
            donors = {q.slot: q.prefix_keys(q.n_computed) for q in running if q.slot is not None}
            donors.update(self.parked)
            match = r.find_prefix(prompt, donors, pc)
            if match is not None and s.vision is not None and not recurrent:
                n_safe = s.vision.safe_start(match.n) // pc * pc   # (an image attended both ways is read whole)
                match = dataclasses.replace(match, n=n_safe) if n_safe >= r.block_size else None
        # taking over a parked conversation the prompt does not continue loses that conversation: worth it
        # only for at least a block, and a chunk more than a copy would give
        if best is not None and not whole and (n < r.block_size or (match is not None and n - pc < match.n)):
            best, n = None, 0
        d = self.drafters
        if match is not None and match.n > n:
            if s.vision is None and d is not None:   # (model drafters do not draft for prompts with images)
                s.mtp = d.mtp_from(s, match.src, match.n, take=False)
                s.dflash = d.dflash_from(s, match.src, match.n, take=False)
            if self.free:
                s.slot = self.free.pop()
            else:   # the least recently parked slot other than the donor (the donor itself when it is the only one)
                s.slot = next((p for p in self.parked if p != match.src), match.src)
                del self.parked[s.slot]
                self._drop_drafters(s.slot)
            if match.src in self.parked:
                self.parked.move_to_end(match.src)   # just used: evicted last
            r.share_prefix(match, s.slot)              # (drops what s.slot held before)
            s.n_computed = s.cached = match.n
            totals["cached_tokens"] += match.n
            totals["shared_tokens"] += match.n
        elif best is not None:
            del self.parked[best]
            if s.vision is None and d is not None:   # (model drafters do not draft for prompts with images)
                s.mtp = d.mtp_from(s, best, n, take=True)
                s.dflash = d.dflash_from(s, best, n, take=True)
            self._drop_drafters(best)
            s.slot = best
            r.truncate(best, n)                        # the blocks after the common part go back to the pool
            s.n_computed = s.cached = n
            totals["cached_tokens"] += n
        elif self.free:
            s.slot = self.free.pop()
        else:
            s.slot, _ = self.parked.popitem(last=False)
            self._drop_drafters(s.slot)
            r.release(s.slot)
