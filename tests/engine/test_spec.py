"""Drafting and verification: n-gram lookup finds the longest earlier match; greedy verification
keeps the target's argmax path; rejection sampling keeps the target distribution exactly."""
from __future__ import annotations

import math

import torch

from engine.spec.ngram import NgramDrafter, NgramIndex, SharedNgramPool
from engine.spec.verify import verify_greedy, verify_sampled


def test_ngram_longest_most_recent_match():
    d = NgramDrafter(min_n=1, max_n=4)
    d.extend([5, 1, 2, 3, 7, 1, 2, 3, 8, 9, 1, 2, 3])
    # suffix (1,2,3) occurred twice: the most recent earlier one is followed by 8, 9
    assert d.propose(2) == [8, 9]
    d.extend([8])
    assert d.propose(5) == [9, 1, 2, 3, 8]  # suffix (2,3,8) matched, continuation runs to the end


def test_ngram_suffix_does_not_match_itself():
    idx = NgramIndex(2, 3)
    idx.extend([1, 2, 3])
    assert idx.lookup(4) == (0, [])


def test_shared_pool_across_conversations():
    pool = SharedNgramPool(n=3)
    pool.add([10, 11, 12, 13, 14, 15, 16])
    d = NgramDrafter(min_n=2, max_n=4, pool=pool)
    d.extend([99, 10, 11, 12])
    assert d.propose(3) == [13, 14, 15]


def test_greedy_verification():
    logits = torch.zeros(4, 10)
    for i, t in enumerate([3, 4, 9, 6]):
        logits[i, t] = 1.0
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 9]     # third draft wrong: corrected
    assert verify_greedy(logits, [3, 4, 9]) == [3, 4, 9, 6]  # all accepted: bonus token
    assert verify_greedy(logits, [1]) == [3]


def _chi_square_p(counts: dict, expected: dict, n: int) -> float:
    """Pearson chi-square test p-value (upper tail) via the Wilson-Hilferty normal approximation."""
    keys = [k for k in expected if expected[k] * n >= 5]
    stat = sum((counts.get(k, 0) - expected[k] * n) ** 2 / (expected[k] * n) for k in keys)
    df = len(keys) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_keeps_distribution():
    """Two positions, V=5: the joint law of (first, second) token with random drafts from q equals
    sampling from p directly."""
    torch.manual_seed(0)
    V = 5
    p0 = torch.softmax(torch.randn(V), 0)
    p1_given = torch.softmax(torch.randn(V, V), 1)   # p(second | first)
    q0 = torch.softmax(torch.randn(V), 0)
    gen = torch.Generator().manual_seed(1)
    n = 20000
    counts: dict = {}
    for _ in range(n):
        x0 = int(torch.multinomial(q0, 1, generator=gen))
        p = torch.stack([p0, p1_given[x0]])
        toks = verify_sampled(p, [x0], gen, q=q0[None])
        if len(toks) == 1:  # rejected: the second token is drawn in the next step from p(. | first)
            toks.append(int(torch.multinomial(p1_given[toks[0]], 1, generator=gen)))
        key = tuple(toks[:2])
        counts[key] = counts.get(key, 0) + 1
    expected = {(a, b): float(p0[a] * p1_given[a, b]) for a in range(V) for b in range(V)}
    assert _chi_square_p(counts, expected, n) > 0.001


def test_one_hot_drafts_keep_distribution():
    torch.manual_seed(3)
    V = 6
    p = torch.softmax(torch.randn(2, V), 1)
    gen = torch.Generator().manual_seed(2)
    n = 20000
    counts: dict = {}
    for _ in range(n):
        first = verify_sampled(p, [2], gen)[0]  # always draft token 2
        counts[first] = counts.get(first, 0) + 1
    expected = {a: float(p[0, a]) for a in range(V)}
    assert _chi_square_p(counts, expected, n) > 0.001
