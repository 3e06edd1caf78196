"""Building blocks shared by the architectures: quantized weights, norms, RoPE, attention,
the per-sequence KV (a paged pool, engine/kv), and the batch of sequence chunks that one forward pass processes.

One forward stacks the rows of every sequence in the step (prefill chunks and decode tokens),
so each weight matrix is read once per step; attention runs per sequence over its own KV.
"""
from __future__ import annotations

import contextvars
import math
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.reader import GGUFError, GGUFFile
from engine.kv import KVPool, SequenceKV  # noqa: F401  (SequenceKV: the per-sequence cache, re-exported)
from kernels import fused
from kernels.attention import causal_attention
from kernels.gdn import gdn_gates
from kernels.gdn.block import GdnShape, conv_rule_rows
from kernels.cpu import rows as cpu_rows
from kernels.kvcodec import cache_type_name
from kernels.quant import (activations_like_llamacpp, block_mins, check_supported, dequantize_rows, dequantized_tiles,
                           matmul_row_invariant, matmul_tiles, quantized_matmul_ref)
from kernels.quant.intdot import INT_TYPES, IntWeight, int_matmul, stack_int_weights

_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
# While the GPU path runs prompt rows (engine/runner/runner.py's prefill): the chunk size, to which matmuls pad
# the rows of their prefill product (kernels/quant/packed.py: matmul_tuned; a small chunk, at most
# SMALL_PROMPT_ROWS, takes the packed kernel instead); 0 for decode rows
PREFILL_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("prefill_rows", default=0)
_POOL_LOCK = threading.Lock()
# whether the CPU path multiplies quantized weights as llama.cpp's CPU backend does, in exact integer block dots
# (kernels/quant/intdot.py); False: activations_like_llamacpp's rounded floats times the dequantized weights in
# float64 (GPU tests set it to compare the GPU kernels with a CPU reference that rounds activations to fp16)
CPU_INT_DOTS = True


