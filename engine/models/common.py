"""Building blocks shared by the architectures: quantized weights, norms, RoPE, attention,
per-sequence KV, and the batch of sequence chunks that one forward pass processes.

One forward stacks the rows of every sequence in the step (prefill chunks and decode tokens),
so each weight matrix is read once per step; attention runs per sequence over its own KV.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.reader import GGUFError, GGUFFile
from kernels.quant import (check_supported, dequantize_rows, matmul_row_invariant, quantized_matmul_ref,
                           round_activations_like_llamacpp)

_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


class Weight:
    """One GGUF tensor kept in its file blocks (a view of the memory-mapped file, never expanded
    whole). Matrices are dequantized tile by tile inside `matmul`; small vectors (norms, biases)
    are converted to float32 once, since they are a negligible fraction of the model."""

    def __init__(self, f: GGUFFile, name: str):
        info = f.tensors[name]
        try:
            check_supported(info.qtype)
        except ValueError as e:
            raise GGUFError(f.path, f"tensor {name!r}: {e}") from None
        self.name = name
        self.qtype = info.qtype
        self.shape = info.shape
        self.raw = torch.from_numpy(np.asarray(f.tensor_bytes(name)))
        if len(self.shape) == 1:
            self.dense = dequantize_rows(self.raw.view(1, -1), self.qtype, self.shape[0])[0]
        else:
            self.dense = None

    @property
    def n_out(self) -> int:
        return self.shape[0]

    @property
    def n_in(self) -> int:
        return self.shape[-1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, n_in] float32 -> x @ W.T [M, n_out]."""
        if self.qtype == QT.F32:
            return matmul_row_invariant(x, self.raw.view(torch.float32).view(self.n_out, self.n_in))
        x = round_activations_like_llamacpp(x, self.qtype)
        return quantized_matmul_ref(x, self.raw, self.qtype, self.n_out, self.n_in)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantize only the given rows (embedding lookup)."""
        row_bytes = self.raw.numel() // self.n_out
        raw_rows = self.raw.view(self.n_out, row_bytes)[ids]
        return dequantize_rows(raw_rows, self.qtype, self.n_in)


class WeightSet:
    """Named access to a model's tensors with clear errors for missing ones."""

    def __init__(self, f: GGUFFile):
        self.file = f
        self._cache: dict[str, Weight] = {}

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> Weight:
        if name not in self.file.tensors:
            raise GGUFError(self.file.path, f"missing tensor {name!r}")
        w = self._cache.get(name)
        if w is None:
            w = self._cache[name] = Weight(self.file, name)
        if shape is not None and tuple(w.shape) != tuple(shape):
            raise GGUFError(self.file.path, f"tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(shape)}")
        return w

    def opt(self, name: str, shape: tuple[int, ...] | None = None) -> Weight | None:
        return self.get(name, shape) if self.has(name) else None


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


class Rope:
    """Rotary position embedding over the first `dim` dims of each head.
    neox=False rotates adjacent pairs (x0,x1),(x2,x3)... (llama.cpp ROPE_TYPE_NORM);
    neox=True rotates (x_i, x_{i+dim/2}) (ROPE_TYPE_NEOX)."""

    def __init__(self, dim: int, base: float, freq_scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, neox: bool = False):
        self.dim = dim
        self.neox = neox
        inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        inv = inv * freq_scale
        if freq_factors is not None:
            inv = inv / freq_factors.to(torch.float64)
        self.inv_freq = inv

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        theta = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        return theta.cos().float(), theta.sin().float()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H, D]; cos/sin [N, dim/2]."""
        d = self.dim
        rot, rest = x[..., :d], x[..., d:]
        c, s = cos[:, None, :], sin[:, None, :]
        if self.neox:
            a, b = rot[..., : d // 2], rot[..., d // 2:]
            out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class SequenceKV:
    """Per-sequence cache for the CPU path: per layer, K and V (f16 by default, llama.cpp's default
    cache type; `dtype=torch.float32` for exact comparisons) in a buffer that grows by doubling, and,
    for recurrent layers (Gated DeltaNet), that layer's state in `recurrent[layer]` (a tuple of
    float32 tensors, e.g. (conv window, state matrix)) after `recurrent_length` tokens. The paged
    pool (engine/kv) replaces this later."""

    def __init__(self, n_layer: int, dtype: torch.dtype = torch.float16):
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.dtype = dtype
        self.length = 0  # tokens stored (committed after each forward)
        self.recurrent: dict[int, tuple[torch.Tensor, ...]] = {}
        self.recurrent_length = 0  # tokens the recurrent states have consumed

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, Hkv, D] at positions start..start+n; return all K, V up to the end (f32)."""
        n = k.shape[0]
        end = start + n
        buf_k, buf_v = self.k[layer], self.v[layer]
        if buf_k is None or buf_k.shape[0] < end:
            cap = max(end, 2 * (buf_k.shape[0] if buf_k is not None else 64))
            new_k = torch.empty((cap,) + tuple(k.shape[1:]), dtype=self.dtype)
            new_v = torch.empty((cap,) + tuple(v.shape[1:]), dtype=self.dtype)
            if buf_k is not None:
                new_k[:start] = buf_k[:start]
                new_v[:start] = buf_v[:start]
            self.k[layer], self.v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[start:end] = k.to(self.dtype)
        buf_v[start:end] = v.to(self.dtype)
        return buf_k[:end].float(), buf_v[:end].float()

    def truncate(self, length: int) -> None:
        """Forget tokens from `length` on. KV entries simply get overwritten; recurrent states cannot
        be rewound, so a hybrid model needs `restore(snapshot)` to go back (its forward refuses a
        chunk that does not start where its recurrent states are)."""
        self.length = min(self.length, length)

    def snapshot(self) -> dict:
        """What `restore` needs to return to this point: lengths and copies of the recurrent states
        (K/V beyond the restored length are overwritten by later appends, so they are not copied)."""
        return {"length": self.length, "recurrent_length": self.recurrent_length,
                "recurrent": {il: tuple(t.clone() for t in st) for il, st in self.recurrent.items()}}

    def restore(self, snap: dict) -> None:
        self.length = snap["length"]
        self.recurrent_length = snap["recurrent_length"]
        self.recurrent = {il: tuple(t.clone() for t in st) for il, st in snap["recurrent"].items()}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
              window: int = 0) -> torch.Tensor:
    """Causal attention of q [T, H, D] (positions q_start..q_start+T) over k, v [S, Hkv, D]
    (positions 0..S). GQA: each KV head serves H/Hkv query heads. window > 0: a query at p sees
    keys at p' with p - p' < window (llama.cpp's standard sliding window)."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    g = H // Hkv
    qh = q.reshape(T, Hkv, g, D).permute(1, 2, 0, 3)            # [Hkv, g, T, D]
    kh = k.permute(1, 0, 2)[:, None]                              # [Hkv, 1, S, D]
    vh = v.permute(1, 0, 2)[:, None]
    scores = (qh @ kh.transpose(-1, -2)) * scale                  # [Hkv, g, T, S]
    qpos = torch.arange(q_start, q_start + T)[:, None]
    kpos = torch.arange(S)[None, :]
    masked = kpos > qpos
    if window > 0:
        masked |= (qpos - kpos) >= window
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh                      # [Hkv, g, T, Dv]
    return out.permute(2, 0, 1, 3).reshape(T, H, v.shape[-1])


@dataclass
class SeqChunk:
    """One sequence's rows in a forward pass: `tokens` at positions start..start+n."""

    tokens: torch.Tensor          # long [n]
    start: int
    kv: SequenceKV
    logits: str | int = "last"    # "last", "all", "none", or an int k: rows k.. of this chunk
    positions: torch.Tensor | None = None  # RoPE positions if not start..start+n: [n], or [n, 3] (M-RoPE t,h,w)


