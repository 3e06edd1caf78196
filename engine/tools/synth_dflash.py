"""Synthetic DFlash drafters for tests, written both ways a drafter is published: a z-lab-style
directory (config.json + model.safetensors) and the GGUF port (engine/spec/dflash.py reads both).

`synthetic_drafter(target, derived=True)` builds a drafter for a synthetic target (engine/tools/synth.py)
that actually predicts something, so tests see drafts both accepted and rejected. The synthetic
targets' untied embeddings are large next to what their random layers add, so their next token is
largely a function of the current one: logits ~ output . norm(embedding(x_p)). The derived drafter
copies the block's first token (x_p) into every mask row: in layer 0 the queries and keys are
nearly zero (near-uniform attention), V projects out the mask token's embedding (mask rows carry
no value) and O amplifies what is left, so each mask row ends up ~ embedding(x_p); the final norm
takes the target's output_norm. Draft 1 then often equals the target's choice, later drafts (the
same guess again) rarely. Every other weight is small noise, so every path of the forward (context
projection, K/V injection, both layer kinds) still runs with non-zero numbers. derived=False gives
plain random weights (for comparing forward passes).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from engine.spec.dflash import _GGUF_BLK, DFlashConfig
from engine.tools.synth_gguf import part_writer

# z-lab (HF) name -> GGUF port name
_HF_TO_GGUF_TOP = {"fc.weight": "dflash_fc.weight", "hidden_norm.weight": "dflash_hidden_norm.weight",
                   "norm.weight": "output_norm.weight"}
_HF_TO_GGUF_BLK = {v: k for k, v in _GGUF_BLK.items() if k != "ffn_norm"}


def hf_to_gguf_name(name: str) -> str:
    if name in _HF_TO_GGUF_TOP:
        return _HF_TO_GGUF_TOP[name]
    _, il, rest = name.split(".", 2)             # layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{il}.{_HF_TO_GGUF_BLK[module]}.{kind}"


def synthetic_drafter(target_path, *, seed: int = 0, n_layer: int = 2, block_size: int = 16,
                      derived: bool = True, n_head: int = 4, head_dim: int | None = None,
                      n_ff: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, {z-lab tensor name: float32 tensor}) of a drafter for the GGUF at target_path.
    n_head / head_dim / n_ff: the layers' shape (default 4 heads of n_embd / 4, n_ff n_embd / 2; the
    derived drafter needs n_head x head_dim = n_embd)."""
    from engine.models import open_model
    m = open_model(target_path)
    try:
        s = m.spec
        E = s.n_embd
        mask = s.vocab_size - 4                   # an ordinary token of the synthetic vocabulary
        mask_emb = m.tok_embd.rows(torch.tensor([mask]))[0].float()
        out_norm = m.output_norm.dense.float().clone()
    finally:
        m.close()
    head_dim = head_dim or E // n_head
    n_ff = n_ff or E // 2
    if derived and n_head * head_dim != E:
        raise ValueError("a derived drafter needs n_head x head_dim = the target's n_embd")
    ids = sorted({0, s.n_layer // 2} | ({s.n_layer - 1} if s.n_layer > 2 else set()))
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": E,
        "num_hidden_layers": n_layer, "num_attention_heads": n_head, "num_key_value_heads": n_head,
        "head_dim": head_dim, "intermediate_size": n_ff, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "attention_bias": False, "use_sliding_window": True, "sliding_window": block_size, "is_causal": False,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)],
        "vocab_size": s.vocab_size, "num_target_layers": s.n_layer, "tie_word_embeddings": False,
        "dflash_config": {"block_size": block_size, "mask_token_id": mask, "target_layer_ids": ids},
    }
    g = torch.Generator().manual_seed(seed)
    noise = 0.02 if derived else 1.0

    def mat(n_out, n_in, scale=noise):
        return torch.randn(n_out, n_in, generator=g) * (scale / math.sqrt(n_in))

    def norm(n, value=None):
        return torch.full((n,), value) if value is not None else 1.0 + 0.2 * (torch.rand(n, generator=g) - 0.5)

    qd = n_head * head_dim
    t = {"fc.weight": mat(E, len(ids) * E, 1.0),
         "hidden_norm.weight": norm(E, 0.01) if derived else norm(E),
         "norm.weight": out_norm if derived else norm(E)}
    for il in range(n_layer):
        p = f"layers.{il}."
        t.update({p + "input_layernorm.weight": norm(E, 1.0) if derived else norm(E),
                  p + "post_attention_layernorm.weight": norm(E, 1.0) if derived else norm(E),
                  p + "self_attn.q_norm.weight": norm(head_dim, 0.1) if derived else norm(head_dim),
                  p + "self_attn.k_norm.weight": norm(head_dim, 0.1) if derived else norm(head_dim),
                  p + "self_attn.q_proj.weight": mat(qd, E), p + "self_attn.k_proj.weight": mat(qd, E),
                  p + "self_attn.v_proj.weight": mat(qd, E), p + "self_attn.o_proj.weight": mat(E, qd),
                  p + "mlp.gate_proj.weight": mat(n_ff, E), p + "mlp.up_proj.weight": mat(n_ff, E),
                  p + "mlp.down_proj.weight": mat(E, n_ff)})
    if derived:   # layer 0 copies the block's first token into the mask rows (module docstring)
        u = mask_emb / mask_emb.norm()
        v = t["layers.0.self_attn.v_proj.weight"]
        t["layers.0.self_attn.v_proj.weight"] = (torch.eye(E) + v) @ (torch.eye(E) - torch.outer(u, u))
        t["layers.0.self_attn.o_proj.weight"] += 3000.0 * torch.eye(E)
    return config, t