class DequantBudget:
    """Bytes of repacked weights (integers and scales, or dequantized float32) the CPU path may keep, process-wide
    (nbytes, 0 = none; by default min(1 GiB, 1/8 of the machine's memory): no setting, docs/decisions/README.md).
    A weight that takes some gives it back when it is freed."""

    def __init__(self, nbytes: int | None = None):
        if nbytes is not None:
            self.left = nbytes
        else:
            from engine.hostmem import physical_memory
            self.left = min(1 << 30, physical_memory() // 8)
        self._lock = threading.Lock()

    def take(self, nbytes: int, owner) -> bool:
        with self._lock:
            if nbytes > self.left:
                return False
            self.left -= nbytes
        weakref.finalize(owner, self._give, nbytes)
        return True

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.left += nbytes


DEQUANT_CACHE = DequantBudget()


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

    gpu = None  # the matrix on the GPU (engine/runner/runner.py): a PackedWeight, or a float tensor for F32/F16/BF16

    @property
    def input_dtype(self) -> torch.dtype | None:
        """The dtype the kernel that makes this matrix's input should write: fp16 when the matrix is packed
        on a CUDA device, else None (as it is). Packed matmuls round x to fp16 before anything else, so a
        producer that rounds instead gives the same bits, and the decode matmul then copies x straight into
        its tensor-core operand instead of converting each tile's x on the way (on the H200, ~14 % of the
        gate+up stack's stall samples are that conversion without it: docs/PERFORMANCE.md)."""
        g = self.gpu
        if g is None or isinstance(g, torch.Tensor) or g.device.type != "cuda":
            return None
        return torch.float16

    def to_device(self, device: torch.device) -> None:
        """Put this tensor on `device` once: vectors as float32, matrices repacked for the GPU
        kernels (kernels/quant/packing.py) or, for float types, as they are."""
        if self.dense is not None:
            self.dense = self.dense.to(device)
            return
        if device.type == "cpu" or self.gpu is not None:
            return
        from kernels.quant.packing import pack_weight
        raw = self.raw.to(device)
        if self.qtype in _FLOAT_TYPES:
            dt = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}[self.qtype]
            self.gpu = raw.view(dt).view(self.n_out, self.n_in)
        else:
            self.gpu = pack_weight(raw, self.qtype, self.n_out, self.n_in)

    def matmul(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, n_in] float32 -> x @ W.T [M, n_out]; with `add` (float32 [M, n_out], e.g. the residual
        stream): add + x @ W.T, on the GPU's decode rows inside the matmul's own kernel (same bits)."""
        if x.is_cuda:
            return self._matmul_gpu(x, add)
        if self.qtype == QT.F32:
            y = matmul_row_invariant(x, self.raw.view(torch.float32).view(self.n_out, self.n_in))
        elif self.qtype in INT_TYPES and CPU_INT_DOTS:
            y = int_matmul(x, self._integers())
        else:
            x, err = activations_like_llamacpp(x, self.qtype)
            tiles = self._expanded()
            if tiles is not None:
                y = matmul_tiles(x, tiles, self.n_out)
            else:
                y = quantized_matmul_ref(x, self.raw, self.qtype, self.n_out, self.n_in)
            if err is not None:   # the minimum times the activation block's sum as llama.cpp stores it
                y = y + matmul_row_invariant(err, self._mins())
        return y if add is None else add + y

    _mins_t = None

    def _mins(self) -> torch.Tensor:
        if self._mins_t is None:
            self._mins_t = block_mins(self.raw, self.qtype, self.n_out, self.n_in)
        return self._mins_t

    _tiles = None       # the matrix dequantized (float32 tiles; F16 / BF16 weights), while the process's budget allows

    def _expanded(self) -> list | None:
        """This matrix dequantized once, if DEQUANT_CACHE has room for it (the float path: F16 / BF16 weights, and
        quantized ones where CPU_INT_DOTS is off). The budget is given back when the weight is freed."""
        if self._tiles is None and self.gpu is None and DEQUANT_CACHE.take(self.n_out * self.n_in * 4, self):
            self._tiles = dequantized_tiles(self.raw, self.qtype, self.n_out, self.n_in)
        return self._tiles

    _ints = None       # the matrix repacked as integers and scales (kernels/quant/intdot.py), while the budget allows

    def _integers(self) -> IntWeight:
        """This matrix as the integer matmul takes it: kept if DEQUANT_CACHE has room (~1.25 bytes a value),
        else repacked for this call alone (the same bits, slower). The budget is given back when the
        weight is freed."""
        if self._ints is not None:
            return self._ints
        w = IntWeight(self.raw, self.qtype, self.n_out, self.n_in)
        if self.gpu is None and DEQUANT_CACHE.take(w.nbytes, self):
            self._ints = w
        return w

    def _matmul_gpu(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if self.gpu is None:
            raise RuntimeError(f"tensor {self.name!r} is not on the GPU (call model.to_device first)")
        if isinstance(self.gpu, torch.Tensor):
            w = self.gpu
            y = (x.to(w.dtype) @ w.T).float()
            return y if add is None else add + y
        from kernels.quant.packed import matmul_tuned
        return matmul_tuned(x, self.gpu, PREFILL_ROWS.get(), add=add)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantize only the given rows (embedding lookup)."""
        if self.gpu is not None and ids.is_cuda:
            if isinstance(self.gpu, torch.Tensor):
                return self.gpu[ids].float()
            from kernels.quant.packed import packed_rows
            # one Triton launch rather than some twenty torch kernels (docs/decisions/embedding-rows-kernel.md)
            return packed_rows(self.gpu, ids)
        row_bytes = self.raw.numel() // self.n_out
        raw_rows = self.raw.view(self.n_out, row_bytes)[ids]
        return dequantize_rows(raw_rows, self.qtype, self.n_in)


