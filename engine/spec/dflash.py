"""DFlash drafting: a block-diffusion drafter (z-lab, arXiv 2602.06036) proposes a whole block of
tokens in one forward pass, conditioned on the target model's own hidden states.

The drafter (as z-lab's `DFlashDraftModel`) is a stack of Qwen3-style layers with no embedding or LM
head of its own:
- Context: the target's hidden states after the layers `target_layer_ids` (HF's hidden_states[id + 1];
  the target forward keeps them when `model.capture_layers` is set, engine/models/common.py) are
  concatenated per position and projected, ctx = hidden_norm(fc(h)). In every drafter layer the
  context becomes extra keys and values, K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx), at the
  context's own positions: no input_layernorm, and the same ctx rows feed every layer.
- Block: the last accepted token and block_size - 1 mask tokens at positions p..p+B-1, embedded with
  the target's embedding table. Each layer: input_layernorm -> Q (q_norm, rope) from the block only,
  K/V = [context ; block] -> attention, non-causal within the block unless the config says causal
  (z-lab: layers marked sliding_attention are causal when `is_causal` is not given), with a
  sliding window on sliding layers -> o_proj, residual -> post_attention_layernorm -> SwiGLU MLP,
  residual. A final `norm`, then the target's LM head: block row i (i >= 1) gives the distribution
  of the token at position p + i, the i-th draft.
- Per sequence the drafter keeps only the context K/V (`DFlashState`): the rows of positions whose
  target hidden states are final (prompt and accepted tokens). Mask rows and drafts are never
  stored; after each target step the newly accepted positions are appended.

Drafts are the argmax (greedy requests) or sampled from the drafter's distribution q under the
request's own sampler settings; `state.q` keeps q for the verifier (engine/spec/verify.py:
accept with min(1, p/q), resample the first rejection from normalize(max(p - q, 0))).

Loading: a directory laid out like z-lab's releases (config.json with `dflash_config` and
model.safetensors, read here without the safetensors package), or the GGUF port described in
docs/ARCHITECTURE.md (general.architecture = "dflash"). `DFlashDrafter.check_target` refuses a
drafter made for another model (hidden size, vocabulary, target_layer_ids).
"""
from __future__ import annotations

import json
import math
import struct
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.common import Rope, rms_norm, silu_mul
from engine.spec.verify import draw_from


class DFlashError(ValueError):
    """A DFlash drafter cannot be loaded or does not fit the target model."""


# ------------------------------------------------------------------------------------------------
# configuration

