"""Synthetic vision files for tests and benchmarks (random but well-scaled weights):

- `write_mmproj(path, projector, preset)`: an mmproj GGUF in llama.cpp's layout (clip.* keys and
  v.* / mm.* tensor names as convert_hf_to_gguf.py writes them for Qwen3.5/Qwen3-VL and Gemma 3).
  Presets: ``tiny`` (milliseconds; pairs with engine.tools.synth's tiny models, n_embd 128) and the real
  shapes ``qwen35-27b`` (Qwen3.5-27B's vision tower, 1152 wide, 27 blocks, patch 16, output 5120) and
  ``gemma3-4b`` (SigLIP-so400m at 896 px, output 2560) for timing the encoder.
- `write_vlm(path, arch)`: a tiny qwen35 or gemma3 language model (engine.tools.synth's tiny layout)
  whose vocabulary also holds the image tokens its prompts need, with an image-aware chat template
  (or engine.tools.synth's plain ChatML one, `template="chatml"`, which knows nothing of images).

Usage: python -m engine.tools.synth_mmproj OUT.gguf --projector qwen3vl_merger [--preset qwen35-27b]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import zlib
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import Keys, TokenType

from engine.tools.synth_gguf import Layout, float_values, part_writer, write_gguf

PROJECTORS = ("qwen3vl_merger", "gemma3")


@dataclass(frozen=True)
class MmprojConfig:
    projector: str
    hidden: int
    n_layer: int
    n_head: int
    n_ff: int
    patch: int
    n_embd_text: int
    image_size: int            # qwen: sqrt(position table) * patch; gemma: the fixed input size
    pool: int = 4              # gemma: average-pool kernel
    merge: int = 2             # qwen
    min_pixels: int = 0        # qwen: written only when set
    max_pixels: int = 0
    eps: float = 1e-6


PRESETS = {
    ("qwen3vl_merger", "tiny"): MmprojConfig("qwen3vl_merger", hidden=64, n_layer=2, n_head=4, n_ff=128, patch=8,
                                             n_embd_text=128, image_size=32, min_pixels=4 * 256, max_pixels=64 * 256),
    ("gemma3", "tiny"): MmprojConfig("gemma3", hidden=64, n_layer=2, n_head=4, n_ff=128, patch=4, n_embd_text=128,
                                     image_size=32, pool=2),
    # HF Qwen/Qwen3.5-27B vision_config (num_position_embeddings 2304 = 48 x 48)
    ("qwen3vl_merger", "qwen35-27b"): MmprojConfig("qwen3vl_merger", hidden=1152, n_layer=27, n_head=16, n_ff=4304,
                                                   patch=16, n_embd_text=5120, image_size=768),
    # HF google/gemma-3-4b-it vision_config (SigLIP so400m, 896 px, patch 14)
    ("gemma3", "gemma3-4b"): MmprojConfig("gemma3", hidden=1152, n_layer=27, n_head=16, n_ff=4304, patch=14,
                                          n_embd_text=2560, image_size=896),
}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(name.encode())])


def _patch_and_positions(T: Layout, c: MmprojConfig) -> None:
    p = c.patch
    conv_std = 1.0 / math.sqrt(3 * p * p)
    if c.projector == "qwen3vl_merger":           # two temporal patch kernels
        T.add("v.patch_embd.weight", (c.hidden, 3, p, p), ("normal", conv_std / math.sqrt(2)))
        T.add("v.patch_embd.weight.1", (c.hidden, 3, p, p), ("normal", conv_std / math.sqrt(2)))
    else:
        T.add("v.patch_embd.weight", (c.hidden, 3, p, p), ("normal", conv_std))
    T.add("v.patch_embd.bias", (c.hidden,), ("normal", 0.02))
    side = c.image_size // p
    T.add("v.position_embd.weight", (side * side, c.hidden), ("normal", 0.5))


def _layout(c: MmprojConfig) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(name, torch-order shape, init) of every tensor."""
    E, FF = c.hidden, c.n_ff
    T = Layout()

    def lin(name, n_out, n_in, scale=1.0):
        T.linear(name + ".weight", n_out, n_in, scale)
        T.add(name + ".bias", (n_out,), ("normal", 0.02))

    def norm(name, n):
        T.norm(name + ".weight", n)
        T.add(name + ".bias", (n,), ("normal", 0.02))

    out_scale = 1.0 / math.sqrt(2.0 * c.n_layer)
    _patch_and_positions(T, c)
    for il in range(c.n_layer):
        b = f"v.blk.{il}."
        norm(b + "ln1", E)
        if c.projector == "qwen3vl_merger":
            lin(b + "attn_qkv", 3 * E, E)
        else:
            for x in "qkv":
                lin(b + f"attn_{x}", E, E)
        lin(b + "attn_out", E, E, out_scale)
        norm(b + "ln2", E)
        lin(b + "ffn_up", FF, E)
        lin(b + "ffn_down", E, FF, out_scale)
    norm("v.post_ln", E)
    if c.projector == "qwen3vl_merger":
        M = E * c.merge * c.merge
        lin("mm.0", M, M)
        lin("mm.2", c.n_embd_text, M)
    else:
        T.norm("mm.soft_emb_norm.weight", E)          # holds 1 + w, as converted
        T.add("mm.input_projection.weight", (E, c.n_embd_text), ("normal", 1.0 / math.sqrt(E)))
    return T.rows


def _values(name: str, shape, init, seed: int) -> np.ndarray:
    return float_values(init, math.prod(shape), _rng(seed, name)).reshape(shape)


