"""Token choice on the device for a batch of logits rows (the GPU path: decode rows and a prompt's last row).

engine/sampling.py's `Sampler` works on one row and, on a GPU, reads small candidate lists back to the host
(and the engine copied every row's whole logits, 1 MB per row for a 248K vocabulary, to the host before
sampling). Here the rows of a step whose requests need nothing host-only (`samples_on_device`: greedy, or
temperature with top-k / top-p / min-p; no penalties, logit bias, grammar constraint or logprobs) get
their tokens in a few batched ops on the logits' own device, and only the chosen ids [rows] come back.

Same chain, same math, same random stream as the `Sampler`:
- greedy: argmax of the float32 logits; ties go to the lowest id (torch.argmax returns the first maximal
  index, which is what `Sampler.sample` calls too).
- sampled: top-k (torch.topk, sorted) -> top-p (softmax over the k candidates, or over the whole vocabulary
  sorted descending when there is no top-k; the smallest prefix whose cumulative probability reaches
  top_p) -> min-p (logit >= max + log(min_p)) -> temperature -> weights exp(v - max) -> inverse CDF in
  float64 at u * total. u is the request's next uniform number from its `Sampler`'s CPU generator
  (`Sampler.next_uniform`), drawn on the host when the step is launched (one per sampled token, as the
  `Sampler` draws it), so the device needs no generator and a seed gives the tokens the `Sampler` gives
  on the same logits: bit for bit on the same device type (tested on the CPU), and on the GPU path the
  same stream barring float rounding in the GPU's softmax / cumulative sums at a boundary.
- One difference in the work, not the result: without top-k, the `Sampler` first looks at the 1024 most
  probable tokens for top-p and sorts the whole vocabulary only when they hold less than top_p (a
  data-dependent branch, i.e. a host sync); here such rows always sort the whole vocabulary on the device.
  The candidates, their order and the draw are the same (barring equal probabilities exactly at the cut).
- A row whose every logit is -inf or NaN gets id -1 (the `Sampler` raises there; the caller raises the
  same error when it reads the ids).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.sampling import SamplingParams, _check_samplable, _penalties_active

__all__ = ["samples_on_device", "choose_tokens", "verify_drafts", "check_chosen", "NOT_SAMPLABLE"]

NOT_SAMPLABLE = -1


def samples_on_device(params: SamplingParams, constraint=None) -> bool:
    """Whether a request's tokens can be chosen by `choose_tokens` (else its logits go to the host Sampler):
    no grammar constraint, no logprobs, no logit bias, no active penalties."""
    return (constraint is None and params.logprobs is None and not params.logit_bias
            and not _penalties_active(params))


def check_chosen(token: int) -> int:
    """A chosen id read back on the host: NOT_SAMPLABLE raises the Sampler's ValueError."""
    if token == NOT_SAMPLABLE:
        _check_samplable(float("-inf"))
    return token


def _group_key(p: SamplingParams, n: int) -> tuple:
    if p.greedy:
        return ("greedy",)
    if 0 < p.top_k < n:
        return ("topk", int(p.top_k))
    if p.top_p < 1.0:
        return ("sort",)
    return ("all",)


