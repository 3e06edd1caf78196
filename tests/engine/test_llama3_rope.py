"""Llama 3.1-style rope scaling: a random HF Llama model with rope_scaling 'llama3', converted to GGUF
the way llama.cpp's converter does it (Q/K permuted for adjacent-pair rope, rope_freqs factors as a
tensor), must give the same logits in our engine as in transformers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf import GGUFWriter  # noqa: E402

from engine.models import open_model  # noqa: E402
from engine.models.common import SeqChunk  # noqa: E402

ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64)


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter: HF rotate-half layout -> adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_factors(base: float, dim: int) -> np.ndarray:
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    lo = ROPE["original_max_position_embeddings"] / ROPE["low_freq_factor"]
    hi = ROPE["original_max_position_embeddings"] / ROPE["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < hi:
            out.append(1.0)
        elif wl > lo:
            out.append(ROPE["factor"])
        else:
            s = (ROPE["original_max_position_embeddings"] / wl - ROPE["low_freq_factor"]) / (
                ROPE["high_freq_factor"] - ROPE["low_freq_factor"])
            out.append(1.0 / ((1 - s) / ROPE["factor"] + s))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_matches_transformers(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, max_position_embeddings=512, rope_scaling=dict(ROPE),
                                   tie_word_embeddings=False, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.08)
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.8, 1.2)
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    head_dim = 64 // 4
    path = tmp_path / "llama3.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(256)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    w.add_tensor("rope_freqs.weight", _rope_factors(10000.0, head_dim))
    names = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for il in range(2):
        p = f"model.layers.{il}."
        w.add_tensor(f"blk.{il}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], 4).numpy())
        w.add_tensor(f"blk.{il}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], 2).numpy())
        for hf_name, gg in names.items():
            w.add_tensor(f"blk.{il}.{gg}.weight", sd[p + hf_name + ".weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    toks = torch.randint(0, 256, (200,))  # past original_max_position_embeddings: the scaling matters
    with torch.no_grad():
        ref = hf(toks[None]).logits[0]
    m = open_model(path)
    assert m.rope.inv_freq.shape[0] == head_dim // 2
    (ours,) = m.forward([SeqChunk(toks, 0, m.new_kv(), logits="all")])
    m.close()
    # f16 KV storage (llama.cpp's default cache type) is the only difference from transformers' fp32
    assert (ours - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
