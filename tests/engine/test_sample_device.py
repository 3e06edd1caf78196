"""Token choice on the device (engine/sample_device.py), checked against the host Sampler (engine/sampling.py)
on the CPU torch device: greedy picks the same id, ties included; sampled rows take the same uniform number
from the request's generator and pick the Sampler's token; their draws follow the Sampler's filtered
distribution (chi-square)."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sample_device import NOT_SAMPLABLE, check_chosen, choose_tokens, samples_on_device, verify_drafts
from engine.sampling import Sampler, SamplingParams


def _chi2_sf(x: float, dof: int) -> float:
    """P(chi2_dof >= x): the regularized upper incomplete gamma Q(dof/2, x/2) (series / continued fraction)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    lg = math.lgamma(a)
    if z < a + 1:   # series for P
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - lg))
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)   # Lentz's continued fraction for Q
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - lg) * h


def test_chi2_sf_reference_values():
    assert _chi2_sf(20.52, 5) == pytest.approx(0.001, rel=0.01)     # the table values test_sampling.py uses
    assert _chi2_sf(3.841, 1) == pytest.approx(0.05, rel=0.01)
    assert _chi2_sf(124.342, 100) == pytest.approx(0.05, rel=0.01)


def test_samples_on_device_only_without_host_features():
    assert samples_on_device(SamplingParams(temperature=0.0))
    assert samples_on_device(SamplingParams())                                   # top-k, top-p, min-p, temperature
    assert samples_on_device(SamplingParams(repetition_penalty=1.2, penalty_last_n=0))   # (penalties off)
    for kw in (dict(repetition_penalty=1.1), dict(frequency_penalty=0.5), dict(presence_penalty=-0.5),
               dict(logit_bias={3: 1.0}), dict(logprobs=0), dict(logprobs=5)):
        assert not samples_on_device(SamplingParams(**kw)), kw
    assert not samples_on_device(SamplingParams(), constraint=object())


def test_greedy_is_the_samplers_choice_ties_included():
    g = torch.Generator().manual_seed(1)
    V = 1000
    rows = torch.round(torch.randn(64, V, generator=g) * 2) / 2     # coarse values: many ties at the max
    rows[0] = 0.0                                                      # all equal: id 0
    rows[1, [5, 17, 900]] = 99.0                                       # three-way tie: id 5
    rows[2, :] = float("-inf")
    rows[2, [40, 41]] = -3.0                                           # only two finite, tied: id 40
    rows[3, 999] = 1e30                                                # the last id
    ps = [SamplingParams(temperature=0.0)] * rows.shape[0]
    want = [Sampler(p, V).sample(r, []) for p, r in zip(ps, rows)]
    assert want[:4] == [0, 5, 40, 999]
    ties = sum(int((r == r.max()).sum()) > 1 for r in rows)
    assert ties > 20
    assert choose_tokens(rows, ps, [0.0] * len(ps), V).tolist() == want
    # half precision input and an output layer padded past the vocabulary (those ids are not tokens)
    padded = torch.cat([rows, torch.full((rows.shape[0], 24), 1e30)], dim=1)
    assert choose_tokens(padded, ps, [0.0] * len(ps), V).tolist() == want
    half = rows.to(torch.bfloat16)
    want_half = [Sampler(p, V).sample(r, []) for p, r in zip(ps, half)]
    assert choose_tokens(half, ps, [0.0] * len(ps), V).tolist() == want_half


CHAINS = [dict(), dict(top_k=0), dict(top_k=0, top_p=1.0), dict(top_k=0, top_p=1.0, min_p=0.0),
          dict(top_k=7, top_p=1.0, min_p=0.0, temperature=1.0), dict(top_k=100, top_p=0.5, min_p=0.1, temperature=1.3),
          dict(top_k=0, top_p=0.9, min_p=0.0, temperature=0.7), dict(top_k=40, top_p=0.95, min_p=0.0, temperature=0.5),
          dict(top_k=1), dict(top_k=0, top_p=0.999, min_p=0.0, temperature=2.0), dict(temperature=0.0)]