@torch.inference_mode()
def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float],
                  vocab_size: int) -> torch.Tensor:
    """One token id per row of `logits` [rows, >= vocab_size] (columns past the vocabulary are ignored),
    row r under params[r] with uniform number uniforms[r] (ignored for greedy rows), as a long tensor on
    the logits' device; NOT_SAMPLABLE (-1) where every logit is -inf or NaN. No host sync: the caller
    copies the ids back when it needs them."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(uniforms) != len(params):
        raise ValueError(f"expected logits [{len(params)}, V] and {len(params)} uniform numbers, "
                         f"got {tuple(logits.shape)} and {len(uniforms)}")
    if logits.shape[1] < vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} entries, fewer than the vocabulary ({vocab_size})")
    x = logits[:, :vocab_size]
    dev, R = x.device, x.shape[0]
    groups: dict[tuple, list[int]] = {}
    for r, p in enumerate(params):
        groups.setdefault(_group_key(p, vocab_size), []).append(r)
    out = None if len(groups) == 1 else torch.empty(R, dtype=torch.long, device=dev)
    for key, rows in groups.items():
        idx = None if out is None else torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
        xs = (x if idx is None else x.index_select(0, idx)).to(torch.float32)
        if key[0] == "greedy":
            tok = torch.argmax(xs, dim=1)            # the first maximal index: ties go to the lowest id
            best = xs.gather(1, tok[:, None])[:, 0]
        else:
            tok, best = _draw(xs, key, [params[r] for r in rows], [uniforms[r] for r in rows])
        tok = tok.masked_fill((best == float("-inf")) | torch.isnan(best), NOT_SAMPLABLE)
        if out is None:
            return tok
        out.index_copy_(0, idx, tok)
    return out


def _draw(x: torch.Tensor, key: tuple, ps: list[SamplingParams], us: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """engine/sampling.py's Sampler._truncate and _draw, one row per params, batched: (ids, best logit)."""
    w, ids, vmax, cols = _weights(x, key, ps, us)
    return _inverse_cdf(w, ids, cols[0]), vmax[:, 0]


def _weights(x: torch.Tensor, key: tuple, ps: list[SamplingParams], us: list[float]):
    """The rows' candidates after top-k / top-p / min-p and temperature, as weights relative to the best one:
    (w [rows, C], the candidates' ids [rows, C] or None when they are the whole vocabulary in order, the best
    logit [rows, 1], the rows' numbers [6, rows, 1] in float64 with u first)."""
    dev = x.device
    ninf = float("-inf")
    cut_p = [p.top_p < 1.0 for p in ps]
    cut_m = [p.min_p > 0.0 for p in ps]
    # the rows' numbers in one small copy to the device: u, top_p, log(min_p), temperature, the two cut flags
    cols = torch.tensor([list(us), [p.top_p for p in ps], [math.log(p.min_p) if c else 0.0 for p, c in zip(ps, cut_m)],
                         [p.temperature for p in ps], cut_p, cut_m], dtype=torch.float64).to(dev, non_blocking=True)
    cols = cols[:, :, None]
    ids = None
    probs = None
    if key[0] == "topk":
        vals, ids = torch.topk(x, key[1], dim=1, sorted=True)
    elif key[0] == "sort":
        probs, ids = torch.sort(torch.softmax(x, dim=1), dim=1, descending=True)
        vals = x.gather(1, ids)
    else:
        vals = x
    C = vals.shape[1]
    if any(cut_p):
        if probs is None:          # after top-k: renormalised over the k candidates (llama.cpp)
            probs = torch.softmax(vals, dim=1)
        cum = torch.cumsum(probs, dim=1)
        # the smallest prefix whose cumulative probability reaches top_p (at least one token); top_p in
        # float32, as the Sampler's comparison of a float32 tensor with a Python float rounds it
        keep = (cum < cols[1].to(torch.float32)).sum(dim=1, keepdim=True) + 1
        if not all(cut_p):
            keep = torch.where(cols[4] > 0, keep, C)
        vals = vals.masked_fill(torch.arange(C, device=dev)[None, :] >= keep, ninf)
    if any(cut_m):
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p); the max always survives
        vmax = vals.max(dim=1, keepdim=True).values
        low = vals < vmax + cols[2].to(torch.float32)
        if not all(cut_m):
            low = low & (cols[5] > 0)
        vals = vals.masked_fill(low, ninf)
    if any(p.temperature != 1.0 for p in ps):
        vals = vals / cols[3].to(torch.float32)     # (x / 1.0 is exact for rows at temperature 1)
    vmax = vals.max(dim=1, keepdim=True).values
    # weights relative to the best candidate (the inverse CDF needs no normalisation); a +inf logit makes
    # vmax +inf and only the +inf entries get weight
    w = torch.where(vals == vmax, torch.ones_like(vals), torch.exp(vals - vmax))
    return torch.nan_to_num(w, nan=0.0), ids, vmax, cols


