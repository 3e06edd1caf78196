"""Drafts accepted at a chosen rate, for measuring speculative decoding's speed on synthetic weights.

A drafter on random weights proposes tokens the target never accepts, so its speed-up cannot be measured
without a trained model. `ControlledAcceptance` keeps the drafter's real work (it runs in full and its
cost counts) and replaces only the tokens it proposes: draft i of a step becomes the target's own next
token at that position with probability rates[i] (the target's greedy continuation, known from a plain
run of the same prompts), and otherwise a token the target rejects (that token + 1). Positions past
`rates` take rate 0. Acceptance then follows the rates position by position: with rates a1, a2, a3 a
step accepts draft 1 with probability a1, drafts 1-2 with a1 * a2, all three with a1 * a2 * a3.

Greedy requests only (the verification compares drafts with the target's argmax; the replaced drafts are
one-hot). Verification is unchanged, so the output must still equal the plain run's: the benchmark checks it.
Used by `hivejet bench spec --accept` (engine/tools/bench_spec_accept.py)."""
from __future__ import annotations

import random
from collections.abc import Sequence


def parse_rates(text: str) -> list[float]:
    """"0.92,0.80,0.65" -> [0.92, 0.8, 0.65]; ValueError naming the bad part otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"acceptance rates {text!r}: give one rate per draft position, e.g. 0.92,0.80,0.65")
    rates = []
    for p in parts:
        try:
            r = float(p)
        except ValueError:
            raise ValueError(f"acceptance rate {p!r} is not a number") from None
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"acceptance rate {p!r} is outside [0, 1]")
        rates.append(r)
    return rates


class ControlledAcceptance:
    """Replaces a sequence's drafts (see the module docstring). continuations: every request's full greedy
    token list (prompt + output) from a plain run; a sequence whose tokens are a prefix of one of them gets
    that list's next tokens as the target's choices. A sequence found in none keeps its drafter's drafts."""

    def __init__(self, rates: Sequence[float], continuations: Sequence[Sequence[int]], vocab_size: int,
                 seed: int = 0):
        if any(not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"acceptance rates {list(rates)} must lie in [0, 1]")
        self.rates = list(rates)
        self.vocab_size = vocab_size
        self._full = [list(c) for c in continuations]
        self._rng = random.Random(seed)
        self.replaced = 0      # drafts replaced so far
        self.by_truth = 0      # of them, by the target's own token

    def _continuation(self, tokens: Sequence[int]) -> list[int] | None:
        n = len(tokens)
        for full in self._full:
            if len(full) > n and full[:n] == list(tokens):
                return full[n:]
        return None

    def replace(self, tokens: Sequence[int], drafts: list[int]) -> list[int]:
        """The drafts to verify after `tokens` (the sequence so far, its newest token last)."""
        if not drafts:
            return drafts
        nxt = self._continuation(tokens)
        if nxt is None:
            return drafts
        out = []
        for i in range(min(len(drafts), len(nxt))):
            truth = nxt[i]
            rate = self.rates[i] if i < len(self.rates) else 0.0
            if self._rng.random() < rate:
                out.append(truth)
                self.by_truth += 1
            else:
                out.append((truth + 1) % self.vocab_size)
        self.replaced += len(out)
        return out
