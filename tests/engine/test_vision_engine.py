"""Image requests end to end through Engine.submit on tiny synthetic vision-language models (qwen35 +
qwen3vl_merger, gemma3 + gemma3): image token counts and positions, completions, chunked prefill around
images, the embedding cache, and the refusals (bad images, models that cannot see)."""
from __future__ import annotations

import base64
import io
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from engine.engine import Engine, EngineConfig
from engine.models.common import SeqChunk
from engine.sampling import SamplingParams
from engine.types import EngineError, Request
from engine.vision import ImageError, smart_resize
from engine.vision.prompt import ImageSpan, VisionPrompt
from engine.tools.synth_mmproj import write_mmproj, write_vlm


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision_engine")
    return dict(dir=d, mm_qwen=write_mmproj(d / "mmproj-qwen.gguf", "qwen3vl_merger")["path"],
                mm_gemma=write_mmproj(d / "mmproj-gemma.gguf", "gemma3")["path"],
                qwen35=write_vlm(d / "qwen35-vlm.gguf", "qwen35")["path"],
                gemma3=write_vlm(d / "gemma3-vlm.gguf", "gemma3")["path"],
                qwen35_chatml=write_vlm(d / "qwen35-chatml.gguf", "qwen35", template="chatml")["path"])


def png(w, h, seed=0) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def engine(files, model="qwen35", **kw) -> Engine:
    mm = {"qwen35": "mm_qwen", "qwen35_chatml": "mm_qwen", "gemma3": "mm_gemma"}[model]
    kw.setdefault("mmproj", files[mm])
    return Engine(EngineConfig(model=files[model], threads=1, **kw))


def chat(text="What is in the picture?", n_images=1):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_qwen_image_request(files):
    with engine(files) as eng:
        assert eng.has_vision and eng.supports_images and eng.stats()["vision"]["projector"] == "qwen3vl_merger"
        text_only = len(eng.prompt_ids(Request(messages=[{"role": "user", "content": "What is in the picture?"}])))
        img = png(100, 60)
        req = Request(messages=chat(), images=[img], sampling=SamplingParams(**GREEDY))
        h, w = smart_resize(60, 100, 16, 1024, 16384)            # the tiny projector: patch 8 x merge 2
        rows, cols = h // 16, w // 16
        ids, vp = eng._tokenize(req)
        pad = eng.tokenizer.token_to_id("<|image_pad|>")
        assert ids.count(pad) == rows * cols == vp.spans[0].n_tokens
        # <|vision_start|> + pads + <|vision_end|> in the template's place
        s = vp.spans[0]
        assert ids[s.start - 1] == eng.tokenizer.token_to_id("<|vision_start|>")
        assert ids[s.end] == eng.tokenizer.token_to_id("<|vision_end|>")
        assert len(ids) == text_only + 2 + rows * cols
        # M-RoPE: (t, h, w) = (p, p + row, p + col); the text after continues at p + max(rows, cols)
        p = s.start
        assert vp.positions[:p].tolist() == [[i] * 3 for i in range(p)]
        assert vp.positions[s.start + cols + 1].tolist() == [p, p + 1, p + 1]
        assert vp.positions[s.end - 1].tolist() == [p, p + rows - 1, p + cols - 1]
        assert vp.positions[s.end].tolist() == [p + max(rows, cols)] * 3
        assert vp.pos_delta == max(rows, cols) - rows * cols
        text, out, fin = eng.submit(req).result()
        assert fin.reason == "length" and fin.error is None and len(out) == 6 and text
        assert fin.usage.prompt_tokens == len(ids)
        assert fin.timings.image_encode_ms > 0
        assert eng.stats()["totals"]["images_encoded"] == 1


def _manual_greedy(eng, req, n):
    """The same request by hand, independently of the engine's chunking and position bookkeeping:
    one forward over the whole prompt (image rows from the encoder; Gemma: each image's span
    bidirectional), then token by token at M-RoPE position max(prompt positions) + 1 + i (HF's
    continuation rule). Returns (tokens, log-probabilities of the chosen tokens)."""
    ids, vp = eng._tokenize(req)
    embeds = [eng.vision.encode(s.image) for s in vp.spans]
    rows = torch.cat([torch.arange(s.start, s.end) for s in vp.spans])
    bidir = [(s.start, s.end) for s in vp.spans] if eng.vision.projector == "gemma3" else None
    kv = eng.model.new_kv()
    (lg,) = eng.model.forward([SeqChunk(torch.tensor(ids), 0, kv, "last", positions=vp.positions,
                                        embeds=(rows, torch.cat(embeds)), bidirectional=bidir)])
    out, lps = [], []
    nxt = int(vp.positions.max()) + 1 if vp.positions is not None else None
    for i in range(n):
        lp = torch.log_softmax(lg[-1].float(), 0)
        out.append(int(lp.argmax()))
        lps.append(float(lp[out[-1]]))
        k = len(ids) + i
        p = torch.tensor([nxt + i]) if nxt is not None else None
        (lg,) = eng.model.forward([SeqChunk(torch.tensor(out[-1:]), k, kv, "last", positions=p)])
    return out, lps


