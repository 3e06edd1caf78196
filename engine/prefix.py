"""Prefix reuse on the CPU path: resident conversations and shared prompt prefixes.

An agent resends its whole conversation with every request; recomputing it costs seconds to minutes.
So a finished (or cancelled) sequence's KV stays in the pool as a *resident* entry, and a running
sequence's computed prefix is visible too. A new request looks for the entry whose stored tokens share
the longest prefix with its prompt, forks that KV (the pool shares the blocks copy-on-write) and starts
computing where the match ends: a follow-up processes only its new tokens, and agents with the same
system prompt and tool list store it once.

Rules that keep the result the same as computing the prompt from scratch:
- the reused length is a multiple of 16 (the CPU matmul's row block: a row's numbers depend on its
  index in a 16-row block) and later chunks stay cut at multiples of the engine's prefill chunk;
- at least the prompt's last token is computed again (its logits start the answer);
- a sliding-window layer group must still hold every block the window needs at that length;
- a recurrent (qwen35) model can only resume where a snapshot of its states was taken: at the end of
  every prompt chunk (multiples of the prefill chunk) and at the end of the prompt and of the answer;
- images count by content (`Sequence.prefix_keys`: their placeholder tokens do not say which image they
  hold), and an image attended both ways (Gemma) is never entered mid-way.

Resident entries are evicted least recently used first when their tokens exceed the budget.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kernels.quant.ref import ROW_BLOCK

MAX_CHECKPOINTS = 8   # recurrent-state snapshots kept per sequence (the newest)


@dataclass
class Entry:
    """KV of `tokens` (all stored), and for recurrent models snapshots by length."""
    tokens: list[int]
    kv: object                         # engine.kv.SequenceKV
    checkpoints: dict[int, dict] = field(default_factory=dict)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i + 256 <= n and a[i:i + 256] == b[i:i + 256]:   # slices compare in C: long prefixes stay cheap
        i += 256
    while i < n and a[i] == b[i]:
        i += 1
    return i


def add_checkpoint(checkpoints: dict[int, dict], kv) -> None:
    """Snapshot a recurrent model's states at the sequence's current length."""
    if not kv.recurrent:
        return
    checkpoints[kv.length] = kv.snapshot()
    while len(checkpoints) > MAX_CHECKPOINTS:
        del checkpoints[min(checkpoints)]


def _window_ok(kv, length: int) -> bool:
    """Every sliding-window group still holds the blocks a query at `length` can see."""
    bs = kv.pool.block_size
    for t in kv.tables.values():
        w = t.group.window
        if w and t.first_kept > 0 and t.first_kept * bs > max(0, length - w):
            return False
    return True


def usable_length(entry: Entry, prompt: list[int], recurrent: bool) -> int:
    """How many of `prompt`'s tokens this entry can supply (0: none)."""
    n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
    if recurrent:
        n = max((p for p in entry.checkpoints if p <= n and p % ROW_BLOCK == 0), default=0)
    else:
        n -= n % ROW_BLOCK
    if n > 0 and not _window_ok(entry.kv, n):
        return 0
    return n


class ResidentCache:
    """Finished conversations' KV, least recently used first out, within `budget_tokens`."""

    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.evicted = 0

    @property
    def n_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries.values())

    def add(self, key: int, entry: Entry) -> None:
        if self.budget <= 0 or not entry.tokens or len(entry.tokens) > self.budget:
            entry.kv.release()
            return
        self.entries[key] = entry
        while self.n_tokens > self.budget:
            _, old = self.entries.popitem(last=False)
            old.kv.release()
            self.evicted += 1

    def evict_one(self) -> bool:
        """Drop the least recently used entry (False when there is none)."""
        if not self.entries:
            return False
        _, old = self.entries.popitem(last=False)
        old.kv.release()
        self.evicted += 1
        return True

    def best(self, prompt: list[int], recurrent: bool, running: list[Entry] = ()) -> tuple[int, Entry | None, int | None]:
        """The longest reusable prefix among resident entries and `running` ones:
        (length, entry, resident key or None)."""
        best = (0, None, None)
        for key, e in self.entries.items():
            n = usable_length(e, prompt, recurrent)
            if n > best[0]:
                best = (n, e, key)
        for e in running:
            n = usable_length(e, prompt, recurrent)
            if n > best[0]:
                best = (n, e, None)
        if best[2] is not None:
            self.entries.move_to_end(best[2])   # recently used
        return best

    def clear(self) -> None:
        for e in self.entries.values():
            e.kv.release()
        self.entries.clear()