@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding: tuple[bool, ...]                 # per layer: sliding-window attention (else full)
    causal: tuple[bool, ...]                  # per layer: causal within the block
    sliding_window: int = 0                   # 0: no window
    vocab_size: int | None = None             # the target vocabulary it was trained with, when stated
    num_target_layers: int | None = None      # the target's layer count, when stated
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, cfg: dict, source: str) -> DFlashConfig:
        """From a z-lab config.json (a Qwen3Config plus `dflash_config`)."""
        dc = cfg.get("dflash_config") or {}
        if "DFlash2DraftModel" in (cfg.get("architectures") or []) or "selector_rank" in dc:
            raise DFlashError(f"{source}: DFlash2 drafters (conv + candidate selector) are not supported")

        def need(name):
            val = dc.get(name, cfg.get(name))
            if val is None:
                raise DFlashError(f"{source}: config.json has no {name!r}")
            return val

        def opt(name, default=None):
            val = dc.get(name, cfg.get(name))
            return default if val is None else val

        n_layer = int(need("num_hidden_layers"))
        n_head = int(need("num_attention_heads"))
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise DFlashError(f"{source}: rope type {rope_type!r} is not supported (only default RoPE)")
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        types = cfg.get("layer_types")
        if not types:   # Qwen3Config's default: sliding from max_window_layers on when use_sliding_window
            first = cfg.get("max_window_layers", n_layer) if cfg.get("use_sliding_window") else n_layer
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
        if len(types) != n_layer:
            raise DFlashError(f"{source}: {len(types)} layer_types for {n_layer} layers")
        sliding = tuple(t == "sliding_attention" for t in types)
        is_causal = cfg.get("is_causal")
        causal = tuple(bool(is_causal) if is_causal is not None else sl for sl in sliding)
        window = int(cfg.get("sliding_window") or 0) if any(sliding) else 0
        softcap = opt("final_logit_softcapping")
        return cls(
            hidden_size=int(need("hidden_size")), n_layer=n_layer, n_head=n_head,
            n_head_kv=int(opt("num_key_value_heads", n_head)),
            head_dim=int(opt("head_dim", int(need("hidden_size")) // n_head)),
            n_ff=int(need("intermediate_size")), rms_eps=float(opt("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            block_size=int(opt("block_size", 16)), mask_token_id=int(need("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in need("target_layer_ids")), sliding=sliding, causal=causal,
            sliding_window=window, vocab_size=opt("vocab_size"), num_target_layers=opt("num_target_layers"),
            input_embedding_scale=float(opt("input_embedding_scale", 1.0)),
            output_multiplier=float(opt("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    @classmethod
    def from_gguf(cls, md: dict, source: str) -> DFlashConfig:
        """From the GGUF port's metadata (keys `dflash.*`, docs/ARCHITECTURE.md)."""
        arch = md.get("general.architecture")
        if arch != "dflash":
            raise DFlashError(f"{source}: general.architecture is {arch!r}, not 'dflash': not a DFlash drafter")

        def get(key, default=None, required=False):
            val = md.get(f"dflash.{key}")
            if val is None and required:
                raise DFlashError(f"{source}: no dflash.{key} in the GGUF metadata")
            return default if val is None else val

        n_layer = int(get("block_count", required=True))
        n_head = int(get("attention.head_count", required=True))
        E = int(get("embedding_length", required=True))
        mask = get("mask_token_id", md.get("tokenizer.ggml.mask_token_id"))
        if mask is None:
            raise DFlashError(f"{source}: no dflash.mask_token_id in the GGUF metadata")
        pattern = get("attention.sliding_window_pattern")
        sliding = tuple(bool(b) for b in pattern) if pattern is not None else (False,) * n_layer
        if len(sliding) != n_layer:
            raise DFlashError(f"{source}: dflash.attention.sliding_window_pattern has {len(sliding)} entries "
                              f"for {n_layer} layers")
        is_causal = get("attention.causal")
        causal = tuple(bool(is_causal) if is_causal is not None else sl for sl in sliding)
        softcap = get("final_logit_softcapping")
        return cls(
            hidden_size=E, n_layer=n_layer, n_head=n_head, n_head_kv=int(get("attention.head_count_kv", n_head)),
            head_dim=int(get("attention.key_length", E // n_head)), n_ff=int(get("feed_forward_length", required=True)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            block_size=int(get("block_size", 16)), mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in get("target_layer_ids", required=True)), sliding=sliding,
            causal=causal, sliding_window=int(get("attention.sliding_window", 0)) if any(sliding) else 0,
            vocab_size=get("vocab_size"), num_target_layers=get("num_target_layers"),
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            output_multiplier=float(get("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )


# ------------------------------------------------------------------------------------------------
# reading weights

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a .safetensors file as float32: an 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}} and the data (offsets relative to its start)."""
    path = Path(path)
    if path.stat().st_size < 8:
        raise DFlashError(f"{path}: too short for a safetensors file")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        n = struct.unpack("<Q", bytes(raw[:8]))[0]
        if n > raw.shape[0] - 8:
            raise DFlashError(f"{path}: damaged safetensors header (claims {n} bytes)")
        try:
            header = json.loads(bytes(raw[8:8 + n]))
        except ValueError as e:
            raise DFlashError(f"{path}: damaged safetensors header ({e})") from None
        header.pop("__metadata__", None)
        base, out = 8 + n, {}
        for name, info in header.items():
            dt = _ST_DTYPES.get(info.get("dtype"))
            if dt is None:
                raise DFlashError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r} (F32, F16, BF16 or F64)")
            lo, hi = info["data_offsets"]
            shape = tuple(info["shape"])
            if not 0 <= lo <= hi <= raw.shape[0] - base or hi - lo != math.prod(shape) * dt.itemsize:
                raise DFlashError(f"{path}: tensor {name!r} has bad data offsets {lo}..{hi}")
            buf = torch.from_numpy(np.array(raw[base + lo:base + hi]))
            out[name] = buf.view(dt).reshape(shape).float()
        return out
    finally:
        del raw


def _read_dir(path: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DFlashError(f"{path}: no config.json (a DFlash drafter directory holds config.json and "
                          "model.safetensors)")
    cfg = DFlashConfig.from_hf(json.loads(cfg_path.read_text()), str(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{path}: no .safetensors file")
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(f))
    # z-lab names the tensors as the module does (fc.weight, layers.0.self_attn.q_proj.weight, ...)
    return cfg, {n.removeprefix("model."): t for n, t in tensors.items()}


# GGUF port: llama.cpp-style names -> z-lab (HF) names
_GGUF_TOP = {"dflash_fc.weight": "fc.weight", "fc.weight": "fc.weight",
             "dflash_hidden_norm.weight": "hidden_norm.weight", "hidden_norm.weight": "hidden_norm.weight",
             "output_norm.weight": "norm.weight"}
_GGUF_BLK = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}


def gguf_to_hf_name(name: str) -> str | None:
    """The z-lab name of a GGUF port tensor, None when it is not one."""
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_BLK:
        return f"layers.{parts[1]}.{_GGUF_BLK[parts[2]]}.{parts[3]}"
    return None


def _read_gguf(path: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    from engine.gguf.reader import GGUFFile
    from kernels.quant import dequantize_rows
    f = GGUFFile(path)
    try:
        cfg = DFlashConfig.from_gguf(f.metadata, str(path))
        tensors = {}
        for name, info in f.tensors.items():
            hf = gguf_to_hf_name(name)
            if hf is None:
                raise DFlashError(f"{path}: tensor {name!r} is not part of a DFlash drafter")
            raw = torch.from_numpy(np.array(f.tensor_bytes(name)))
            n_rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
            tensors[hf] = dequantize_rows(raw.view(n_rows, -1), info.qtype, info.shape[-1]).reshape(info.shape)
        return cfg, tensors
    finally:
        f.close()


def load_drafter(path: str | Path) -> DFlashDrafter:
    """A DFlash drafter from a z-lab-style directory (config.json + *.safetensors) or a GGUF port."""
    path = Path(path)
    if path.is_dir():
        cfg, tensors = _read_dir(path)
    elif path.is_file() and path.suffix == ".safetensors":
        cfg, tensors = _read_dir(path.parent)
    elif path.is_file():
        cfg, tensors = _read_gguf(path)
    else:
        raise DFlashError(f"{path}: no such drafter (a directory with config.json + model.safetensors, or a GGUF)")
    return DFlashDrafter(cfg, tensors, str(path))


# ------------------------------------------------------------------------------------------------
# the drafter

class _Rows:
    """A tensor growing along its first dim; capacity doubles, so appending a few rows per step is cheap."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.shape[0]
        if self.buf is None or need > self.buf.shape[0]:
            cap = max(need, 2 * (self.buf.shape[0] if self.buf is not None else 0), 64)
            grown = rows.new_empty((cap, *rows.shape[1:]))
            if self.buf is not None:
                grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n:need] = rows
        self.n = need

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        return self.buf[lo:hi]


class DFlashState:
    """One sequence's drafter context: per layer the K (k_norm'ed, roped) and V of the projected target
    hidden states of positions 0..length-1 (prompt and accepted tokens only), and the latest drafts:
    `drafts` follow the token at `position`, `q` [len(drafts), V] their distributions (None: greedy)."""

    def __init__(self, n_layer: int):
        self.keys = [_Rows() for _ in range(n_layer)]
        self.values = [_Rows() for _ in range(n_layer)]
        self.length = 0
        self.drafts: list[int] = []
        self.q: torch.Tensor | None = None
        self.position = -1
        self.deferred: torch.Tensor | None = None   # features of positions length.. not yet appended (the
        # engine puts the context off while drafting is backed off, engine/spec/adaptive.py)

    def resume_at(self, n: int) -> bool:
        """Keep the context of positions < n for a follow-up request whose target KV holds exactly those
        (a context row depends on its own position's target states only); False when positions below n
        are neither in the context nor held back (the caller drops the state)."""
        held = 0 if self.deferred is None else self.deferred.shape[0]
        if self.length + held < n:
            return False
        if self.length >= n:
            for rows in self.keys + self.values:
                rows.n = min(rows.n, n)
            self.length, self.deferred = n, None
        else:
            self.deferred = self.deferred[:n - self.length]
        self.drafts, self.q, self.position = [], None, -1
        return True

    def fork(self, n: int) -> "DFlashState | None":
        """A new state with a copy of this context's positions < n (another conversation with the same
        first n tokens: the same target states, so the same rows), or None when they are not all here."""
        held = 0 if self.deferred is None else self.deferred.shape[0]
        if self.length + held < n:
            return None
        other = DFlashState(len(self.keys))
        keep = min(n, self.length)
        for src, dst in zip(self.keys + self.values, other.keys + other.values):
            if keep:
                dst.append(src.rows(0, keep).clone())
        other.length = keep
        if keep < n:
            other.deferred = self.deferred[:n - keep].clone()
        return other


class _Tensors:
    """Takes the drafter's tensors by name with shape checks; what is left over is an error."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str):
        self.left, self.source = dict(tensors), source

    def take(self, name: str, shape: tuple[int, ...] | None = None, optional: bool = False) -> torch.Tensor | None:
        t = self.left.pop(name, None)
        if t is None:
            if optional:
                return None
            raise DFlashError(f"{self.source}: missing tensor {name!r}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise DFlashError(f"{self.source}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t.float().contiguous()

    def check_used(self) -> None:
        if self.left:
            names = sorted(self.left)
            raise DFlashError(f"{self.source}: tensors this DFlash loader does not know: {names[:6]}"
                              + (" ..." if len(names) > 6 else ""))


class DFlashDrafter:
    """The drafter's weights (float32; bfloat16 on a GPU: `to_device`) and its forward passes; the target
    model supplies embeddings, the LM head and the context features."""

    def __init__(self, cfg: DFlashConfig, tensors: dict[str, torch.Tensor], source: str):
        self.cfg, self.source = cfg, source
        self.device = torch.device("cpu")
        c = cfg
        if not c.target_layer_ids:
            raise DFlashError(f"{source}: target_layer_ids is empty")
        if c.block_size < 2:
            raise DFlashError(f"{source}: block_size {c.block_size} drafts nothing")
        if c.n_head % c.n_head_kv:
            raise DFlashError(f"{source}: {c.n_head} attention heads are not a multiple of {c.n_head_kv} KV heads")
        E, D = c.hidden_size, c.head_dim
        w = _Tensors(tensors, source)
        self.fc = w.take("fc.weight")
        n_feat = len(c.target_layer_ids)
        if self.fc.ndim != 2 or self.fc.shape[0] != E or self.fc.shape[1] % n_feat:
            raise DFlashError(f"{source}: fc.weight has shape {tuple(self.fc.shape)}, expected "
                              f"({E}, {n_feat} x the target's hidden size) for {n_feat} target layers")
        self.target_hidden_size = self.fc.shape[1] // n_feat
        self.hidden_norm = w.take("hidden_norm.weight", (E,))
        self.norm = w.take("norm.weight", (E,))
        qd, kvd = c.n_head * D, c.n_head_kv * D
        self.layers = []
        for il in range(c.n_layer):
            p = f"layers.{il}."
            L = dict(input_norm=w.take(p + "input_layernorm.weight", (E,)),
                     post_norm=w.take(p + "post_attention_layernorm.weight", (E,)),
                     q_norm=w.take(p + "self_attn.q_norm.weight", (D,)),
                     k_norm=w.take(p + "self_attn.k_norm.weight", (D,)),
                     gate=w.take(p + "mlp.gate_proj.weight", (c.n_ff, E)),
                     up=w.take(p + "mlp.up_proj.weight", (c.n_ff, E)),
                     down=w.take(p + "mlp.down_proj.weight", (E, c.n_ff)))
            for name, shape in (("q", (qd, E)), ("k", (kvd, E)), ("v", (kvd, E)), ("o", (E, qd))):
                L[name] = w.take(f"{p}self_attn.{name}_proj.weight", shape)
                L[name + "_bias"] = w.take(f"{p}self_attn.{name}_proj.bias", shape[:1], optional=True)
            self.layers.append(L)
        w.check_used()
        self.rope = Rope(D, c.rope_theta, neox=True)   # Qwen3 rotate_half: pairs (i, i + D/2)

    # ----- fitting a target -----
    def check_target(self, model) -> None:
        """Raise DFlashError unless this drafter was made for `model` (shapes and layer ids)."""
        self.check_spec(model.spec)

    def check_spec(self, s) -> None:
        """check_target on what it reads of a model: s.n_embd, s.n_layer (without MTP blocks), s.vocab_size
        (a ModelSpec, or the planner's ModelFacts of a file not loaded)."""
        c, src = self.cfg, self.source
        if c.hidden_size != s.n_embd:
            raise DFlashError(f"{src}: the drafter's hidden size {c.hidden_size} differs from the target's "
                              f"{s.n_embd}: it was made for another model")
        if self.target_hidden_size != s.n_embd:
            raise DFlashError(f"{src}: the drafter projects target hidden states of size {self.target_hidden_size}, "
                              f"the target's are {s.n_embd}: it was made for another model")
        bad = [i for i in c.target_layer_ids if not 0 <= i < s.n_layer]
        if bad:
            raise DFlashError(f"{src}: target_layer_ids {bad} are out of range: the target has {s.n_layer} layers")
        if c.num_target_layers is not None and int(c.num_target_layers) != s.n_layer:
            raise DFlashError(f"{src}: the drafter was made for a target with {c.num_target_layers} layers, "
                              f"this one has {s.n_layer}")
        if c.vocab_size is not None and int(c.vocab_size) != s.vocab_size:
            raise DFlashError(f"{src}: the drafter's vocabulary has {c.vocab_size} tokens, the target's "
                              f"{s.vocab_size}: it was made for another model")
        if not 0 <= c.mask_token_id < s.vocab_size:
            raise DFlashError(f"{src}: mask_token_id {c.mask_token_id} is outside the target's vocabulary "
                              f"({s.vocab_size} tokens)")

    def new_state(self) -> DFlashState:
        return DFlashState(self.cfg.n_layer)

    def to_device(self, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
        """Put the weights on `device` as `dtype` (the GPU path: half the bytes of float32, tensor-core
        products); activations stay float32 between the products, the context K/V is kept as `dtype`."""
        self.device = torch.device(device)
        self.fc = self.fc.to(device, dtype)
        self.hidden_norm, self.norm = self.hidden_norm.to(device), self.norm.to(device)
        for L in self.layers:
            for name, t in L.items():
                if t is not None:
                    L[name] = t.to(device, dtype if t.ndim == 2 else torch.float32)
        self.rope.to_device(self.device)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def device_weight_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """weight_bytes() once to_device(.., dtype) has run: the matrices as dtype, the rest float32 (the
        memory planner counts a drafter without moving it)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(t.numel() * (size if t.ndim == 2 else 4) for t in self._tensors())

    def context_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes a sequence's context K and V take per position (all layers) when kept as `dtype`."""
        c = self.cfg
        return c.n_layer * 2 * c.n_head_kv * c.head_dim * torch.empty(0, dtype=dtype).element_size()

    def _tensors(self):
        yield from (self.fc, self.hidden_norm, self.norm)
        for L in self.layers:
            yield from (t for t in L.values() if t is not None)

    # ----- building blocks -----
    @staticmethod
    def _mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ b) in w's dtype, back as float32 (a no-op cast on the CPU's float32 weights)."""
        return F.linear(x.to(w.dtype), w, None if b is None else b.to(w.dtype)).float()

    @classmethod
    def _lin(cls, x: torch.Tensor, L: dict, name: str) -> torch.Tensor:
        return cls._mm(x, L[name], L.get(name + "_bias"))

    def _heads(self, x: torch.Tensor, L: dict, name: str, n_heads: int, cos, sin) -> torch.Tensor:
        """Projection `name` (q or k) split into heads, per-head RMSNorm, rope."""
        t = self._lin(x, L, name).view(x.shape[0], n_heads, self.cfg.head_dim)
        t = rms_norm(t, L[name + "_norm"], self.cfg.rms_eps)
        return self.rope.apply(t, cos, sin)

    def _attend(self, il: int, st: DFlashState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The block's queries q [B, H, D] over [context ; block] keys (block k, v [B, Hkv, D])."""
        c = self.cfg
        start, B = st.length, q.shape[0]
        window = c.sliding_window if c.sliding[il] else 0
        lo = max(0, start - window + 1) if window else 0       # older context rows are outside every window
        keys = torch.cat([st.keys[il].rows(lo, start).float(), k]) if start > lo else k
        vals = torch.cat([st.values[il].rows(lo, start).float(), v]) if start > lo else v
        dev = q.device   # (the mask made where it is used: no copy to the device per layer)
        qp = torch.arange(start, start + B, device=dev)
        kp = torch.cat([torch.arange(lo, start, device=dev), qp])
        seen = torch.ones(B, kp.shape[0], dtype=torch.bool, device=dev)
        if c.causal[il]:
            seen &= kp[None, :] <= qp[:, None]
        if window:
            seen &= (qp[:, None] - kp[None, :]) < window
            if not c.causal[il]:
                seen &= (kp[None, :] - qp[:, None]) < window
        rep = c.n_head // c.n_head_kv                          # GQA: query head h reads KV head h // rep
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(rep, 1).transpose(0, 1),
                                             vals.repeat_interleave(rep, 1).transpose(0, 1),
                                             attn_mask=seen,
                                             scale=c.head_dim ** -0.5)
        return out.transpose(0, 1)

    # ----- forward passes -----
    @torch.inference_mode()
    def extend(self, items: list[tuple[DFlashState, torch.Tensor]]) -> None:
        """Append context rows: for each (state, features [n, len(target_layer_ids) * n_embd]) the
        target's hidden states of positions state.length .. state.length + n - 1."""
        items = [(st, f) for st, f in items if f.shape[0]]
        if not items:
            return
        c, dev, kept = self.cfg, self.device, self.fc.dtype    # (the context K/V kept in the weights' dtype)
        feats = torch.cat([f.to(dev, non_blocking=True).float() for _, f in items])
        ctx = rms_norm(self._mm(feats, self.fc), self.hidden_norm, c.rms_eps)
        pos = torch.cat([torch.arange(st.length, st.length + f.shape[0]) for st, f in items])
        cos, sin = self.rope.cos_sin(pos.to(dev, non_blocking=True))
        for il, L in enumerate(self.layers):
            k = self._heads(ctx, L, "k", c.n_head_kv, cos, sin).to(kept)
            v = self._lin(ctx, L, "v").view(ctx.shape[0], c.n_head_kv, c.head_dim).to(kept)
            off = 0
            for st, f in items:
                n = f.shape[0]
                st.keys[il].append(k[off:off + n])
                st.values[il].append(v[off:off + n])
                off += n
        for st, f in items:
            st.length += f.shape[0]

    @torch.inference_mode()
    def block_hidden(self, target, states: list[DFlashState], tokens: list[int]) -> list[torch.Tensor]:
        """One block per state: `tokens[i]` at position states[i].length followed by mask tokens.
        Returns each block's final normed hidden rows [block_size, n_embd]."""
        c = self.cfg
        B = c.block_size
        dev = self.device
        ids = torch.tensor([t for tok in tokens for t in [tok] + [c.mask_token_id] * (B - 1)])
        x = target.tok_embd.rows(ids.to(dev, non_blocking=True)).float()
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        pos = torch.cat([torch.arange(st.length, st.length + B) for st in states])
        cos, sin = self.rope.cos_sin(pos.to(dev, non_blocking=True))
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L["input_norm"], c.rms_eps)
            q = self._heads(h, L, "q", c.n_head, cos, sin)
            k = self._heads(h, L, "k", c.n_head_kv, cos, sin)
            v = self._lin(h, L, "v").view(h.shape[0], c.n_head_kv, c.head_dim)
            a = torch.cat([self._attend(il, st, q[i * B:(i + 1) * B], k[i * B:(i + 1) * B], v[i * B:(i + 1) * B])
                           for i, st in enumerate(states)])
            x = x + self._lin(a.reshape(x.shape[0], c.n_head * c.head_dim), L, "o")
            h = rms_norm(x, L["post_norm"], c.rms_eps)
            x = x + self._mm(silu_mul(self._mm(h, L["gate"]), self._mm(h, L["up"])), L["down"])
        h = rms_norm(x, self.norm, c.rms_eps)
        return [h[i * B:(i + 1) * B] for i in range(len(states))]

    def logits(self, target, h: torch.Tensor) -> torch.Tensor:
        """The target's LM head on drafter rows, with the drafter's output scale and soft cap."""
        lg = target.output.matmul(h)
        if self.cfg.output_multiplier != 1.0:
            lg = lg * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(lg / cap) * cap if cap else lg


# ------------------------------------------------------------------------------------------------
# drafting

@dataclass
class DraftRequest:
    """Draft for one sequence whose context is complete up to the token before `token`."""
    state: DFlashState
    token: int                 # the last sampled token, not yet in the target's KV: the block's first row
    k: int                     # drafts wanted
    sampler: object            # engine.sampling.Sampler of the request (greedy or its sampling settings)
    history: list[int] = field(default_factory=list)   # the sequence's tokens (penalties)


def propose(drafter: DFlashDrafter, target, reqs: list[DraftRequest]) -> None:
    """Run one block per request and put up to k drafts (at most block_size - 1) into `state.drafts`,
    with their distributions in `state.q` when the request samples."""
    for r in reqs:
        r.state.drafts, r.state.q, r.state.position = [], None, r.state.length
    reqs = [r for r in reqs if r.k > 0]
    if not reqs:
        return
    hidden = drafter.block_hidden(target, [r.state for r in reqs], [r.token for r in reqs])
    ks = [min(r.k, drafter.cfg.block_size - 1) for r in reqs]
    lg = drafter.logits(target, torch.cat([h[1:1 + k] for h, k in zip(hidden, ks)]))
    plain = [_plain_greedy(r.sampler.params) for r in reqs]
    top = lg.argmax(-1).tolist()   # plain greedy drafts: the argmax rows, read at once
    # the others through their samplers, on the host at once (their generators live there)
    host = lg.float().cpu() if not all(plain) else None
    off = 0
    for r, k, p in zip(reqs, ks, plain):
        if p:
            r.state.drafts, r.state.q = top[off:off + k], None
        else:
            _choose(r, host[off:off + k])
        off += k


def _plain_greedy(params) -> bool:
    """Greedy with nothing that changes the logits (bias, penalties): its drafts are the rows' argmax (the
    first maximal index, as the Sampler takes it)."""
    from engine.sample_device import samples_on_device
    return params.greedy and samples_on_device(dataclasses.replace(params, logprobs=None))


def _choose(r: DraftRequest, logits: torch.Tensor) -> None:
    """Drafts from each row through the request's sampler: its choice when greedy, else a draw from
    q = softmax(final logits), kept for the verifier. Penalties see the earlier drafts as history."""
    s = r.sampler
    hist, drafts, qs = list(r.history), [], []
    for row in logits:
        x = s.final_logits(row, hist)
        if s.params.greedy:
            tok = int(x.argmax())
        else:
            q = torch.softmax(x.double(), 0)
            tok = draw_from(q, s.generator)
            qs.append(q)
        drafts.append(tok)
        hist.append(tok)
    r.state.drafts = drafts
    r.state.q = torch.stack(qs) if qs else None