@pytest.mark.parametrize("model", ["qwen35", "gemma3"])
def test_chunked_engine_matches_one_pass(files, model):
    """Prefill in chunks of 8 (Qwen's image split across chunks; Gemma's kept whole because its tokens
    attend both ways) and decode with M-RoPE deltas: the same tokens and log-probabilities as one
    pass by hand."""
    req = dict(messages=chat("Say something about these.", 2), images=[png(64, 48, 1), png(30, 50, 2)],
               sampling=SamplingParams(**GREEDY, logprobs=0))
    with engine(files, model, prefill_chunk=8, step_tokens=8) as eng:
        h = eng.submit(Request(**req))
        got, lps = [], []
        for ev in h:
            if getattr(ev, "ids", None):
                got += ev.ids
                lps += [x.logprob for x in ev.logprobs]
        assert h.finish.error is None
        ref, ref_lps = _manual_greedy(eng, Request(**req), 6)
        assert got == ref
        assert np.allclose(lps, ref_lps, atol=1e-4), (lps, ref_lps)


def test_gemma_image_layout(files):
    with engine(files, "gemma3") as eng:
        ids, vp = eng._tokenize(Request(messages=chat(n_images=2), images=[png(50, 40), png(40, 50, 1)]))
        tok = eng.tokenizer
        soft = tok.token_to_id("<image_soft_token>")
        assert ids.count(soft) == 32 and [s.n_tokens for s in vp.spans] == [16, 16]
        assert vp.positions is None and vp.bidirectional
        for s in vp.spans:
            assert ids[s.start - 1] == tok.token_to_id("<start_of_image>") and ids[s.end] == tok.token_to_id("<end_of_image>")
        # chunks never cut an image: before it, or the whole image at once
        s = vp.spans[0]
        assert vp.chunk_end(0, s.start + 3) == s.start
        assert vp.chunk_end(s.start, s.start + 3) == s.end
        assert vp.chunk_end(0, s.start) == s.start
        text, out, fin = eng.submit(Request(messages=chat(), images=[png(50, 40)], sampling=SamplingParams(**GREEDY))).result()
        assert fin.error is None and len(out) == 6


def test_template_without_images_and_raw_prompts(files):
    """A chat template that knows nothing of images gets the model's image mark in the text; a raw
    prompt names the image's place with that mark."""
    img = png(64, 64)
    with engine(files, "qwen35_chatml") as eng:
        ids, vp = eng._tokenize(Request(messages=chat("Hi"), images=[img]))
        assert len(vp.spans) == 1
        assert eng.tokenizer.decode(ids[:vp.spans[0].start]).endswith("user\n<|vision_start|>")
        r = Request(prompt="Picture: <|vision_start|><|image_pad|><|vision_end|> says", images=[img],
                    sampling=SamplingParams(**GREEDY))
        _, out, fin = eng.submit(r).result()
        assert fin.error is None and len(out) == 6
        with pytest.raises(ImageError, match="put <\\|vision_start\\|><\\|image_pad\\|><\\|vision_end\\|>"):
            eng.submit(Request(prompt="no mark here", images=[img]))