# ------------------------------------------------------------------------------------------------
# writing

_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors(path, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    """A .safetensors file (8-byte header length, JSON header, data), as the safetensors package writes."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for b in blobs:
            f.write(b)


def write_dir(path, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Path:
    """A drafter directory as z-lab publishes one: config.json + model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(path / "model.safetensors", tensors, dtype)
    return path


def write_gguf(path, config: dict, tensors: dict[str, torch.Tensor], f16: bool = False) -> Path:
    """The GGUF port of a drafter given as a z-lab config.json dict and its tensors (docs/ARCHITECTURE.md
    lists the keys and tensor names). Matrices as F16 when f16, norms always F32."""
    c = DFlashConfig.from_hf(config, "config")
    path = Path(path)
    with part_writer(path, "dflash") as w:
        w.add_string("general.name", config.get("_name_or_path", "DFlash drafter"))
        a = "dflash."
        for key, val in (("embedding_length", c.hidden_size), ("block_count", c.n_layer),
                         ("feed_forward_length", c.n_ff), ("attention.head_count", c.n_head),
                         ("attention.head_count_kv", c.n_head_kv), ("attention.key_length", c.head_dim),
                         ("block_size", c.block_size), ("mask_token_id", c.mask_token_id)):
            w.add_uint32(a + key, int(val))
        w.add_float32(a + "attention.layer_norm_rms_epsilon", c.rms_eps)
        w.add_float32(a + "rope.freq_base", c.rope_theta)
        w.add_array(a + "target_layer_ids", [int(i) for i in c.target_layer_ids])
        w.add_array(a + "attention.sliding_window_pattern", [bool(x) for x in c.sliding])
        w.add_uint32(a + "attention.sliding_window", int(c.sliding_window))
        if config.get("is_causal") is not None:
            w.add_bool(a + "attention.causal", bool(config["is_causal"]))
        for key, val in (("vocab_size", c.vocab_size), ("num_target_layers", c.num_target_layers)):
            if val is not None:
                w.add_uint32(a + key, int(val))
        for key, val, default in (("input_embedding_scale", c.input_embedding_scale, 1.0),
                                  ("output_multiplier", c.output_multiplier, 1.0),
                                  ("final_logit_softcapping", c.final_logit_softcapping, None)):
            if val is not None and val != default:
                w.add_float32(a + key, float(val))
        for name, t in tensors.items():
            arr = t.detach().float().numpy()
            if f16 and arr.ndim == 2:
                arr = arr.astype(np.float16)
            w.add_tensor(hf_to_gguf_name(name), arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return path


def write_synthetic_dflash(path, target_path, fmt: str = "safetensors", **kw) -> Path:
    """Write `synthetic_drafter(target_path, **kw)` as a directory (fmt="safetensors") or a GGUF port."""
    config, tensors = synthetic_drafter(target_path, **kw)
    if fmt == "safetensors":
        return write_dir(path, config, tensors)
    if fmt == "gguf":
        return write_gguf(path, config, tensors)
    raise ValueError(f"unknown drafter format {fmt!r} (safetensors or gguf)")
