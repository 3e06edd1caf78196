"""Image requests on the GPU path's scheduling (engine/runner/runner.py's static slots, here on the CPU through
EngineConfig(static_slots=True)): the tokens and log-probabilities of one pass by hand (M-RoPE positions and
the rope delta of the decode rows after images for Qwen3.5, two-way image spans for Gemma 3), beside text
requests in the same steps, prefixes reused with images compared by content (follow-ups on both paths,
agents sharing an image), compressed KV caches, pre-emption under a tiny pool, a chunk longer than a step;
the runner's checks; and (marked gpu) the same on CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.runner import PromptInputs, Runner
from engine.sampling import SamplingParams
from engine.types import Request
from engine.vision.prompt import ImageSpan, VisionPrompt, mrope_positions
from tests.engine import test_vision_engine as vision_engine
from tests.engine.test_vision_engine import GREEDY, _manual_greedy, chat, engine, png

files = vision_engine.files   # (the tiny vision-language models: that module's fixture)

SLOTS = dict(static_slots=True, max_seqs=2, prefill_chunk=16, step_tokens=16, ctx_size=256)
IMAGE_MARK = {"gemma3": "<start_of_image>", "qwen35": "<|vision_start|><|image_pad|><|vision_end|>"}   # (raw prompts)


def _stream(h) -> tuple[list[int], list[float]]:
    got, lps = [], []
    for ev in h:
        if getattr(ev, "ids", None):
            got += ev.ids
            lps += [x.logprob for x in ev.logprobs]
    assert h.finish.error is None, h.finish.error
    return got, lps


def _cold(files, model, cfg, requests) -> list[list[int]]:
    """Each request's tokens from an engine of its own (nothing cached)."""
    out = []
    for r in requests:
        with engine(files, model, **cfg) as eng:
            out.append(eng.submit(r).result()[1])
    return out


@pytest.mark.parametrize("model", ["qwen35", "gemma3"])
def test_image_request_on_slots_matches_one_pass(files, model):
    """Two images in chunks of 16 (Qwen's cut across chunks; Gemma's read whole, attended both ways): the
    tokens and log-probabilities of one forward pass by hand on the CPU path's model."""
    req = dict(messages=chat("Say something about these.", 2), images=[png(64, 48, 1), png(30, 50, 2)],
               sampling=SamplingParams(**GREEDY, logprobs=0))
    with engine(files, model, **SLOTS) as eng:
        assert eng.runner is not None and eng.has_vision
        assert (eng.runner.rope_delta is not None) == (model == "qwen35")
        got, lps = _stream(eng.submit(Request(**req)))
        ref, ref_lps = _manual_greedy(eng, Request(**req), 6)
        assert got == ref
        assert np.allclose(lps, ref_lps, atol=1e-3), (lps, ref_lps)


@pytest.mark.parametrize("model", ["qwen35", "gemma3"])
def test_text_rows_of_an_image_prompt_take_the_padded_pass(files, model, monkeypatch):
    """With the padded prompt pass (on the GPU: its CUDA graphs; here eagerly, padded_prefill=True), the chunks
    of an image prompt that hold text alone take it (Qwen: with the slot's rope delta, M-RoPE positions past
    an image), the others run eagerly; the tokens and log-probabilities stay one pass by hand's."""
    init, deltas = Runner.__init__, []
    text_delta = Runner._text_rope_delta

    def padded(self, *a, **kw):
        kw.setdefault("padded_prefill", True)
        init(self, *a, **kw)
    monkeypatch.setattr(Runner, "__init__", padded)
    monkeypatch.setattr(Runner, "_text_rope_delta", lambda self, *a: deltas.append(text_delta(self, *a)) or deltas[-1])
    req = dict(messages=chat("Say something about these, and then some more about both of them.", 2),
               images=[png(64, 48, 1), png(30, 50, 2)], sampling=SamplingParams(**GREEDY, logprobs=0))
    with engine(files, model, **SLOTS) as eng:
        assert eng.runner.padded_prefill
        got, lps = _stream(eng.submit(Request(**req)))
        ref, ref_lps = _manual_greedy(eng, Request(**req), 6)
    assert got == ref and np.allclose(lps, ref_lps, atol=1e-3), (lps, ref_lps)
    assert None in deltas                                          # image chunks: eager
    taken = [d for d in deltas if d is not None]
    assert taken and (any(taken) if model == "qwen35" else set(taken) == {0})   # text chunks: the padded pass