def test_images_carried_in_message_parts(files):
    """What the API server sends: OpenAI image_url parts with data: URLs, Anthropic base64 sources."""
    data = png(48, 48)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with engine(files) as eng:
        a = eng._tokenize(Request(messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look "}, {"type": "image_url", "image_url": {"url": url}}]}]))
        b = eng._tokenize(Request(messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(data).decode()}}]}]))
        c = eng._tokenize(Request(messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look "}, {"type": "image"}]}], images=[data]))
        assert a[0] == b[0] == c[0]
        assert a[1].hashes == b[1].hashes == c[1].hashes
        # no image parts: Request.images go at the start of the last user message
        d = eng._tokenize(Request(messages=[{"role": "user", "content": "Look"}], images=[data]))
        assert len(d[1].spans) == 1


def test_refusals(files):
    with engine(files) as eng:
        for bad, msg in ((b"\x89PNG\r\n\x1a\nnot really", "damaged"), (b"GIF89a", "damaged|not a"),
                         (b"just text", "not a PNG, JPEG, WebP, GIF or BMP")):
            with pytest.raises(ImageError, match=msg):
                eng.submit(Request(messages=chat(), images=[bad]))
        with pytest.raises(ImageError, match="image 2:"):
            eng.submit(Request(messages=chat(n_images=2), images=[png(20, 20), b"nope"]))
        with pytest.raises(ImageError, match="2 image part"):
            eng.submit(Request(messages=chat(n_images=2), images=[png(20, 20)]))
        with pytest.raises(ImageError, match="without image data"):
            eng.submit(Request(messages=chat()))
        with pytest.raises(ImageError, match="image mark"):   # a mark typed in the text
            eng.submit(Request(messages=chat("<|vision_start|><|image_pad|><|vision_end|>"), images=[png(20, 20)]))
        with pytest.raises(EngineError, match="not prompt_ids"):
            eng.submit(Request(prompt_ids=[1, 2, 3], images=[png(20, 20)]))
        assert eng.stats()["running"] == 0
    with Engine(EngineConfig(model=files["qwen35"], threads=1)) as eng:
        assert not eng.has_vision and eng.stats()["vision"] is None
        with pytest.raises(EngineError, match="cannot see images"):
            eng.submit(Request(messages=chat(), images=[png(20, 20)]))
        with pytest.raises(EngineError, match="cannot see images"):
            eng.prompt_ids(Request(messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]))


def test_embedding_cache_and_concurrency(files):
    imgs = [png(64, 48, 5), png(48, 64, 6)]

    def req(i):
        return Request(messages=chat(f"Request {i}"), images=[imgs[i]], sampling=SamplingParams(**GREEDY))
    with engine(files) as eng:
        alone = [eng.submit(req(i)).result()[1] for i in range(2)]
        assert eng.stats()["totals"]["images_encoded"] == 2
        hs = [eng.submit(req(i)) for i in range(2)]          # both at once, and both images cached now
        assert [h.result()[1] for h in hs] == alone
        assert eng.stats()["totals"]["images_encoded"] == 2


def test_mmproj_auto_pairing(files, tmp_path):
    shutil.copy(files["qwen35"], tmp_path / "Qwen3.5-Tiny-Q4_K_M.gguf")
    with Engine(EngineConfig(model=str(tmp_path / "Qwen3.5-Tiny-Q4_K_M.gguf"), mmproj="auto", threads=1)) as eng:
        assert not eng.has_vision                              # nothing beside it
    shutil.copy(files["mm_qwen"], tmp_path / "mmproj-Qwen3.5-Tiny-F16.gguf")
    shutil.copy(files["mm_gemma"], tmp_path / "mmproj-other-model-f16.gguf")
    with Engine(EngineConfig(model=str(tmp_path / "Qwen3.5-Tiny-Q4_K_M.gguf"), mmproj="auto", threads=1)) as eng:
        assert eng.has_vision and eng.vision.projector == "qwen3vl_merger"


def test_vision_prompt_positions_unit():
    spans = [ImageSpan(2, 6, 2, 3, "a"), ImageSpan(10, 4, 4, 1, "b")]
    vp = VisionPrompt(spans, 14)
    from engine.vision.prompt import mrope_positions
    pos, delta = mrope_positions(14, spans)
    assert pos.tolist() == [[0, 0, 0], [1, 1, 1],
                            [2, 2, 2], [2, 2, 3], [2, 2, 4], [2, 3, 2], [2, 3, 3], [2, 3, 4],
                            [5, 5, 5], [6, 6, 6],
                            [7, 7, 7], [7, 8, 7], [7, 9, 7], [7, 10, 7]]
    assert delta == 11 - 14
    vp.positions, vp.pos_delta = pos, delta
    assert vp.generated_positions(14, 16).tolist() == [11, 12]


def test_image_chunk_longer_than_a_step_is_not_starved(files):
    """A Gemma image (16 tokens, read in one piece) is longer than a whole step (12 rows): it still runs
    beside another request's decode rows instead of waiting for that request to end."""
    with engine(files, "gemma3", prefill_chunk=8, step_tokens=12) as eng:
        busy = eng.submit(Request(prompt="hello", sampling=SamplingParams(max_tokens=4000, ignore_eos=True,
                                                                           temperature=0.0)))
        next(iter(busy))                                     # decoding now
        _, out, fin = eng.submit(Request(messages=chat(), images=[png(40, 40)],
                                         sampling=SamplingParams(**GREEDY))).result()
        assert fin.error is None and len(out) == 6
        assert eng.stats()["running"] == 1                   # the other one is still going
        busy.cancel()
