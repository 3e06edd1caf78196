"""N-gram / prompt-lookup drafting: continue the most recent earlier occurrence of the longest suffix
of the conversation (prompt and output) that has occurred before. Costs no GPU time and is strong on
code edits, where the answer repeats long runs of the prompt.

`SharedNgramPool` remembers continuations across conversations (several agents working on the same
files), consulted when a sequence's own history has no match.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NgramIndex:
    """Positions of every n-gram (min_n <= n <= max_n) of one token stream, updated incrementally.
    index[n][gram] = where the continuation of its most recent occurrence starts. A gram is indexed
    only once a token follows it, so the current suffix never matches itself."""

    def __init__(self, min_n: int = 2, max_n: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new: Sequence[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(int(t))
            follow = len(toks) - 1  # the new token follows the grams that end just before it
            for n in range(self.min_n, min(self.max_n, follow) + 1):
                self._index[n][tuple(toks[follow - n:follow])] = follow

    def lookup(self, k: int) -> tuple[int, list[int]]:
        """(match length n, up to k tokens that followed the longest earlier match of the suffix)."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            pos = self._index[n].get(tuple(toks[-n:]))
            if pos is not None:
                return n, toks[pos:pos + k]
        return 0, []


class SharedNgramPool:
    """Continuations seen in any conversation, keyed by the preceding n tokens (bounded, LRU)."""

    def __init__(self, n: int = 4, max_entries: int = 200_000, span: int = 16):
        self.n, self.span, self.max_entries = n, span, max_entries
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def add(self, tokens: Sequence[int]) -> None:
        n, span = self.n, self.span
        for i in range(n, len(tokens) - 1):
            key = tuple(tokens[i - n:i])
            self._table[key] = tuple(tokens[i:i + span])
            self._table.move_to_end(key)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def lookup(self, suffix: Sequence[int], k: int) -> list[int]:
        if len(suffix) < self.n:
            return []
        cont = self._table.get(tuple(suffix[-self.n:]))
        return list(cont[:k]) if cont else []


class NgramDrafter:
    """Drafts for one sequence: its own history first, then the shared pool."""

    def __init__(self, min_n: int = 2, max_n: int = 8, pool: SharedNgramPool | None = None):
        self.index = NgramIndex(min_n, max_n)
        self.pool = pool

    def extend(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        n, draft = self.index.lookup(k)
        if not draft and self.pool is not None:
            draft = self.pool.lookup(self.index.tokens, k)
        return draft

    def match_length(self) -> int:
        """How many tokens of the suffix matched: the longest earlier match in this conversation, else
        the shared pool's key length when it has a continuation, else 0 (chains choose by this)."""
        n, draft = self.index.lookup(1)
        if draft:
            return n
        if self.pool is not None and self.pool.lookup(self.index.tokens, 1):
            return self.pool.n
        return 0