def _inverse_cdf(w: torch.Tensor, ids: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from weights w [rows, C] at uniform u [rows, 1] (float64): the candidate ids."""
    cum = torch.cumsum(w.to(torch.float64), dim=1)
    pos = torch.searchsorted(cum, cum[:, -1:] * u, right=True).clamp_(max=w.shape[1] - 1)
    return pos[:, 0] if ids is None else ids.gather(1, pos)[:, 0]


@torch.inference_mode()
def verify_drafts(logits: torch.Tensor, params: Sequence[SamplingParams], drafts: Sequence[int],
                  u_test: Sequence[float], u_resample: Sequence[float], vocab_size: int) -> torch.Tensor:
    """Speculative sampling of drafted rows on the device (engine/spec/verify.py's accept_or_resample for one-hot
    drafts, batched): row r, whose draft is drafts[r] (-1: the row after the last draft), under params[r] (not
    greedy: choose_tokens takes those). A drafted row accepts its draft x with probability p(x), p the row's
    sampling distribution (the Sampler's chain: top-k, top-p, min-p, temperature), decided by u_test[r] < p(x);
    else a token is drawn from p without x at u_resample[r] (from p itself when x holds all its weight). A row
    after the last draft draws from p at u_test[r]. Returns [rows, 2] long on the device: the row's token and
    whether its draft was accepted (1 / 0). No host sync."""
    if not (logits.dim() == 2 and logits.shape[0] == len(params) == len(drafts) == len(u_test) == len(u_resample)):
        raise ValueError(f"expected logits [{len(params)}, V] and as many drafts and uniform numbers, got "
                         f"{tuple(logits.shape)}, {len(drafts)}, {len(u_test)}, {len(u_resample)}")
    x = logits[:, :vocab_size]
    dev, R = x.device, x.shape[0]
    groups: dict[tuple, list[int]] = {}
    for r, p in enumerate(params):
        if p.greedy:
            raise ValueError("greedy rows are verified from choose_tokens' ids")
        groups.setdefault(_group_key(p, vocab_size), []).append(r)
    out = torch.empty(R, 2, dtype=torch.long, device=dev)
    d_all = torch.tensor(list(drafts), dtype=torch.long).to(dev, non_blocking=True)
    for key, rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
        xs = x.index_select(0, idx).to(torch.float32)
        w, ids, vmax, cols = _weights(xs, key, [params[r] for r in rows], [u_test[r] for r in rows])
        d = d_all.index_select(0, idx)[:, None]
        hit = (ids == d) if ids is not None else (torch.arange(w.shape[1], device=dev)[None, :] == d)
        wx = (w * hit).sum(dim=1, keepdim=True).to(torch.float64)
        total = w.to(torch.float64).sum(dim=1, keepdim=True)
        accept = (d >= 0) & (cols[0] * total < wx)
        rest = w.masked_fill(hit, 0.0)
        rest = torch.where(rest.sum(dim=1, keepdim=True) > 0, rest, w)     # (p and x agree: fall back to p)
        u_res = torch.tensor([u_resample[r] for r in rows], dtype=torch.float64).to(dev, non_blocking=True)[:, None]
        drawn = torch.where(d >= 0, _inverse_cdf(rest, ids, u_res)[:, None], _inverse_cdf(w, ids, cols[0])[:, None])
        tok = torch.where(accept, d, drawn)[:, 0]
        bad = (vmax[:, 0] == float("-inf")) | torch.isnan(vmax[:, 0])
        out.index_copy_(0, idx, torch.stack([tok.masked_fill(bad, NOT_SAMPLABLE), accept[:, 0].long()], dim=1))
    return out