def test_text_rope_delta_only_for_rows_without_images(files):
    """Runner._text_rope_delta: plain positions plus one delta on every axis, no image rows, none attended
    both ways; and a delta only where the runner keeps one per slot."""
    with engine(files, "qwen35", **SLOTS) as eng:
        r = eng.runner
        plain = torch.arange(10, 14)
        assert r._text_rope_delta(PromptInputs(None, None, None, 0), 10, 4) == 0
        assert r._text_rope_delta(PromptInputs((plain - 3)[:, None].expand(-1, 3), None, None, -3), 10, 4) == -3
        assert r._text_rope_delta(PromptInputs(plain - 3, None, None, -3), 10, 4) == -3
        bent = (plain - 3)[:, None].repeat(1, 3)
        bent[2, 1] += 1                                            # an image row's (t, h, w)
        assert r._text_rope_delta(PromptInputs(bent, None, None, -3), 10, 4) is None
        emb = (torch.tensor([0]), torch.zeros(1, eng.model.spec.n_embd))
        assert r._text_rope_delta(PromptInputs(None, emb, None, 0), 10, 4) is None
        assert r._text_rope_delta(PromptInputs(None, None, [(10, 12)], 0), 10, 4) is None
        r.rope_delta = None
        assert r._text_rope_delta(PromptInputs(plain - 3, None, None, -3), 10, 4) is None


@pytest.mark.parametrize("model", ["qwen35", "gemma3"])
def test_images_beside_text(files, model):
    """An image request and a text request in the same steps give what each gives alone, and so does the
    image request again after both were parked (Qwen: a recurrent model reuses a parked conversation only
    whole, which this one is not; Gemma: all but the last token, images compared by content)."""
    img = dict(messages=chat("What is this?"), images=[png(48, 40, 3)], sampling=SamplingParams(**GREEDY))
    text = dict(prompt="The quick brown fox jumps over the lazy dog. " * 3, sampling=SamplingParams(**GREEDY))
    with engine(files, model, **SLOTS) as eng:
        alone_img = eng.submit(Request(**img)).result()[1]
        alone_text = eng.submit(Request(**text)).result()[1]
        assert len(eng.slots.parked) == 2
        hs = [eng.submit(Request(**img)), eng.submit(Request(**text))]
        (_, a, fa), (_, b, _) = [h.result() for h in hs]
        assert (a, b) == (alone_img, alone_text)
        n = len(eng.prompt_ids(Request(**img)))
        assert fa.usage.cached_tokens == (0 if model == "qwen35" else n - 1)


@pytest.mark.parametrize("model,slots", [("gemma3", True), ("qwen35", False)])
def test_follow_up_reuses_images_by_content(files, model, slots):
    """A request with the same image, the same text after it and another question reuses the finished
    conversation past the image; one with another image of the same size only up to that image's first
    token; each gets the tokens a cold engine gives it. Gemma 3 on the GPU path's scheduling (a parked
    conversation, reused in part); Qwen3.5 on the CPU path (a resident one, from a state checkpoint; the
    GPU path reuses a recurrent model's parked conversation only whole)."""
    mark = IMAGE_MARK[model]

    def req(image_seed, question):
        return Request(prompt=f"Look: {mark} {'We share this context. ' * 6}{question}",
                       images=[png(48, 40, image_seed)], sampling=SamplingParams(**GREEDY))
    cfg = {**SLOTS, "max_seqs": 1} if slots else dict(ctx_size=256, prefill_chunk=16)
    later = [req(3, "What colour dominates?"), req(4, "Describe it.")]
    cold = _cold(files, model, cfg, later)
    with engine(files, model, **cfg) as eng:
        eng.submit(req(3, "Describe it.")).result()
        span = eng._tokenize(req(3, "Describe it."))[1].spans[0]
        _, same, f_same = eng.submit(later[0]).result()
        assert f_same.usage.cached_tokens >= span.end and same == cold[0]
        _, other, f_other = eng.submit(later[1]).result()
        assert f_other.usage.cached_tokens <= span.start and other == cold[1]