@pytest.mark.parametrize("V,scale", [(500, 1.0), (5000, 3.0), (5000, 0.05)])
def test_sampled_rows_pick_the_samplers_token(V, scale):
    """Every chain (top-k, top-p with and without top-k, min-p, temperatures; greedy rows mixed in) in one
    batch: with the uniform number the request's own generator gives (Sampler.next_uniform), the device pick
    is the host Sampler's token, bit for bit on the same device type. scale 0.05: nearly flat logits, where
    the 1024 most probable tokens hold less than top_p and the Sampler sorts the whole vocabulary."""
    g = torch.Generator().manual_seed(V)
    ps = [SamplingParams(seed=100 + i, **c) for i, c in enumerate(CHAINS * 2)]
    host = [Sampler(p, V) for p in ps]
    dev = [Sampler(p, V) for p in ps]
    n = 0
    for _ in range(12):
        x = torch.randn(len(ps), V, generator=g) * scale
        want = [h.sample(x[i], []) for i, h in enumerate(host)]
        us = [0.0 if p.greedy else d.next_uniform() for p, d in zip(ps, dev)]
        assert choose_tokens(x, ps, us, V).tolist() == want
        n += len(set(want))
    assert n > 100   # (not one token over and over)
    # the generators are where the hosts' are: the same stream
    assert all(torch.equal(h.generator.get_state(), d.generator.get_state()) for h, d in zip(host, dev))


