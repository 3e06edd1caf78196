"""Hugging Face reference models built from the synthetic mmproj / vision-language GGUFs (tensors read
back with the gguf package, not with our reader), for tests/engine/test_vision*.py."""
from __future__ import annotations

import torch
import transformers

from tests.engine.test_models_vs_hf import gguf_tensors, hf_model

_QWEN_BLOCK = (("norm1", "ln1"), ("norm2", "ln2"), ("attn.qkv", "attn_qkv"), ("attn.proj", "attn_out"),
               ("mlp.linear_fc1", "ffn_up"), ("mlp.linear_fc2", "ffn_down"))
_SIGLIP_BLOCK = (("layer_norm1", "ln1"), ("layer_norm2", "ln2"), ("self_attn.q_proj", "attn_q"),
                 ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"), ("self_attn.out_proj", "attn_out"),
                 ("mlp.fc1", "ffn_up"), ("mlp.fc2", "ffn_down"))


def _md_int(md, key, default=None):
    v = md.get(key, default)
    return int(v[0] if isinstance(v, list) else v)


def qwen_vision(mmproj_path):
    """(HF Qwen3_5VisionModel with the mmproj's weights, its config)."""
    T, md = gguf_tensors(mmproj_path)
    E = _md_int(md, "clip.vision.embedding_length")
    n_layer = _md_int(md, "clip.vision.block_count")
    cfg = transformers.Qwen3_5VisionConfig(
        depth=n_layer, hidden_size=E, hidden_act="gelu_pytorch_tanh",
        intermediate_size=_md_int(md, "clip.vision.feed_forward_length"),
        num_heads=_md_int(md, "clip.vision.attention.head_count"), patch_size=_md_int(md, "clip.vision.patch_size"),
        spatial_merge_size=_md_int(md, "clip.vision.spatial_merge_size", 2), temporal_patch_size=2,
        out_hidden_size=_md_int(md, "clip.vision.projection_dim"),
        num_position_embeddings=T["v.position_embd.weight"].shape[0])
    cfg._attn_implementation = "eager"
    sd = {"patch_embed.proj.weight": torch.stack([T["v.patch_embd.weight"], T["v.patch_embd.weight.1"]], 2),
          "patch_embed.proj.bias": T["v.patch_embd.bias"], "pos_embed.weight": T["v.position_embd.weight"],
          "merger.norm.weight": T["v.post_ln.weight"], "merger.norm.bias": T["v.post_ln.bias"],
          "merger.linear_fc1.weight": T["mm.0.weight"], "merger.linear_fc1.bias": T["mm.0.bias"],
          "merger.linear_fc2.weight": T["mm.2.weight"], "merger.linear_fc2.bias": T["mm.2.bias"]}
    for i in range(n_layer):
        for hf, ours in _QWEN_BLOCK:
            for x in ("weight", "bias"):
                sd[f"blocks.{i}.{hf}.{x}"] = T[f"v.blk.{i}.{ours}.{x}"]
    torch.manual_seed(0)
    m = transformers.Qwen3_5VisionModel(cfg).float().eval()
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return m, cfg