class StackedWeights:
    """Matrices that multiply the same input (an FFN's gate and up, attention's Q, K and V, ...). On the
    GPU the packed ones that share a tile layout are stacked once at load time, each part then a view
    of the stack (kernels/quant/packing.py: stack_rows; no extra memory), and decode rows multiply the
    stack in one kernel instead of one per matrix: fewer launches and split-K sums per step, longer
    programs. Prompt rows (cuBLAS on an fp16 copy: the largest copy stays one matrix's, as the memory
    planner counts it) and the CPU keep one product per matrix. A stack's outputs are views of one
    [M, total] result: the last dim is contiguous, the rows strided."""

    def __init__(self, *parts: Weight):
        self.parts = parts
        self.groups: list[tuple[object, list[tuple[int, int]]]] = []   # (stack, [(part index, column)])
        self.single: list[int] = list(range(len(parts)))                # parts multiplied on their own

    def to_device(self, device: torch.device) -> None:
        if device.type != "cuda" or self.groups:
            return
        for w in self.parts:
            w.to_device(device)
        self.stack_packed()

    def stack_packed(self) -> None:
        """Stack the parts whose `gpu` is a PackedWeight, by tile layout (to_device's second half)."""
        from kernels.quant.packing import PackedWeight, stack_key, stack_rows
        by_key: dict[tuple, list[int]] = {}
        for i, w in enumerate(self.parts):
            if isinstance(w.gpu, PackedWeight):
                by_key.setdefault(stack_key(w.gpu), []).append(i)
        for idx in by_key.values():
            if len(idx) < 2:
                continue
            stack, views = stack_rows([self.parts[i].gpu for i in idx])
            cols, col = [], 0
            for i, v in zip(idx, views):
                self.parts[i].gpu = v       # the part's own packed copy is freed here
                cols.append((i, col))
                col += v.n_pad
            self.groups.append((stack, cols))
            self.single = [i for i in self.single if i not in idx]

    def release(self) -> None:
        self.groups, self.single = [], list(range(len(self.parts)))

    @property
    def input_dtype(self) -> torch.dtype | None:
        """fp16 when every part takes it (Weight.input_dtype), else None."""
        dts = {w.input_dtype for w in self.parts}
        return dts.pop() if len(dts) == 1 else None

    def _stacked_rows(self, x: torch.Tensor) -> bool:
        """Whether x's rows take the stacked packed kernel: GPU decode rows or a small prompt chunk (larger
        prompt chunks take _prefill, the CPU each part's own product)."""
        from kernels.quant.packed import small_prompt_rows
        rows = PREFILL_ROWS.get()
        return bool(self.groups) and x.is_cuda and (not rows or small_prompt_rows(rows))

    def matmul(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's x @ W.T, in the parts' order."""
        if not x.is_cuda:
            return self._cpu_matmul(x)
        if self._stacked_rows(x):
            return self.stacked_matmul(x, PREFILL_ROWS.get())
        if not self.groups:
            return [w.matmul(x) for w in self.parts]
        return self._prefill(x)

    def gated(self, x: torch.Tensor, op: str, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """act(x @ gate.T) * (x @ up.T) for a stack of (gate, up), op "silu" (SwiGLU) or "gelu_tanh" (GeGLU),
        as out_dtype. On the GPU's decode rows (and small prompt chunks) the stack's split-K partial sums go
        to the activation unadded: it adds them in slice order, the sums the matmul would make (the same
        bits), and the matmul's slices skip their fence and arrival count (0.5-0.8 ms of a 27B step's
        split-K sums, docs/PERFORMANCE.md)."""
        one_stack = not self.single and [i for i, _ in self.groups[0][1]] == [0, 1] \
            and self.parts[0].n_out == self.parts[1].n_out
        if not (one_stack and self._stacked_rows(x)):
            act = silu_mul if op == "silu" else fused.gelu_tanh_mul
            return act(*self.matmul(x), out_dtype)
        from kernels.quant.packed import matmul_tuned
        (stack, cols), n = self.groups[0], self.parts[0].n_out
        parts = matmul_tuned(x.reshape(-1, x.shape[-1]), stack, PREFILL_ROWS.get(), partials=True)
        y = fused.gated_sum_parts(parts, cols[0][1], cols[1][1], n, op, out_dtype)
        return y.view(*x.shape[:-1], n)

    def _cpu_matmul(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The CPU's products: the integer-dot parts of one type stacked into one IntWeight, made once within
        DEQUANT_CACHE's budget (kernels/quant/intdot.py: stack_int_weights; each part's columns are its own product,
        the same bits, for one activation rounding and one kernel call instead of one per part); the rest alone."""
        plan = self.__dict__.get("_cpu_plan")
        if plan is None:
            plan = self._cpu_plan = self._plan_cpu()
        out: list = [None] * len(self.parts)
        for stack, cols in plan:
            y = int_matmul(x, stack)
            for i, c in cols:
                out[i] = y[:, c:c + self.parts[i].n_out]
        for i, w in enumerate(self.parts):
            if out[i] is None:
                out[i] = w.matmul(x)
        return out

    def _plan_cpu(self) -> list[tuple[IntWeight, list[tuple[int, int]]]]:
        by_key: dict[tuple, list[int]] = {}
        if CPU_INT_DOTS:
            for i, w in enumerate(self.parts):
                if w.qtype in INT_TYPES and w.gpu is None:
                    by_key.setdefault((w.qtype, w.n_in), []).append(i)
        plan = []
        for idx in by_key.values():
            if len(idx) < 2:
                continue
            stack, cols = stack_int_weights([IntWeight(self.parts[i].raw, self.parts[i].qtype, self.parts[i].n_out,
                                                       self.parts[i].n_in) for i in idx])
            if DEQUANT_CACHE.take(stack.nbytes, self):
                plan.append((stack, list(zip(idx, cols))))
        return plan

    def _prefill(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Prompt rows: one cuBLAS product per part, their fp16 operand made once (the same bits as apart)."""
        from kernels.quant.packed import PREFILL_CUBLAS, prefill_matmul, prefill_rows
        from kernels.quant.packing import PackedWeight
        if not PREFILL_CUBLAS:
            return [w.matmul(x) for w in self.parts]
        pad = PREFILL_ROWS.get()
        rows16 = prefill_rows(x, self.parts[0].n_in, pad)
        return [prefill_matmul(x, w.gpu, pad, rows16=rows16) if isinstance(w.gpu, PackedWeight) else w.matmul(x)
                for w in self.parts]

    def stacked_matmul(self, x: torch.Tensor, prefill: int = 0) -> list[torch.Tensor]:
        """matmul's decode-row path (and a small prompt chunk's, prefill its padded rows): one product per
        stack (on the CPU: Triton's interpreter, for tests)."""
        from kernels.quant.packed import matmul_tuned
        out: list = [None] * len(self.parts)
        for stack, cols in self.groups:
            y = matmul_tuned(x, stack, prefill)
            for i, c in cols:
                out[i] = y[..., c:c + self.parts[i].n_out]
        for i in self.single:
            out[i] = self.parts[i].matmul(x)
        return out


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


# Elementwise ops live in kernels/fused.py: its torch references on the CPU (the formulas this code
# always used), its fused Triton kernels on the GPU (one launch each instead of several, which matters
# inside a decode step's CUDA graph).

def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out_dtype: the result rounded to it (a matmul's `input_dtype`), else x's dtype."""
    if not x.is_cuda:   # numba (kernels/cpu/rows.py: the reference's bits), or fused.ref_rms_norm without it
        return cpu_rows.rms_norm(x, w, eps, out_dtype)
    if x.ndim not in (2, 3):
        return fused.ref_rms_norm(x, w, eps, out_dtype)
    if x.ndim == 2:
        return fused.rms_norm(x, w, eps, out_dtype)
    y = fused.head_rms_norm(x, w, eps)
    return y if out_dtype is None else y.to(out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up: on the CPU kernels/cpu/rows.py's numba kernel (the reference's bits, or fused.ref_silu_mul
    without numba), on the GPU fused's Triton kernel."""
    if not gate.is_cuda:
        return cpu_rows.silu_mul(gate, up, out_dtype)
    return fused.silu_mul(gate, up, out_dtype)


gelu_tanh_mul = fused.gelu_tanh_mul
sigmoid_mul = fused.sigmoid_gate_mul   # a * sigmoid(gate), gate reshaped to a's shape


def head_rms_norm_silu(x: torch.Tensor, w: torch.Tensor | None, eps: float, gate: torch.Tensor,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * RMSNorm(x) per head, x and gate [N, H, D]: one launch on the GPU
    (docs/decisions/fused-head-kernels.md)."""
    if x.is_cuda:
        return fused.head_rms_norm_silu(x, w, eps, gate, out_dtype)
    return silu_mul(gate, rms_norm(x, w, eps), out_dtype)


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

    def to_device(self, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        theta = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        return theta.cos().float(), theta.sin().float()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H, D]; cos/sin [N, dim/2]."""
        return fused.rope(x, cos, sin, self.dim, self.neox)


@dataclass
class HeadPrep:
    """What an attention layer does to its q and k heads before attending: an RMSNorm per head (weights
    q_norm / k_norm; None: no norm), then `rope` with the step's (cos, sin). `apply` does it; a GPU decode
    step does it inside the kernel that writes K and V (engine/runner/attention.py)."""

    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    rope: Rope
    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not q.is_cuda:   # one numba call each (kernels/cpu/rows.py: ref_qk_norm_rope's bits)
            r = self.rope
            return (cpu_rows.qk_norm_rope(q, self.q_norm, self.eps, self.cos, self.sin, r.dim, r.neox),
                    cpu_rows.qk_norm_rope(k, self.k_norm, self.eps, self.cos, self.sin, r.dim, r.neox))
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        return self.rope.apply(q, self.cos, self.sin), self.rope.apply(k, self.cos, self.sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
              window: int = 0, k_start: int = 0, bidirectional: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] (positions q_start..q_start+T) over k, v [S, Hkv, D]
    (positions k_start..k_start+S). GQA: each KV head serves H/Hkv query heads. window > 0: a query
    at p sees keys at p' with p - p' < window (llama.cpp's standard sliding window). bidirectional:
    position spans whose tokens see each other both ways (Gemma 3 images)."""
    return causal_attention(q, k, v, q_start, scale, window, k_start, bidirectional)


@dataclass
class SeqChunk:
    """One sequence's rows in a forward pass: `tokens` at positions start..start+n."""

    tokens: torch.Tensor          # long [n]
    start: int
    kv: SequenceKV
    logits: str | int = "last"    # "last", "all", "none", or an int k: rows k.. of this chunk
    positions: torch.Tensor | None = None  # RoPE positions if not start..start+n: [n], or [n, 3] (M-RoPE t,h,w)
    # image input (engine/vision): rows whose input is not the token embedding: (row indices within
    # this chunk [k], float rows [k, n_embd]) replacing them after any embedding scale
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # position spans [lo, hi) inside this chunk whose tokens attend to each other both ways (Gemma 3 images)
    bidirectional: list[tuple[int, int]] | None = None
    # attend one row at a time, exactly as single-token decode steps would (draft verification: the
    # accepted tokens must get the numbers decoding without drafts gives them)
    rowwise: bool = False
    # out: this chunk's hidden states at the model's `capture_layers` (DFlash drafting), set by forward
    features: torch.Tensor | None = None


@dataclass
class Batch:
    chunks: list[SeqChunk]
    positions: torch.Tensor = field(init=False)
    offsets: list[int] = field(init=False)
    rope: dict = field(init=False, default_factory=dict)  # cos/sin tables, filled by the model's prepare()
    rope_positions = None  # and (M-RoPE models) the RoPE positions where they are not `positions`

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

    # Where the rows' KV and recurrent state live: here each chunk's SequenceKV. A runner step's SlotBatch
    # (engine/runner/batch.py) answers the same three calls from the runner's slots.
    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int = 0) -> torch.Tensor:
        """Write each chunk's k, v into its KV and attend its queries over everything stored."""
        outs = []
        for c, lo, hi in zip(self.chunks, self.offsets[:-1], self.offsets[1:]):
            if c.rowwise:
                for r in range(lo, hi):
                    outs.append(c.kv.attend(il, q[r:r + 1], k[r:r + 1], v[r:r + 1], c.start + r - lo, scale, window,
                                            window_from=c.start))
            else:
                outs.append(c.kv.attend(il, q[lo:hi], k[lo:hi], v[lo:hi], c.start, scale, window, c.bidirectional))
        return torch.cat(outs, dim=0)

    def attend_prepared(self, il, q, k, v, prep, scale, window, gate=None, out_dtype=None) -> None:
        """A shortcut that preps and attends in one kernel: none for sequences (DecoderModel.attend_heads)."""
        return None

    def delta_net(self, il: int, shape: GdnShape, L: dict, qkv: torch.Tensor, alpha_x: torch.Tensor,
                  beta_x: torch.Tensor) -> torch.Tensor:
        """A Gated DeltaNet layer's rows (qwen35) from the raw projections, each chunk from its sequence's
        recurrent state, which it updates; a rowwise chunk (draft verification) runs one row at a time as
        decode does and keeps the state after each row for the rollback."""
        g, beta = gdn_gates(alpha_x, beta_x, L["dt"].dense, L["a"].dense)   # [n, Hv]: log decay <= 0, beta
        outs = []
        for c, lo, hi in zip(self.chunks, self.offsets[:-1], self.offsets[1:]):
            state = c.kv.recurrent.get(il)
            if c.rowwise:
                row_states = []
                for r in range(lo, hi):
                    o, state = conv_rule_rows(shape, L["conv"], qkv[r:r + 1], g[r:r + 1], beta[r:r + 1], state)
                    row_states.append(state)
                    outs.append(o)
                c.kv.row_states[il] = row_states
            else:
                o, state = conv_rule_rows(shape, L["conv"], qkv[lo:hi], g[lo:hi], beta[lo:hi], state)
                outs.append(o)
            c.kv.recurrent[il] = state
        return torch.cat(outs, dim=0)

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
        self.stacks: list[StackedWeights] = []

    def stack(self, *parts: Weight) -> StackedWeights:
        """Matrices with the same input, multiplied together on the GPU's decode rows (StackedWeights)."""
        s = StackedWeights(*parts)
        self.stacks.append(s)
        return s

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embd.rows(tokens)
        return x * self.spec.embd_scale if self.spec.embd_scale != 1.0 else x

    def embed_batch(self, batch: Batch) -> torch.Tensor:
        """Token embeddings of all rows, with each chunk's `embeds` rows (image embeddings) put in
        place of theirs (not scaled: Gemma scales token embeddings only)."""
        x = self.embed(batch.tokens)
        for c, off in zip(batch.chunks, batch.offsets):
            if c.embeds is not None:
                rows, vals = c.embeds
                x[off + rows] = vals.to(device=x.device, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        """Run one step over all chunks; returns each chunk's logits [rows, vocab] (float32)."""
        batch = Batch(chunks)
        x = self.embed_batch(batch)
        self.prepare(batch)
        taken = {}
        for il in range(self.spec.n_layer):
            x = self.layer(il, x, batch)
            if il in self.capture_layers:
                taken[il] = x
        if taken:
            self.keep_features(batch, taken)
        for c in chunks:
            c.kv.length = c.start + len(c.tokens)
        rows, slices = batch.logit_rows()
        if len(rows) == 0:
            return [x.new_zeros((0, self.spec.vocab_size)) for _ in chunks]
        h = rms_norm(x[rows], self.output_norm.dense, self.spec.rms_eps)
        logits = self.lm_head(h)
        return [logits[s] for s in slices]

    # Layers whose output the forward keeps for a DFlash drafter (engine/spec/dflash.py); empty unless a
    # drafter is attached, so the check in the layer loop is all it costs otherwise.
    capture_layers: tuple[int, ...] = ()

    def keep_features(self, batch: Batch, taken: dict[int, torch.Tensor]) -> None:
        """Give each chunk its rows of the hidden states after `capture_layers`, concatenated in that
        order: [n, len(capture_layers) * n_embd]. These are HF's hidden_states[il + 1] (the residual
        stream after layer il), which for the last layer is the output-normed final state."""
        feats = self.features_of(taken)
        for c, lo, hi in zip(batch.chunks, batch.offsets[:-1], batch.offsets[1:]):
            c.features = feats[lo:hi]

    def features_of(self, taken: dict[int, torch.Tensor]) -> torch.Tensor:
        """The rows' hidden states after `capture_layers` (taken: layer -> rows), concatenated in that order,
        the last layer's output-normed (keep_features; the GPU path's Runner uses it too)."""
        last = self.spec.n_layer - 1
        return torch.cat([rms_norm(taken[il], self.output_norm.dense, self.spec.rms_eps) if il == last
                          else taken[il] for il in self.capture_layers], dim=-1)

    def prepare(self, batch: Batch) -> None:
        """Per-step work shared by all layers (e.g. RoPE tables for the batch's positions)."""

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output.matmul(h)

    def attend_heads(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
                     prep: HeadPrep, scale: float, window: int = 0, gate: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """attend() for q and k as the projection made them: `prep` (their norms and rope) first. gate
        [n, H, Dv]: the output times sigmoid(gate) (Qwen3.5's gated attention), in out_dtype."""
        out = batch.attend_prepared(il, q, k, v, prep, scale, window, gate, out_dtype)
        if out is not None:
            return out
        q, k = prep.apply(q, k)
        a = batch.attend(il, q, k, v, scale, window)
        return a if gate is None else sigmoid_mul(a, gate, out_dtype)

    # ----- KV cache -----
    cache_type_k = "f16"   # llama.cpp's default cache type
    cache_type_v = "f16"
    kv_block_size = 16

    def set_cache_types(self, cache_type_k: str | None = None, cache_type_v: str | None = None) -> None:
        """The cache types new sequences get (llama.cpp's --cache-type-k / --cache-type-v names)."""
        if cache_type_k is not None:
            self.cache_type_k = cache_type_name(cache_type_k)
        if cache_type_v is not None:
            self.cache_type_v = cache_type_name(cache_type_v)

    def kv_pool(self, cache_type_k: str | None = None, cache_type_v: str | None = None) -> KVPool:
        """The model's paged pool for these cache types (one per pair, made on first use, grows on demand)."""
        kt = cache_type_name(cache_type_k or self.cache_type_k)
        vt = cache_type_name(cache_type_v or self.cache_type_v)
        with _POOL_LOCK:  # new_kv may be called from the threads that submit requests
            pools = self.__dict__.setdefault("_kv_pools", {})
            pool = pools.get((kt, vt))
            if pool is None:
                pool = pools[(kt, vt)] = KVPool.for_model(self.spec, kt, vt, rope=self.kv_rope,
                                                          block_size=self.kv_block_size)
            return pool

    def kv_rope(self, il: int):
        """(rope_dim, neox, inv_freq) of layer il's keys, for the KV cache's key preconditioning."""
        rope = getattr(self, "rope", None)
        if rope is None:
            return None
        return rope.dim, getattr(rope, "neox", True), rope.inv_freq

    def new_kv(self, dtype: torch.dtype | None = None, cache_type_k: str | None = None,
               cache_type_v: str | None = None) -> SequenceKV:
        """A new sequence's cache in the model's pool: the model's cache types, or `dtype` (a float
        type, e.g. torch.float32 for exact comparisons) for both K and V, or the given types."""
        if dtype is not None:
            cache_type_k = cache_type_v = cache_type_name(dtype)
        return SequenceKV(self.spec.n_layer, pool=self.kv_pool(cache_type_k, cache_type_v))

    # ----- device -----
    device = torch.device("cpu")

    def to_device(self, device) -> None:
        """Move the model to `device` once (weights repacked for the GPU kernels; engine/runner/runner.py
        runs it there). The CPU copy of the weights stays the memory-mapped file."""
        device = torch.device(device)
        for st in self.stacks:      # first, a stack at a time: each stack's parts are packed, stacked and
            st.to_device(device)    # freed before the next, whose parts reuse their memory
        for w in self.w._cache.values():
            w.to_device(device)
        for layer in list(getattr(self, "layers", [])) + [getattr(self, "mtp", None) or {}]:
            for key, val in layer.items():
                if isinstance(val, torch.Tensor):
                    layer[key] = val.to(device)
        for rope in self.__dict__.values():
            if isinstance(rope, Rope):
                rope.to_device(device)
        self.device = device

    def release_device(self) -> None:
        """Drop the weights' packed device copies (the model must not run on the device after this)."""
        for w in self.w._cache.values() if self.w is not None else ():
            w.gpu = None
        for st in self.stacks:
            st.release()

    def close(self) -> None:
        self.w = None
        self.file.close()


def default_attn_scale(spec) -> float:
    return spec.attn_scale if spec.attn_scale is not None else 1.0 / math.sqrt(spec.head_dim)