def _write_clip_keys(w: gguf.GGUFWriter, c: MmprojConfig, preset: str, wt: str) -> None:
    """The clip.* metadata of an mmproj file, as llama.cpp's converter writes them."""
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(f"HiveJet synthetic {c.projector} {preset}")
    w.add_description("random weights written by engine/tools/synth_mmproj.py; not a trained model")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32 if wt == "F32" else gguf.LlamaFileType.MOSTLY_F16))
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(c.projector)
    w.add_vision_projection_dim(c.n_embd_text)
    w.add_vision_image_size(c.image_size)
    w.add_vision_patch_size(c.patch)
    w.add_vision_embedding_length(c.hidden)
    w.add_vision_feed_forward_length(c.n_ff)
    w.add_vision_block_count(c.n_layer)
    w.add_vision_head_count(c.n_head)
    w.add_vision_attention_layernorm_eps(c.eps)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    if c.projector == "qwen3vl_merger":
        w.add_vision_spatial_merge_size(c.merge)
        if c.min_pixels:
            w.add_vision_min_pixels(c.min_pixels)
        if c.max_pixels:
            w.add_vision_max_pixels(c.max_pixels)
    elif c.pool != 4:
        w.add_vision_projector_scale_factor(c.pool)


def write_mmproj(path, projector: str, preset: str = "tiny", *, seed: int = 0, weight_type: str = "F32",
                 n_embd_text: int | None = None) -> dict:
    """Write a synthetic mmproj file. weight_type: F32 (exact comparisons) or F16 for the matrices
    (norms, biases and embedding tables stay F32, as llama.cpp's converter leaves them)."""
    if projector not in PROJECTORS:
        raise ValueError(f"unknown projector {projector!r} (choose from {', '.join(PROJECTORS)})")
    c = PRESETS.get((projector, preset))
    if c is None:
        raise ValueError(f"no preset {preset!r} for {projector} "
                         f"(have: {', '.join(p for (j, p) in PRESETS if j == projector)})")
    if n_embd_text is not None:
        c = MmprojConfig(**{**c.__dict__, "n_embd_text": int(n_embd_text)})
    wt = weight_type.upper()
    if wt not in ("F32", "F16"):
        raise ValueError("weight_type must be F32 or F16")
    n_params = 0
    with part_writer(path, "clip") as w:
        _write_clip_keys(w, c, preset, wt)
        for name, shape, init in _layout(c):
            v = _values(name, shape, init, seed)
            n_params += v.size
            small = len(shape) == 1 or "position_embd" in name or (projector == "gemma3" and "patch_embd" in name)
            if wt == "F16" and not small:
                v = v.astype(np.float16)
            w.add_tensor(name, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return dict(path=os.fspath(path), projector=projector, preset=preset, n_params=n_params, config=c)


# ---------------------------------------------------------------------------------------------
# a tiny vision-language model to pair with the tiny mmproj files

VISION_TOKENS = {
    "qwen35": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"),
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
}
_IMAGE_TEXT = {"qwen35": "<|vision_start|><|image_pad|><|vision_end|>", "gemma3": "<start_of_image>"}


def vision_chat_template(arch: str) -> str:
    """ChatML whose list contents render image parts as the model family's image mark."""
    img = _IMAGE_TEXT[arch]
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + img + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def write_vlm(path, arch: str, *, seed: int = 0, weight_type: str = "F32", template: str = "vision") -> dict:
    """engine.tools.synth's tiny `arch` model (qwen35 or gemma3) with the image tokens appended to its
    vocabulary (CONTROL tokens, so templates and prompts can name them) and, by default, an
    image-aware chat template."""
    from engine.tools import synth
    if arch not in VISION_TOKENS:
        raise ValueError(f"no vision tokens defined for {arch!r} (choose from {', '.join(VISION_TOKENS)})")
    cfg = synth.config_for(arch, "tiny", weight_type=weight_type)
    md = synth.metadata_for(cfg, seed)
    extra = VISION_TOKENS[arch]
    tokens, types, merges = synth.build_vocab(cfg.vocab_size - len(extra))
    tokens, types = tokens + list(extra), types + [int(TokenType.CONTROL)] * len(extra)
    md.update(synth.vocab_metadata(tokens, types, merges, eot=cfg.vocab_size - len(extra) - len(synth.SPECIAL_TOKENS)))
    md[Keys.General.NAME] = f"HiveJet synthetic {arch} tiny vision"
    if template == "vision":
        md[Keys.Tokenizer.CHAT_TEMPLATE] = vision_chat_template(arch)
    elif template != "chatml":
        raise ValueError("template must be 'vision' or 'chatml'")
    write_gguf(path, arch, md, synth.tensor_specs(cfg), seed, threads=1)
    return dict(path=os.fspath(path), arch=arch, vocab_size=cfg.vocab_size, image_tokens=extra, n_embd=cfg.n_embd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.synth_mmproj", description="write a synthetic mmproj GGUF")
    ap.add_argument("output")
    ap.add_argument("--projector", required=True, choices=PROJECTORS)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--weight-type", default="F32", choices=("F32", "F16"), type=str.upper)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    s = write_mmproj(a.output, a.projector, a.preset, seed=a.seed, weight_type=a.weight_type)
    print(f"wrote {s['path']}: {s['projector']} {s['preset']}, {s['n_params'] / 1e6:.1f}M params")
    return 0


if __name__ == "__main__":
    sys.exit(main())
