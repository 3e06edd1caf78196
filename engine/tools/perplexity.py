"""Perplexity and KL divergence exactly as llama.cpp's llama-perplexity computes them.

The text is tokenized once (BOS added where the model adds it) and cut into chunks of n_ctx tokens;
each chunk is evaluated in a fresh context, its first token replaced by BOS where the model adds
BOS, fed in batches of n_batch tokens; only the second half of each chunk is scored (positions
n_ctx/2 .. n_ctx-2 predicting the next token).

With a base file (llama.cpp's binary `--kl-divergence-base` file, or the compact .npz of
../shared/reference) the same token chunks are evaluated and compared with the base distribution:
KL(base || ours), and how often both put the same token on top.
"""
from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.models.common import SeqChunk


@dataclass
class BaseLogprobs:
    """Reference distributions to compare against, one row per scored position."""

    n_ctx: int
    tokens: np.ndarray                    # int32 [n_chunk, n_ctx], as the base run evaluated them
    first: int
    # exactly one of the two representations is set:
    full_logprobs: np.ndarray | None = None   # float32 [rows, n_vocab] (llama.cpp binary file)
    top_ids: np.ndarray | None = None         # int32 [rows, k] (compact npz)
    top_logprobs: np.ndarray | None = None    # float32 [rows, k]
    target_logprob: np.ndarray | None = None  # float32 [rows] (compact npz)

    @property
    def n_chunk(self) -> int:
        return int(self.tokens.shape[0])


def load_base(path: str | Path) -> BaseLogprobs:
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(8)
    if path.suffix == ".npz" or magic[:2] == b"PK":
        d = np.load(path)
        n_ctx = int(d["n_ctx"])
        return BaseLogprobs(n_ctx=n_ctx, tokens=d["tokens"].astype(np.int64), first=int(d["first"]),
                            top_ids=d["top_ids"], top_logprobs=d["top_logprobs"],
                            target_logprob=d["target_logprob"] if "target_logprob" in d else None)
    if magic != b"_logits_":
        raise ValueError(f"{path}: not a llama.cpp KL-divergence base file (bad magic {magic!r}) nor an .npz")
    raw = np.fromfile(path, dtype=np.uint8)
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", raw, 8)
    off = 20
    tokens = raw[off:off + 4 * n_chunk * n_ctx].view(np.int32).reshape(n_chunk, n_ctx)
    off += 4 * n_chunk * n_ctx
    first = n_ctx // 2
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = n_chunk * (n_ctx - 1 - first)
    need = off + rows * nv * 2
    if raw.size < need:
        raise ValueError(f"{path}: truncated ({raw.size} bytes, expected {need})")
    packed = raw[off:need].view(np.uint16).reshape(rows, nv)
    scale_min = packed[:, :4].copy().view(np.float32)          # [rows, 2]: scale, min_log_prob
    q = packed[:, 4:4 + n_vocab].astype(np.float32)
    full = q * scale_min[:, :1] + scale_min[:, 1:2]
    return BaseLogprobs(n_ctx=n_ctx, tokens=tokens.astype(np.int64), first=first, full_logprobs=full)


@dataclass
class PerplexityResult:
    ppl: float
    ppl_err: float
    n_scored: int
    n_chunk: int
    seconds: float
    chunk_ppl: list[float] = field(default_factory=list)
    kld_mean: float | None = None
    kld_err: float | None = None
    kld_median: float | None = None
    same_top: float | None = None        # fraction
    same_top_err: float | None = None
    base_ppl: float | None = None

    def report(self) -> str:
        lines = [" ".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(self.chunk_ppl)),
                 f"Final estimate: PPL = {self.ppl:.4f} +/- {self.ppl_err:.5f}"]
        if self.kld_mean is not None:
            lines += [
                "",
                "====== Perplexity statistics ======",
                f"Mean PPL(Q)                   : {self.ppl:10.6f}",
                f"Mean PPL(base)                : {self.base_ppl:10.6f}" if self.base_ppl else "",
                f"PPL(Q)/PPL(base)              : {self.ppl / self.base_ppl:10.6f}" if self.base_ppl else "",
                "",
                "====== KL divergence statistics ======",
                f"Mean    KLD: {self.kld_mean:10.6f} ± {self.kld_err:10.6f}",
                f"Median  KLD: {self.kld_median:10.6f}",
                "",
                "====== Token probability statistics ======",
                f"Same top p: {100 * self.same_top:6.3f} ± {100 * self.same_top_err:5.3f} %",
            ]
        return "\n".join(l for l in lines if l is not None)


