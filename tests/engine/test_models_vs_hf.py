"""Our CPU forward against Hugging Face transformers on the same weights.

For each architecture the tiny synthetic model is written with F32 weights (so our matmuls do not
round activations the way llama.cpp's CPU backend does for quantized weights), its GGUF tensors are
converted back to the HF layout (undoing what llama.cpp's converter did: llama's Q/K permutation for
NORM rope, the +1 on norm weights of gemma3 and qwen35, qwen35's A_log -> -exp(A_log) and its tiled
V-head order), the HF model is built from them (eager attention, float32, torch fallback paths),
and the logits of ~40 tokens are compared, with our KV cache in float32.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.models import open_model
from engine.models.common import SeqChunk
from engine.tools.synth import write_synthetic

transformers = pytest.importorskip("transformers")

N_TOKENS = 40
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "qwen35"]


def gguf_tensors(path) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors as float32 (torch order), read with the gguf package (independent of our reader),
    and the metadata as plain values."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(int(x) for x in reversed(t.shape)))
    md = {}
    for name, fld in r.fields.items():
        try:
            md[name] = fld.contents()
        except Exception:  # noqa: BLE001 - some fields (e.g. huge arrays) are not needed here
            pass
    return out, md


def _unpermute_llama(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> GGUF adjacent pairs)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiled_to_grouped(w: torch.Tensor, dim: int, n_k: int, n_v_per_k: int, head_dim: int) -> torch.Tensor:
    """Inverse of conversion/qwen.py _reorder_v_heads (GGUF tiled V-head order -> HF grouped order)."""
    shape = list(w.shape)
    dim = dim % len(shape)
    new = shape[:dim] + [n_v_per_k, n_k, head_dim] + shape[dim + 1:]
    perm = list(range(len(new)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return w.reshape(new).permute(*perm).contiguous().reshape(shape)


def _common_layer(sd, T, i, norm_shift=0.0):
    p, q = f"blk.{i}.", f"model.layers.{i}."
    sd[q + "input_layernorm.weight"] = T[p + "attn_norm.weight"] - norm_shift
    sd[q + "mlp.gate_proj.weight"] = T[p + "ffn_gate.weight"]
    sd[q + "mlp.up_proj.weight"] = T[p + "ffn_up.weight"]
    sd[q + "mlp.down_proj.weight"] = T[p + "ffn_down.weight"]


def hf_model(arch: str, T: dict, md: dict):
    """Build the HF model for a tiny synthetic GGUF from its (dequantized) tensors."""
    a = arch + "."
    n_layer = int(md[a + "block_count"]) - int(md.get(a + "nextn_predict_layers", 0))
    E = int(md[a + "embedding_length"])
    n_head, n_kv = int(md[a + "attention.head_count"]), int(md[a + "attention.head_count_kv"])
    head_dim = int(md.get(a + "attention.key_length", E // n_head))
    vocab = T["token_embd.weight"].shape[0]
    tied = "output.weight" not in T
    common = dict(vocab_size=vocab, hidden_size=E, intermediate_size=int(md[a + "feed_forward_length"]),
                  num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv, head_dim=head_dim,
                  rms_norm_eps=float(md[a + "attention.layer_norm_rms_epsilon"]), tie_word_embeddings=tied,
                  max_position_embeddings=4096)
    theta = float(md[a + "rope.freq_base"])
    sd = {"model.embed_tokens.weight": T["token_embd.weight"],
          "lm_head.weight": T["token_embd.weight"] if tied else T["output.weight"]}

    if arch in ("llama", "qwen2", "qwen3"):
        rope = {"rope_type": "default", "rope_theta": theta}
        if arch == "llama":
            cfg = transformers.LlamaConfig(**common, rope_parameters=rope, attention_bias=False)
            cls = transformers.LlamaForCausalLM
        elif arch == "qwen2":
            cfg = transformers.Qwen2Config(**common, rope_parameters=rope)
            cls = transformers.Qwen2ForCausalLM
        else:
            cfg = transformers.Qwen3Config(**common, rope_parameters=rope, attention_bias=False)
            cls = transformers.Qwen3ForCausalLM
        sd["model.norm.weight"] = T["output_norm.weight"]
        for i in range(n_layer):
            p, q = f"blk.{i}.", f"model.layers.{i}.self_attn."
            _common_layer(sd, T, i)
            sd[f"model.layers.{i}.post_attention_layernorm.weight"] = T[p + "ffn_norm.weight"]
            wq, wk = T[p + "attn_q.weight"], T[p + "attn_k.weight"]
            if arch == "llama":  # the converter permuted Q/K for llama.cpp's NORM (adjacent-pair) rope
                wq, wk = _unpermute_llama(wq, n_head), _unpermute_llama(wk, n_kv)
            sd[q + "q_proj.weight"], sd[q + "k_proj.weight"] = wq, wk
            sd[q + "v_proj.weight"] = T[p + "attn_v.weight"]
            sd[q + "o_proj.weight"] = T[p + "attn_output.weight"]
            if arch == "qwen2":
                for x in "qkv":
                    sd[q + f"{x}_proj.bias"] = T[p + f"attn_{x}.bias"]
            if arch == "qwen3":
                sd[q + "q_norm.weight"] = T[p + "attn_q_norm.weight"]
                sd[q + "k_norm.weight"] = T[p + "attn_k_norm.weight"]
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, sliding_window=int(md[a + "attention.sliding_window"]), query_pre_attn_scalar=head_dim,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": theta},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": float(md.get(a + "rope.freq_base_swa", 1e4))}},
            final_logit_softcapping=None, attn_logit_softcapping=None)
        cls = transformers.Gemma3ForCausalLM
        one = 1.0  # Gemma3RMSNorm computes x * (1 + w); the converter stored 1 + w
        sd["model.norm.weight"] = T["output_norm.weight"] - one
        for i in range(n_layer):
            p, q = f"blk.{i}.", f"model.layers.{i}."
            _common_layer(sd, T, i, one)
            sd[q + "post_attention_layernorm.weight"] = T[p + "post_attention_norm.weight"] - one
            sd[q + "pre_feedforward_layernorm.weight"] = T[p + "ffn_norm.weight"] - one
            sd[q + "post_feedforward_layernorm.weight"] = T[p + "post_ffw_norm.weight"] - one
            for x in ("q", "k", "v"):
                sd[q + f"self_attn.{x}_proj.weight"] = T[p + f"attn_{x}.weight"]
            sd[q + "self_attn.o_proj.weight"] = T[p + "attn_output.weight"]
            sd[q + "self_attn.q_norm.weight"] = T[p + "attn_q_norm.weight"] - one
            sd[q + "self_attn.k_norm.weight"] = T[p + "attn_k_norm.weight"] - one
    elif arch == "qwen35":
        n_k, n_v = int(md[a + "ssm.group_count"]), int(md[a + "ssm.time_step_rank"])
        dk = int(md[a + "ssm.state_size"])
        rpk = n_v // n_k
        rope_dim = int(md[a + "rope.dimension_count"])
        sections = [int(x) for x in md[a + "rope.dimension_sections"]][:3]
        interval = int(md.get(a + "full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer)]
        cfg = transformers.Qwen3_5TextConfig(
            **common, layer_types=layer_types, linear_conv_kernel_dim=int(md[a + "ssm.conv_kernel"]),
            linear_key_head_dim=dk, linear_value_head_dim=dk, linear_num_key_heads=n_k, linear_num_value_heads=n_v,
            rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rope_dim / head_dim,
                             "mrope_section": sections, "mrope_interleaved": True})
        cls = transformers.Qwen3_5ForCausalLM
        one = 1.0  # Qwen3_5RMSNorm computes x * (1 + w); the converter added 1 (not to linear_attn.norm)
        sd["model.norm.weight"] = T["output_norm.weight"] - one
        v_heads = lambda w, dim, hd: _tiled_to_grouped(w, dim, n_k, rpk, hd)  # noqa: E731
        for i in range(n_layer):
            p, q = f"blk.{i}.", f"model.layers.{i}."
            _common_layer(sd, T, i, one)
            sd[q + "post_attention_layernorm.weight"] = T[p + "post_attention_norm.weight"] - one
            if layer_types[i] == "linear_attention":
                la = q + "linear_attn."
                qkv = T[p + "attn_qkv.weight"]
                conv = T[p + "ssm_conv1d.weight"]
                kd = 2 * n_k * dk
                sd[la + "in_proj_qkv.weight"] = torch.cat([qkv[:kd], v_heads(qkv[kd:], 0, dk)])
                sd[la + "conv1d.weight"] = torch.cat([conv[:kd], v_heads(conv[kd:], 0, dk)])[:, None, :]
                sd[la + "in_proj_z.weight"] = v_heads(T[p + "attn_gate.weight"], 0, dk)
                sd[la + "in_proj_b.weight"] = v_heads(T[p + "ssm_beta.weight"], 0, 1)
                sd[la + "in_proj_a.weight"] = v_heads(T[p + "ssm_alpha.weight"], 0, 1)
                sd[la + "A_log"] = v_heads(torch.log(-T[p + "ssm_a"])[:, None], 0, 1)[:, 0]
                sd[la + "dt_bias"] = v_heads(T[p + "ssm_dt.bias"][:, None], 0, 1)[:, 0]
                sd[la + "norm.weight"] = T[p + "ssm_norm.weight"]
                sd[la + "out_proj.weight"] = v_heads(T[p + "ssm_out.weight"], 1, dk)
            else:
                sa = q + "self_attn."
                for x in ("q", "k", "v"):  # attn_q is [q, gate] per head, as HF's q_proj
                    sd[sa + f"{x}_proj.weight"] = T[p + f"attn_{x}.weight"]
                sd[sa + "o_proj.weight"] = T[p + "attn_output.weight"]
                sd[sa + "q_norm.weight"] = T[p + "attn_q_norm.weight"] - one
                sd[sa + "k_norm.weight"] = T[p + "attn_k_norm.weight"] - one
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if k != "lm_head.weight" or not tied], missing
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens[None], use_cache=False).logits[0].float()


def our_logits(path, tokens: torch.Tensor) -> torch.Tensor:
    m = open_model(path)
    try:
        (logits,) = m.forward([SeqChunk(tokens, 0, m.new_kv(torch.float32), "all")])
        return logits
    finally:
        m.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=1, weight_type="F32")
    T, md = gguf_tensors(path)
    model = hf_model(arch, T, md)
    tokens = torch.randint(0, T["token_embd.weight"].shape[0] - 3, (N_TOKENS,), generator=torch.Generator().manual_seed(7))
    ref = hf_logits(model, tokens)
    ours = our_logits(path, tokens)
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"{arch}: max |logit diff| {diff:.3g} (max |logit| {scale:.3g})")
    assert diff < 1e-3 * max(scale, 1.0), (arch, diff, scale)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
