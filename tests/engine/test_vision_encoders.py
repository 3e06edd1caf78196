"""Vision encoders from mmproj files against Hugging Face transformers (Qwen3_5VisionModel; SiglipVisionModel
+ Gemma3MultiModalProjector) with the same weights, and whole vision-language forwards (image embeddings
spliced in, Qwen's M-RoPE image positions, Gemma's bidirectional image attention) against
Qwen3_5ForConditionalGeneration / Gemma3ForConditionalGeneration. Tiny synthetic F32 files, float32 math."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.gguf.reader import GGUFError
from engine.models.common import SeqChunk
from engine.types import EngineError, Request
from engine.vision import MmprojError, check_pair, mmproj_info, open_mmproj
from engine.tools.synth_mmproj import write_mmproj, write_vlm

transformers = pytest.importorskip("transformers")
from tests.engine import vision_hf  # noqa: E402

TOL = 1e-4   # float32: observed differences are ~2e-6 on values of magnitude ~3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision")
    return dict(dir=d, mm_qwen=write_mmproj(d / "mmproj-qwen.gguf", "qwen3vl_merger")["path"],
                mm_gemma=write_mmproj(d / "mmproj-gemma.gguf", "gemma3")["path"],
                qwen35=write_vlm(d / "qwen35-vlm.gguf", "qwen35")["path"],
                gemma3=write_vlm(d / "gemma3-vlm.gguf", "gemma3")["path"])


def random_image(w, h, seed=0):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("size", [(112, 80), (32, 64), (48, 48)])
def test_qwen3vl_encoder_matches_hf(files, size):
    enc = open_mmproj(files["mm_qwen"])
    hf, cfg = vision_hf.qwen_vision(files["mm_qwen"])
    prep = enc.prepare(random_image(*size))
    H, W = prep.pixels.shape[1:]
    assert H % 16 == 0 and W % 16 == 0 and (prep.rows, prep.cols) == (H // 16, W // 16)
    ours = enc.encode(prep)
    pv, grid = vision_hf.qwen_pixel_values(prep.pixels, enc.patch)
    with torch.no_grad():
        ref = hf(hidden_states=pv, grid_thw=grid).pooler_output
    assert ours.shape == ref.shape == (prep.rows * prep.cols, 128)
    assert max_diff(ours, ref) < TOL, max_diff(ours, ref)
    enc.close()


@pytest.mark.parametrize("resize", ["letterbox", "stretch"])
def test_gemma3_encoder_matches_hf(files, resize):
    enc = open_mmproj(files["mm_gemma"], resize=resize)
    tower, proj, _ = vision_hf.siglip_vision(files["mm_gemma"])
    prep = enc.prepare(random_image(112, 80))
    assert tuple(prep.pixels.shape) == (3, 32, 32) and (prep.rows, prep.cols) == (4, 4)
    ours = enc.encode(prep)
    with torch.no_grad():
        ref = proj(tower(pixel_values=prep.pixels[None]).last_hidden_state)[0]
    assert ours.shape == ref.shape == (16, 128)
    assert max_diff(ours, ref) < TOL, max_diff(ours, ref)
    enc.close()


def test_f16_mmproj_close_to_f32(files):
    p16 = write_mmproj(files["dir"] / "q16.gguf", "qwen3vl_merger", weight_type="F16")["path"]
    e32, e16 = open_mmproj(files["mm_qwen"]), open_mmproj(p16)
    prep = e32.prepare(random_image(64, 64))
    a, b = e32.encode(prep), e16.encode(prep)
    assert max_diff(a, b) / a.abs().max().item() < 1e-2
    info = mmproj_info(p16)
    assert info["projector"] == "qwen3vl_merger" and info["n_bytes"] < mmproj_info(files["mm_qwen"])["n_bytes"]
    e16.close()
    assert e16.facts == info and e16.facts["workspace_bytes"] > 0   # (from the header in memory, after close)
    e32.close()


def _engine(files, arch, **kw):
    proj = "mm_qwen" if arch == "qwen35" else "mm_gemma"
    return Engine(EngineConfig(model=files[arch], mmproj=files[proj], threads=1, **kw))


def _forward_with_images(eng, req):
    """Our model's logits for every prompt row, one pass, images encoded as the engine does."""
    ids, vp = eng._tokenize(req)
    vp.embeds = [eng.vision.encode(s.image) for s in vp.spans]
    pos, emb, bidir = vp.chunk_inputs(0, len(ids))
    kv = eng.model.new_kv(torch.float32)
    (logits,) = eng.model.forward([SeqChunk(torch.tensor(ids), 0, kv, "all", positions=pos, embeds=emb,
                                            bidirectional=bidir)])
    return ids, vp, logits


def _chat(images=2):
    parts = [{"type": "text", "text": "Look at this: "}, {"type": "image"}, {"type": "text", "text": " and this "}]
    if images == 2:
        parts.append({"type": "image"})
    parts.append({"type": "text", "text": ". Which is bigger?"})
    return [{"role": "system", "content": "You see images."}, {"role": "user", "content": parts}]