@dataclass
class Batch:
    chunks: list[SeqChunk]
    positions: torch.Tensor = field(init=False)
    offsets: list[int] = field(init=False)
    rope: dict = field(init=False, default_factory=dict)  # cos/sin tables, filled by the model's prepare()

    def __post_init__(self):
        self.offsets = [0]
        pos = []
        for c in self.chunks:
            self.offsets.append(self.offsets[-1] + len(c.tokens))
            pos.append(torch.arange(c.start, c.start + len(c.tokens)))
        self.positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([c.tokens for c in self.chunks])

    def logit_rows(self) -> tuple[torch.Tensor, list[slice]]:
        """Indices of rows whose logits are wanted, and each chunk's slice into the logits."""
        rows, slices = [], []
        for c, off in zip(self.chunks, self.offsets):
            n = len(c.tokens)
            if c.logits == "all":
                sel = list(range(off, off + n))
            elif c.logits == "last":
                sel = [off + n - 1]
            elif isinstance(c.logits, int):
                sel = list(range(off + min(c.logits, n), off + n))
            else:
                sel = []
            slices.append(slice(len(rows), len(rows) + len(sel)))
            rows.extend(sel)
        return torch.tensor(rows, dtype=torch.long), slices


class DecoderModel:
    """Base for decoder-only LMs: embeddings, the per-layer loop and logits. Subclasses implement
    `layer(il, x, batch, cos_sin)` and may override `embed`."""

    spec = None

    def __init__(self, f: GGUFFile, spec):
        self.file = f
        self.spec = spec
        self.w = WeightSet(f)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embd.rows(tokens)
        return x * self.spec.embd_scale if self.spec.embd_scale != 1.0 else x

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        """Run one step over all chunks; returns each chunk's logits [rows, vocab] (float32)."""
        batch = Batch(chunks)
        x = self.embed(batch.tokens)
        self.prepare(batch)
        for il in range(self.spec.n_layer):
            x = self.layer(il, x, batch)
        for c in chunks:
            c.kv.length = c.start + len(c.tokens)
        rows, slices = batch.logit_rows()
        if len(rows) == 0:
            return [x.new_zeros((0, self.spec.vocab_size)) for _ in chunks]
        h = rms_norm(x[rows], self.output_norm.dense, self.spec.rms_eps)
        logits = self.lm_head(h)
        return [logits[s] for s in slices]

    def prepare(self, batch: Batch) -> None:
        """Per-step work shared by all layers (e.g. RoPE tables for the batch's positions)."""

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output.matmul(h)

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
               scale: float, window: int = 0) -> torch.Tensor:
        """Write each chunk's k, v into its KV and attend its queries over everything stored."""
        outs = []
        for c, lo, hi in zip(batch.chunks, batch.offsets[:-1], batch.offsets[1:]):
            k_all, v_all = c.kv.append(il, c.start, k[lo:hi], v[lo:hi])
            outs.append(attention(q[lo:hi], k_all, v_all, c.start, scale, window))
        return torch.cat(outs, dim=0)

    def new_kv(self, dtype: torch.dtype = torch.float16) -> SequenceKV:
        return SequenceKV(self.spec.n_layer, dtype)

    def close(self) -> None:
        self.w = None
        self.file.close()


def default_attn_scale(spec) -> float:
    return spec.attn_scale if spec.attn_scale is not None else 1.0 / math.sqrt(spec.head_dim)