def make_chunks(tokens: list[int], n_ctx: int, n_chunks: int, bos_id: int | None) -> np.ndarray:
    """llama-perplexity's chunking: whole chunks only; position 0 of each becomes BOS (if any)."""
    n_max = len(tokens) // n_ctx
    if n_max < 1 or len(tokens) < 2 * n_ctx:
        raise ValueError(f"need at least {2 * n_ctx} tokens for a context of {n_ctx}; the text has {len(tokens)}")
    n = n_max if n_chunks < 0 else min(n_chunks, n_max)
    chunks = np.array(tokens[: n * n_ctx], dtype=np.int64).reshape(n, n_ctx)
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def _chunk_logprobs(model, chunk: np.ndarray, first: int, n_batch: int, cache_type_k: str | None = None,
                    cache_type_v: str | None = None, runner=None) -> torch.Tensor:
    """Log-softmax [n_ctx - 1 - first, vocab] of a fresh-context evaluation, fed n_batch at a time
    (through `runner`, engine/runner.py, when given: the GPU path, slot 0)."""
    n_ctx = len(chunk)
    if runner is not None:
        logits = runner.prefill(0, torch.from_numpy(chunk), chunk=n_batch, all_logits=True)
        return torch.log_softmax(logits[first:n_ctx - 1].double().cpu(), dim=-1)
    kv = model.new_kv(cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    out = []
    for start in range(0, n_ctx, n_batch):
        toks = torch.from_numpy(chunk[start:start + n_batch])
        want_from = max(0, first - start)
        (logits,) = model.forward([SeqChunk(toks, start, kv, logits=want_from)])
        out.append(logits)
    logits = torch.cat(out)[: n_ctx - 1 - first]
    return torch.log_softmax(logits.double(), dim=-1)


def _kld_rows(lp: torch.Tensor, base: BaseLogprobs, rows: slice) -> tuple[np.ndarray, np.ndarray]:
    """KL(base || ours) and top-1 agreement for a block of scored rows."""
    if base.full_logprobs is not None:
        b = torch.from_numpy(base.full_logprobs[rows]).double()
        keep = b > -16.0  # llama.cpp ignores base log-probs below -16
        p = torch.where(keep, b.exp(), torch.zeros_like(b))
        kld = (p * (b - lp)).sum(-1)
        same = lp.argmax(-1) == b.argmax(-1)
        return kld.numpy(), same.numpy()
    ids = torch.from_numpy(base.top_ids[rows]).long()
    b = torch.from_numpy(base.top_logprobs[rows]).double()
    ours = torch.gather(lp, 1, ids)
    p = b.exp()
    kld = (p * (b - ours)).sum(-1)
    # one extra bucket for the mass outside the base's top-k
    p_rest = (1.0 - p.sum(-1)).clamp_min(0.0)
    q_rest = (1.0 - ours.exp().sum(-1)).clamp_min(1e-30)
    kld = kld + torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()), torch.zeros_like(p_rest))
    same = lp.argmax(-1) == ids[:, 0]
    return kld.numpy(), same.numpy()