def test_qwen35_vision_language_logits_match_hf(files):
    eng = _engine(files, "qwen35")
    try:
        tok = eng.tokenizer
        imgs = [random_image(112, 80, 1), random_image(40, 72, 2)]
        ids, vp, ours = _forward_with_images(eng, Request(messages=_chat(), images=imgs))
        pad = tok.token_to_id("<|image_pad|>")
        assert [(s.rows, s.cols) for s in vp.spans] == [(5, 7), (4, 2)]
        assert sum(1 for t in ids if t == pad) == 35 + 8
        hf = vision_hf.qwen_vlm(files["qwen35"], files["mm_qwen"], pad,
                                tok.token_to_id("<|vision_start|>"), tok.token_to_id("<|vision_end|>"))
        pvs, grids = zip(*(vision_hf.qwen_pixel_values(s.image.pixels, 8) for s in vp.spans))
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            out = hf(input_ids=ids_t, pixel_values=torch.cat(pvs), image_grid_thw=torch.cat(grids),
                     mm_token_type_ids=(ids_t == pad).int(), use_cache=False)
            ref_pos, delta = hf.model.get_rope_index(ids_t, (ids_t == pad).int(), torch.cat(grids))
        assert torch.equal(vp.positions.T, ref_pos[:, 0]), "M-RoPE positions differ from HF get_rope_index"
        assert vp.pos_delta == int(delta)
        assert max_diff(ours, out.logits[0]) < TOL, max_diff(ours, out.logits[0])
    finally:
        eng.shutdown()


def test_gemma3_vision_language_logits_match_hf(files):
    eng = _engine(files, "gemma3")
    try:
        tok = eng.tokenizer
        soft, boi, eoi = (tok.token_to_id(t) for t in ("<image_soft_token>", "<start_of_image>", "<end_of_image>"))
        imgs = [random_image(112, 80, 1), random_image(30, 30, 2)]
        ids, vp, ours = _forward_with_images(eng, Request(messages=_chat(), images=imgs))
        assert sum(1 for t in ids if t == soft) == 32 and vp.bidirectional and vp.positions is None
        text = tok.decode(ids)
        assert "\n\n<start_of_image>" in text and "<end_of_image>\n\n" in text   # as Gemma3Processor writes it
        hf = vision_hf.gemma_vlm(files["gemma3"], files["mm_gemma"], soft, boi, eoi)
        ids_t = torch.tensor([ids])
        pixels = torch.stack([s.image.pixels for s in vp.spans])
        with torch.no_grad():
            out = hf(input_ids=ids_t, pixel_values=pixels, token_type_ids=(ids_t == soft).long(), use_cache=False)
        assert max_diff(ours, out.logits[0]) < TOL, max_diff(ours, out.logits[0])
        # and the mask matters: the same rows computed causally differ
        pos, emb, _ = vp.chunk_inputs(0, len(ids))
        (causal,) = eng.model.forward([SeqChunk(torch.tensor(ids), 0, eng.model.new_kv(torch.float32), "all",
                                                embeds=emb)])
        assert max_diff(causal, ours) > 1e-3
    finally:
        eng.shutdown()


def test_projector_errors(files, tmp_path):
    # a language model given as the projector
    with pytest.raises(MmprojError, match="not a vision projector"):
        open_mmproj(files["qwen35"])
    # an unsupported projector type
    bad = tmp_path / "llava.gguf"
    w = gguf.GGUFWriter(str(bad), "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("mlp")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 3, 2, 2), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(MmprojError, match="'mlp' is not supported yet"):
        open_mmproj(bad)
    assert not mmproj_info(bad)["supported"]
    # a projector for the other family, and the engine's refusal
    enc = open_mmproj(files["mm_gemma"])
    with pytest.raises(MmprojError, match="gemma3 projector belongs to a gemma3 model"):
        check_pair(enc, "qwen35", 128)
    with pytest.raises(MmprojError, match="256 wide"):
        check_pair(enc, "gemma3", 256)
    enc.close()
    with pytest.raises(EngineError, match="vision projector"):
        Engine(EngineConfig(model=files["qwen35"], mmproj=files["mm_gemma"], threads=1))
    with pytest.raises(GGUFError):
        open_mmproj(tmp_path / "missing.gguf")


@pytest.mark.parametrize("size", [(112, 80), (300, 77), (20, 20), (640, 480)])
def test_preprocessing_matches_hf_image_processors(files, size):
    """Qwen: smart resize (bicubic) + normalize + patch layout = Qwen2VLImageProcessorPil, exactly.
    Gemma's "stretch" mode = Gemma3ImageProcessorPil (the default "letterbox" mode is llama.cpp's)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    img = random_image(*size)
    enc = open_mmproj(files["mm_qwen"])
    hf = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, size={"shortest_edge": enc.min_pixels,
                                                            "longest_edge": enc.max_pixels})
    ref = hf(images=[img], return_tensors="pt")
    prep = enc.prepare(img)
    pv, grid = vision_hf.qwen_pixel_values(prep.pixels, 8)
    assert torch.equal(grid, ref["image_grid_thw"]) and max_diff(pv, ref["pixel_values"]) == 0.0
    genc = open_mmproj(files["mm_gemma"], resize="stretch")
    gref = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    assert max_diff(genc.prepare(img).pixels, gref(images=[img], return_tensors="pt")["pixel_values"][0]) == 0.0
    enc.close(), genc.close()