def qwen_pixel_values(pixels: torch.Tensor, patch: int, merge: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [3, H, W] image as HF's Qwen2VL image processor lays it out: the frame repeated over the
    temporal patch (2), patches in merge-block order, each flattened as (channel, time, row, col)."""
    C, H, W = pixels.shape
    gh, gw = H // patch, W // patch
    x = pixels[None].repeat(2, 1, 1, 1)
    x = x.reshape(1, 2, C, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, C * 2 * patch * patch)
    return x, torch.tensor([[1, gh, gw]])


def siglip_vision(mmproj_path):
    """(HF SiglipVisionModel, HF Gemma3MultiModalProjector, SiglipVisionConfig) with the mmproj's weights."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    T, md = gguf_tensors(mmproj_path)
    E = _md_int(md, "clip.vision.embedding_length")
    n_layer = _md_int(md, "clip.vision.block_count")
    size, patch = _md_int(md, "clip.vision.image_size"), _md_int(md, "clip.vision.patch_size")
    pool = _md_int(md, "clip.vision.projector.scale_factor", 4)
    vc = transformers.SiglipVisionConfig(
        hidden_size=E, intermediate_size=_md_int(md, "clip.vision.feed_forward_length"), num_hidden_layers=n_layer,
        num_attention_heads=_md_int(md, "clip.vision.attention.head_count"), image_size=size, patch_size=patch,
        hidden_act="gelu_pytorch_tanh", layer_norm_eps=float(md["clip.vision.attention.layer_norm_epsilon"]),
        vision_use_head=False)
    vc._attn_implementation = "eager"
    sd = {"embeddings.patch_embedding.weight": T["v.patch_embd.weight"],
          "embeddings.patch_embedding.bias": T["v.patch_embd.bias"],
          "embeddings.position_embedding.weight": T["v.position_embd.weight"],
          "post_layernorm.weight": T["v.post_ln.weight"], "post_layernorm.bias": T["v.post_ln.bias"]}
    for i in range(n_layer):
        for hf, ours in _SIGLIP_BLOCK:
            for x in ("weight", "bias"):
                sd[f"encoder.layers.{i}.{hf}.{x}"] = T[f"v.blk.{i}.{ours}.{x}"]
    torch.manual_seed(0)
    tower = transformers.SiglipVisionModel(vc).float().eval()
    missing, unexpected = tower.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    n_text = _md_int(md, "clip.vision.projection_dim")
    gc = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(hidden_size=n_text, vocab_size=512, num_hidden_layers=1,
                                                  num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                                                  intermediate_size=16),
        vision_config=vc, mm_tokens_per_image=((size // patch) // pool) ** 2)
    proj = Gemma3MultiModalProjector(gc).float().eval()
    proj.load_state_dict({"mm_input_projection_weight": T["mm.input_projection.weight"],
                          # Gemma3RMSNorm computes x * (1 + w); the converter stored 1 + w
                          "mm_soft_emb_norm.weight": T["mm.soft_emb_norm.weight"] - 1.0})
    return tower, proj, vc


def qwen_vlm(vlm_path, mmproj_path, image_token_id: int, start_id: int, end_id: int):
    """HF Qwen3_5ForConditionalGeneration: the synthetic language model + the mmproj's vision tower."""
    T, md = gguf_tensors(vlm_path)
    text = hf_model("qwen35", T, md)
    vision, vcfg = qwen_vision(mmproj_path)
    cfg = transformers.Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vcfg.to_dict(),
                                     image_token_id=image_token_id, video_token_id=image_token_id,
                                     vision_start_token_id=start_id, vision_end_token_id=end_id,
                                     tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
          for k, v in text.state_dict().items()}
    sd.update({"model.visual." + k: v for k, v in vision.state_dict().items()})
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return m


def gemma_vlm(vlm_path, mmproj_path, soft_id: int, boi_id: int, eoi_id: int):
    """HF Gemma3ForConditionalGeneration: the synthetic gemma3 model + the mmproj's SigLIP and projector."""
    T, md = gguf_tensors(vlm_path)
    text = hf_model("gemma3", T, md)
    tower, proj, vc = siglip_vision(mmproj_path)
    cfg = transformers.Gemma3Config(text_config=text.config.to_dict(), vision_config=vc.to_dict(),
                                    mm_tokens_per_image=proj.tokens_per_side ** 2, image_token_index=soft_id,
                                    boi_token_index=boi_id, eoi_token_index=eoi_id)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
          for k, v in text.state_dict().items()}
    sd.update({"model.vision_tower." + k: v for k, v in tower.state_dict().items()})
    sd.update({"model.multi_modal_projector." + k: v for k, v in proj.state_dict().items()})
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.language_model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return m