class BaseWriter:
    """Writes llama.cpp's binary --kl-divergence-base file (what `load_base` reads): "_logits_",
    int32 n_ctx, n_vocab, n_chunk, the chunks' tokens, then per scored position n_vocab log-probs
    as uint16 over [max - 16, max] with a float32 (scale, min) header, as llama-perplexity does."""

    def __init__(self, path: str | Path, n_ctx: int, chunks: np.ndarray):
        self.f = open(path, "wb")
        self.n_ctx, self.chunks = n_ctx, chunks
        self.n_vocab: int | None = None

    def write(self, lp: torch.Tensor) -> None:
        lp = lp.double()
        rows, n_vocab = lp.shape
        if self.n_vocab is None:
            self.n_vocab = n_vocab
            self.f.write(b"_logits_")
            self.f.write(np.array([self.n_ctx, n_vocab, len(self.chunks)], np.int32).tobytes())
            self.f.write(self.chunks.astype(np.int32).tobytes())
        nv = 2 * ((n_vocab + 1) // 2) + 4
        mx = lp.max(-1).values
        mn = torch.maximum(lp.min(-1).values, mx - 16)
        scale = (mx - mn) / 65535.0
        q = torch.where(lp > mn[:, None], torch.floor((lp - mn[:, None]) / scale.clamp_min(1e-30)[:, None] + 0.5), 0)
        packed = np.zeros((rows, nv), np.uint16)
        packed[:, :4] = np.stack([scale.numpy(), mn.numpy()], 1).astype(np.float32).view(np.uint16)
        packed[:, 4:4 + n_vocab] = q.clamp(0, 65535).numpy().astype(np.uint16)
        self.f.write(packed.tobytes())

    def close(self) -> None:
        self.f.close()


def perplexity(model, tokenizer, text: str | None = None, n_ctx: int = 512, n_chunks: int = -1,
               n_batch: int = 2048, base: BaseLogprobs | None = None, progress=None,
               cache_type_k: str | None = None, cache_type_v: str | None = None,
               save_base: str | Path | None = None, runner=None) -> PerplexityResult:
    """llama-perplexity's numbers. cache_type_k/v: the KV cache types (default: the model's);
    save_base: also write this run's log-probs as a KL-divergence base file for later runs;
    runner: evaluate through engine/runner.py (the GPU path) instead of the model's CPU forward."""
    t0 = time.time()
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    if base is not None:
        # the base stores the text's tokens; like llama.cpp, position 0 of each chunk becomes BOS
        chunks = (base.tokens if n_chunks < 0 else base.tokens[:n_chunks]).copy()
        if bos is not None:
            chunks[:, 0] = bos
        n_ctx, first = base.n_ctx, base.first
    else:
        if text is None:
            raise ValueError("give a text or a KL-divergence base file")
        ids = tokenizer.encode(text, add_special=True, parse_special=True)
        chunks = make_chunks(ids, n_ctx, n_chunks, bos)
        first = n_ctx // 2
    n_batch = max(1, min(n_batch, n_ctx))
    nll = []
    klds, sames, base_nll = [], [], []
    chunk_ppl = []
    per_chunk = n_ctx - 1 - first
    writer = BaseWriter(save_base, n_ctx, chunks) if save_base else None
    for i, chunk in enumerate(chunks):
        lp = _chunk_logprobs(model, chunk, first, n_batch, cache_type_k, cache_type_v, runner)
        if writer is not None:
            writer.write(lp)
        targets = torch.from_numpy(chunk[first + 1:]).long()
        tok_lp = lp.gather(1, targets[:, None])[:, 0]
        nll.append(-tok_lp.numpy())
        chunk_ppl.append(math.exp(float(np.concatenate(nll).mean())))
        if base is not None:
            rows = slice(i * per_chunk, (i + 1) * per_chunk)
            k, s = _kld_rows(lp, base, rows)
            klds.append(k)
            sames.append(s)
            if base.full_logprobs is not None:
                base_nll.append(-base.full_logprobs[rows][np.arange(per_chunk), chunk[first + 1:]])
            elif base.target_logprob is not None:
                base_nll.append(-base.target_logprob[rows])
        if progress:
            progress(i + 1, len(chunks), chunk_ppl[-1])
    if writer is not None:
        writer.close()
    nll_all = np.concatenate(nll).astype(np.float64)
    mean = nll_all.mean()
    ppl = math.exp(mean)
    err = math.sqrt(max(nll_all.var(), 0.0) / max(len(nll_all) - 1, 1)) * ppl
    res = PerplexityResult(ppl=ppl, ppl_err=err, n_scored=len(nll_all), n_chunk=len(chunks),
                           seconds=time.time() - t0, chunk_ppl=chunk_ppl)
    if base is not None:
        k = np.concatenate(klds)
        s = np.concatenate(sames).astype(np.float64)
        res.kld_mean = float(k.mean())
        res.kld_err = float(k.std(ddof=1) / math.sqrt(len(k))) if len(k) > 1 else 0.0
        res.kld_median = float(np.median(k))
        res.same_top = float(s.mean())
        res.same_top_err = float(math.sqrt(res.same_top * (1 - res.same_top) / max(len(s) - 1, 1)))
        if base_nll:
            res.base_ppl = math.exp(float(np.concatenate(base_nll).mean()))
    return res
