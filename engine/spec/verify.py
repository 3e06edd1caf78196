"""Verifying drafts against the target model's distributions.

Greedy: accept drafts while each equals the target's argmax; the first mismatch is replaced by the
argmax, and when every draft is accepted the argmax after the last one is a bonus token.

Sampled (speculative sampling, Leviathan et al. / Chen et al.): draft x_i ~ q_i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); the first rejected position is resampled from
normalize(max(p_i - q_i, 0)); when all are accepted a bonus token is drawn from p_k. The tokens that
come out are distributed exactly as if sampled from p one at a time. n-gram and MTP drafts are
deterministic: q_i is one-hot on x_i, so acceptance is p_i(x_i) and the residual is p_i with x_i
removed. DFlash drafts are sampled from the drafter's own distribution, passed as a full q_i.
"""
from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits [k+1, V] for the rows (last token, draft 1..k). Returns the tokens to append:
    the accepted drafts plus one target token (correction or bonus)."""
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        if best[i] != d:
            out.append(best[i])
            return out
        out.append(d)
    out.append(best[len(drafts)])
    return out


def draw_from(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from unnormalised probabilities (inverse CDF, one uniform from `gen`)."""
    return _draw(probs, gen)


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One categorical draw by inverse CDF with one uniform number from the request's generator."""
    u = torch.rand((), generator=gen, dtype=torch.float64).item()
    cdf = torch.cumsum(probs.double(), 0)
    idx = int(torch.searchsorted(cdf, torch.tensor(u * cdf[-1].item(), dtype=torch.float64), right=True).item())
    return min(idx, probs.shape[0] - 1)


def accept_or_resample(p: torch.Tensor, x: int, gen: torch.Generator,
                       q: torch.Tensor | None = None) -> tuple[int, bool]:
    """One draft row. p [V]: the target's sampling distribution; x: the draft, drawn from q [V] (None:
    one-hot on x). Returns (x, True) when accepted (probability min(1, p(x) / q(x))), else (a token
    drawn from normalize(max(p - q, 0)), False). Always draws one uniform for the test, so the
    request's random stream advances the same way whatever p and q are."""
    px = float(p[x])
    qx = 1.0 if q is None else float(q[x])
    if torch.rand((), generator=gen, dtype=torch.float64).item() * qx < px:
        return x, True
    if q is None:
        residual = p.clone()
        residual[x] = 0.0
    else:
        residual = (p.double() - q.double()).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p and q agree up to rounding: fall back to p
        residual = p
    return _draw(residual, gen), False


def verify_sampled(p: torch.Tensor, drafts: list[int], gen: torch.Generator,
                   q: torch.Tensor | None = None) -> list[int]:
    """p [k+1, V]: the target's sampling distributions (after the request's temperature, top-k/p,
    min-p, penalties) for the rows (last token, draft 1..k). q [k, V]: the drafter's distributions,
    or None for deterministic (one-hot) drafts. Returns accepted drafts + one target token."""
    out = []
    for i, x in enumerate(drafts):
        tok, accepted = accept_or_resample(p[i], x, gen, None if q is None else q[i])
        out.append(tok)
        if not accepted:
            return out
    out.append(_draw(p[len(drafts)], gen))
    return out