@pytest.mark.parametrize("model", ["gemma3", "qwen35"])
def test_agents_share_an_image_prefix(files, model):
    """Two agents with the same instructions and the same image, then different questions: the second,
    arriving while the first decodes, takes the first's blocks (Qwen: and its recurrent states, from a
    checkpoint) in whole chunks of 16 past the image, and gets the tokens a cold engine gives it; an agent
    with another image of the same size shares only what comes before that image. (Gemma's image, read
    whole, ends the chunk grid unless it starts on a chunk's start: there the sharing stops before it.)"""
    mark = IMAGE_MARK[model]

    def req(image_seed, question, n=6):
        return Request(prompt=f"{'You are a careful assistant. ' * 3}{mark} {'Shared notes follow. ' * 4}{question}",
                       images=[png(48, 40, image_seed)],
                       sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    cfg = {**SLOTS, "state_checkpoints": 8}
    later = [req(3, "What colour dominates?"), req(4, "What colour dominates?")]
    cold = _cold(files, model, cfg, later)
    with engine(files, model, **cfg) as eng:
        span = eng._tokenize(later[0])[1].spans[0]
        for r, want, shared in zip(later, cold, (True, False)):
            first = eng.submit(req(3, "Describe it.", n=4000))
            next(iter(first))                                 # decoding now: a running donor
            _, got, fin = eng.submit(r).result()
            first.cancel()
            first.result()
            assert got == want
            if shared:
                past = span.end if model == "qwen35" else span.start // 16 * 16
                assert fin.usage.cached_tokens >= past and fin.usage.cached_tokens % 16 == 0
            else:
                assert 0 < fin.usage.cached_tokens <= span.start
            assert eng.stats()["totals"]["shared_tokens"] > 0


def test_image_request_on_slots_with_compressed_kv(files):
    """Gemma's two-way image span over turbo3 keys (preconditioned) and q8_0 values: the CPU path's engine
    with the same cache types gives the same greedy tokens (their log-probabilities differ by up to ~0.2 here,
    for text prompts too: the two paths quantize and attend over compressed rows their own ways)."""
    req = dict(messages=chat("Describe it."), images=[png(40, 56, 4)],
               sampling=SamplingParams(**GREEDY, logprobs=0))
    kv = dict(cache_type_k="turbo3", cache_type_v="q8_0")
    with engine(files, "gemma3", **kv) as eng:
        ref, ref_lps = _stream(eng.submit(Request(**req)))
    with engine(files, "gemma3", **SLOTS, **kv) as eng:
        got, lps = _stream(eng.submit(Request(**req)))
    assert got == ref and len(lps) == len(ref_lps) == 6


def test_prompt_inputs_are_checked(files):
    with engine(files, "gemma3") as eng:
        r = Runner(eng.model, device="cpu", n_slots=1, max_ctx=64)
        E = eng.spec.n_embd
        with pytest.raises(ValueError, match="RoPE positions"):
            r.prefill(0, [1, 2, 3], inputs=PromptInputs(positions=torch.zeros(2, dtype=torch.long)))
        with pytest.raises(ValueError, match="image embeddings"):
            r.prefill(0, [1, 2, 3], inputs=PromptInputs(embeds=(torch.tensor([3]), torch.zeros(1, E))))
        with pytest.raises(ValueError, match="rope delta"):
            r.prefill(0, [1, 2, 3], inputs=PromptInputs(rope_delta=-2))


def test_chunk_inputs_past_the_prompt():
    """A pre-empted sequence reads its generated tokens again as prompt chunks: their M-RoPE positions follow
    the prompt's (index + pos_delta on every axis)."""
    spans = [ImageSpan(2, 6, 2, 3, "a")]
    vp = VisionPrompt(spans, 10, embeds=[torch.zeros(6, 4)])
    vp.positions, vp.pos_delta = mrope_positions(10, spans)
    pos, emb, _ = vp.chunk_inputs(8, 13)
    assert pos.tolist() == [[5, 5, 5], [6, 6, 6], [7, 7, 7], [8, 8, 8], [9, 9, 9]]   # (delta -3)
    assert emb is None
    pos, emb, _ = vp.chunk_inputs(0, 12)
    assert pos.shape == (12, 3) and emb[0].tolist() == list(range(2, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen35", "gemma3"])
def test_image_request_on_the_gpu(files, model):
    """device="cuda" (encoder, Triton kernels, CUDA graphs for the decode rows with the rope delta): the
    greedy tokens of the CPU path's engine for two images, an image request beside a text one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    req = dict(messages=chat("Say something about these.", 2), images=[png(64, 48, 1), png(30, 50, 2)],
               sampling=SamplingParams(**GREEDY))
    text = dict(prompt="The quick brown fox jumps over the lazy dog.", sampling=SamplingParams(**GREEDY))
    with engine(files, model) as eng:
        ref = [eng.submit(Request(**r)).result()[1] for r in (req, text)]
    with engine(files, model, device="cuda", max_seqs=2, prefill_chunk=16, ctx_size=256) as eng:
        assert eng.vision.device.type == "cuda"
        hs = [eng.submit(Request(**r)) for r in (req, text)]
        assert [h.result()[1] for h in hs] == ref


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen35", "gemma3"])
def test_image_prompt_text_chunks_in_graphs_on_the_gpu(files, model, monkeypatch):
    """device="cuda": the chunks of an image prompt that hold text alone run through the captured padded pass
    (Qwen: with the slot's rope delta past the images); the greedy tokens stay the CPU path's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    req = dict(messages=chat("Say something about these, and then some more about both of them.", 2),
               images=[png(64, 48, 1), png(30, 50, 2)], sampling=SamplingParams(**GREEDY))
    with engine(files, model) as eng:
        ref = eng.submit(Request(**req)).result()[1]
    deltas, text_delta = [], Runner._text_rope_delta
    monkeypatch.setattr(Runner, "_text_rope_delta", lambda self, *a: deltas.append(text_delta(self, *a)) or deltas[-1])
    with engine(files, model, device="cuda", max_seqs=2, prefill_chunk=16, ctx_size=256) as eng:
        assert eng.runner.padded_prefill
        assert eng.submit(Request(**req)).result()[1] == ref
    taken = [d for d in deltas if d is not None]
    assert None in deltas and taken and (any(taken) if model == "qwen35" else set(taken) == {0})


def test_image_chunk_longer_than_a_step_runs_beside_decoding(files, tmp_path, monkeypatch):
    """GPU path's scheduling: a Gemma image of 64 tokens (read whole) is longer than a step's room (prefill
    chunks of 16, steps of 16 rows): it runs as the step's first chunk beside another request's decode rows
    instead of waiting for that request to end."""
    import dataclasses

    from engine.tools import synth_mmproj
    big = dataclasses.replace(synth_mmproj.PRESETS[("gemma3", "tiny")], pool=1)       # 8 x 8 = 64 tokens
    monkeypatch.setitem(synth_mmproj.PRESETS, ("gemma3", "pool1"), big)
    mm = synth_mmproj.write_mmproj(tmp_path / "mmproj-pool1.gguf", "gemma3", "pool1")["path"]
    with engine(files, "gemma3", mmproj=mm, **SLOTS) as eng:
        busy = eng.submit(Request(prompt="hello", sampling=SamplingParams(max_tokens=4000, ignore_eos=True,
                                                                           temperature=0.0)))
        next(iter(busy))                                     # decoding now
        img = Request(messages=chat(), images=[png(40, 40)], sampling=SamplingParams(**GREEDY))
        assert eng._tokenize(img)[1].spans[0].n_tokens == 64
        _, out, fin = eng.submit(img).result()
        assert fin.error is None and len(out) == 6
        assert eng.stats()["running"] == 1                   # the other one is still going
        busy.cancel()


@pytest.mark.parametrize("model", ["qwen35", "gemma3"])
def test_image_requests_preempted_under_a_tiny_pool(files, model):
    """Four image requests in a pool of 10 blocks, too small for all of them: the newest running ones are
    pre-empted mid-generation and read again later (prompt with its images and M-RoPE positions, then their
    generated tokens, as prompt chunks); each gets what it gets alone (up to its first near tie), and the
    pool is empty at the end."""
    from engine.types import FinishEvent

    def req(i, **sampling):
        return Request(messages=chat(f"Image {i}: what is it?"), images=[png(48, 40, 10 + i)],
                       sampling=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **sampling))

    def run(eng, i):
        ids, gaps = [], []
        for ev in eng.submit(req(i, logprobs=2)):
            if not isinstance(ev, FinishEvent):
                ids += ev.ids
                gaps += [lp.top[0][1] - lp.top[1][1] for lp in ev.logprobs]
        return ids, gaps
    cfg = {**SLOTS, "max_seqs": 4, "resident_tokens": 0}
    with engine(files, model, **cfg) as eng:
        solo = [run(eng, i) for i in range(4)]
    with engine(files, model, **cfg, ctx_pool_tokens=160) as eng:
        generated, preempt = [], eng._preempt

        def record(s):
            generated.append(s.n_generated)
            preempt(s)
        eng._preempt = record
        hs = [eng.submit(req(i)) for i in range(4)]
        for h, (want, gaps) in zip(hs, solo):
            got = h.result()[1]
            tie = next((i for i, g in enumerate(gaps) if g < 1e-3), len(want))
            assert len(got) == len(want) and got[:tie] == want[:tie]
        assert max(generated, default=0) > 0             # pre-empted mid-generation (at least once)
        assert eng.stats()["kv_pool"]["used"] == 0