def _target(chain: dict, V: int, seed: int):
    """Random logits [V] (seed), the chain's params, the Sampler's distribution (softmax of final_logits) and the
    tokens that survive the chain."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5
    p = SamplingParams(seed=1, **chain)
    final = Sampler(p, V).final_logits(logits, [])
    return logits, p, torch.softmax(final.double(), 0), torch.isfinite(final)


@pytest.mark.parametrize("chain", [dict(top_k=20, top_p=0.9, min_p=0.02, temperature=0.7),
                                   dict(top_k=0, top_p=0.8, min_p=0.0, temperature=1.3),
                                   dict(top_k=0, top_p=1.0, min_p=0.05, temperature=0.9)])
def test_device_draws_follow_the_samplers_distribution(chain):
    """20000 device draws (uniform numbers from an independent generator, seed 7) against the distribution
    the Sampler draws from: softmax of Sampler.final_logits (after top-k / top-p / min-p / temperature).
    Pearson chi-square over the surviving tokens: observed p = 0.17 (top-k chain), 0.17 (top-p without
    top-k), 0.14 (min-p only) with these seeds (the three share logits and uniform numbers, so their draws
    are correlated); the test asks p > 0.001. Drawing at temperature 1 instead gives p < 1e-160 for the
    first two. Tokens cut by the chain never come."""
    V, N = 64, 20000
    logits, p, expected, keep = _target(chain, V, 3)
    assert 4 <= int(keep.sum()) < V
    us = torch.rand(N, generator=torch.Generator().manual_seed(7), dtype=torch.float64).tolist()
    ids = choose_tokens(logits.expand(N, V), [p] * N, us, V)
    counts = torch.bincount(ids, minlength=V).double()
    assert int(counts[~keep].sum()) == 0
    e = expected[keep] * N
    chi2 = float(((counts[keep] - e) ** 2 / e).sum())
    pval = _chi2_sf(chi2, int(keep.sum()) - 1)
    assert pval > 0.001, (chi2, pval)


@pytest.mark.parametrize("chain", [dict(top_k=20, top_p=0.9, min_p=0.02, temperature=0.7),
                                   dict(top_k=0, top_p=1.0, min_p=0.0, temperature=0.8)])
@pytest.mark.parametrize("draft", ["likely", "unlikely", "cut"])
def test_verified_drafts_are_distributed_as_the_target(chain, draft):
    """Speculative sampling on the device (verify_drafts) with a one-hot draft x: the draft is accepted with
    probability p(x) and the output token, accepted or resampled, follows p, the Sampler's distribution (softmax
    of final_logits). 20000 rows with independent uniform numbers; Pearson chi-square over the surviving tokens
    (p > 0.001) and the number accepted within 4 standard deviations (+ 3) of N p(x). A draft the chain cuts is never
    accepted. A row after the last draft (-1) is a plain draw from p."""
    V, N = 64, 20000
    logits, p, expected, keep = _target(chain, V, 5)
    order = torch.argsort(expected, descending=True)
    x = int(order[0] if draft == "likely" else order[int(keep.sum()) - 1] if draft == "unlikely" else order[-1])
    ur = torch.Generator().manual_seed(11)
    u1 = torch.rand(N, generator=ur, dtype=torch.float64).tolist()
    u2 = torch.rand(N, generator=ur, dtype=torch.float64).tolist()
    out = verify_drafts(logits.expand(N, V), [p] * N, [x] * N, u1, u2, V)
    tok, acc = out[:, 0], out[:, 1]
    assert torch.equal(tok[acc == 1], torch.full_like(tok[acc == 1], x))
    px = float(expected[x])
    assert abs(int(acc.sum()) - N * px) <= 4 * math.sqrt(N * px * (1 - px)) + 3      # (counts: px may be tiny)
    for ids in (tok, verify_drafts(logits.expand(N, V), [p] * N, [-1] * N, u1, u2, V)[:, 0]):
        counts = torch.bincount(ids, minlength=V).double()
        assert int(counts[~keep].sum()) == 0
        e = expected[keep] * N
        chi2 = float(((counts[keep] - e) ** 2 / e).sum())
        assert _chi2_sf(chi2, int(keep.sum()) - 1) > 0.001, chi2
    with pytest.raises(ValueError, match="greedy"):
        verify_drafts(logits[None], [SamplingParams(temperature=0.0)], [x], [0.5], [0.5], V)


def test_nothing_samplable_is_marked_and_raises_like_the_sampler():
    V = 10
    x = torch.zeros(4, V)
    x[0] = float("-inf")
    x[1] = float("nan")
    x[3] = float("-inf")
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(seed=1),
          SamplingParams(seed=2, top_k=0, top_p=1.0, min_p=0.0)]
    got = choose_tokens(x, ps, [0.5] * 4, V).tolist()
    assert got[0] == got[1] == got[3] == NOT_SAMPLABLE and 0 <= got[2] < V
    with pytest.raises(ValueError, match="no token can be sampled") as dev_err:
        check_chosen(got[0])
    with pytest.raises(ValueError, match="no token can be sampled") as host_err:
        Sampler(ps[0], V).sample(x[0], [])
    assert str(dev_err.value) == str(host_err.value)
    assert check_chosen(got[2]) == got[2]


def test_bad_shapes():
    ps = [SamplingParams()] * 2
    with pytest.raises(ValueError, match="expected logits"):
        choose_tokens(torch.zeros(3, 8), ps, [0.1, 0.2], 8)
    with pytest.raises(ValueError, match="fewer than the vocabulary"):
        choose_tokens(torch.zeros(2, 8), ps, [0.1, 0.2], 9)


@pytest.mark.gpu
def test_cuda_device_choice_matches_the_cpu_sampler():
    """On the GPU: greedy ids identical; sampled ids the CPU Sampler's barring float rounding at a boundary
    (the GPU's softmax, top-p sums and cumulative sums round differently: 4 of the 220 draws differed on
    the H200, all sampled rows; a wrong distribution would differ in most)."""
    V = 32000
    g = torch.Generator().manual_seed(5)
    ps = [SamplingParams(seed=100 + i, **c) for i, c in enumerate(CHAINS * 2)]
    host, dev = [Sampler(p, V) for p in ps], [Sampler(p, V) for p in ps]
    diff = sampled = 0
    for _ in range(10):
        x = torch.randn(len(ps), V, generator=g) * 3
        want = [h.sample(x[i], []) for i, h in enumerate(host)]
        us = [0.0 if p.greedy else d.next_uniform() for p, d in zip(ps, dev)]
        got = choose_tokens(x.cuda(), ps, us, V).tolist()
        for p, a, b in zip(ps, want, got):
            if p.greedy:
                assert a == b
            diff += a != b
            sampled += not p.greedy
    assert diff <= max(2, sampled // 20), (diff, sampled)
