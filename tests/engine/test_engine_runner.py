"""The Engine stepping through engine/runner.py (the GPU path's static slots), on the CPU with the
real demo model: same greedy tokens as the CPU path, several requests at once in one decode call,
slots freed and reused, chunked prompts, clear errors. On a GPU the same with device="cuda"."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.types import EngineError, Request


def _greedy(n=16, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def _chat(text):
    return [{"role": "user", "content": text}]


PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime.",
           "What is the capital of France?"]


@pytest.fixture(scope="module")
def cpu_tokens(smollm2_path):
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=512))
    try:
        return [eng.submit(Request(messages=_chat(p), sampling=_greedy(12, ignore_eos=True))).result()[1]
                for p in PROMPTS]
    finally:
        eng.shutdown()


def test_slots_engine_matches_cpu_path(smollm2_path, cpu_tokens):
    # prefill_chunk 16: prompts (30-40 tokens) take several chunks, cut at multiples of 16 like the CPU path
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=512, static_slots=True, max_seqs=2,
                              prefill_chunk=16))
    try:
        assert eng.runner is not None and eng.ctx_size == 512
        solo = [eng.submit(Request(messages=_chat(p), sampling=_greedy(12, ignore_eos=True))).result()[1]
                for p in PROMPTS]
        assert solo == cpu_tokens
        # three requests, two slots: the third waits for a freed slot; all finish with 12 tokens
        handles = [eng.submit(Request(messages=_chat(p), sampling=_greedy(12, ignore_eos=True))) for p in PROMPTS]
        together = [h.result()[1] for h in handles]
        assert [len(t) for t in together] == [12, 12, 12]
        assert eng.stats()["running"] == 0 and sorted(eng._free_slots + list(eng._parked)) == [0, 1]
        assert eng.stats()["totals"]["steps"] > 0
    finally:
        eng.shutdown()


def test_slots_engine_errors(smollm2_path):
    with pytest.raises(EngineError, match="unknown KV cache type"):
        Engine(EngineConfig(model=str(smollm2_path), static_slots=True, cache_type_k="q4_0", cache_type_v="f16"))
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA GPU"):
            Engine(EngineConfig(model=str(smollm2_path), device="cuda"))
    with pytest.raises(EngineError, match="unknown device"):
        Engine(EngineConfig(model=str(smollm2_path), device="tpu"))


@pytest.mark.parametrize("arch,kt,vt", [("llama", "turbo3_tcq", "turbo4"), ("qwen35", "turbo2", "q8_0")])
def test_slots_engine_every_cache_type_matches_cpu_engine(tmp_path, arch, kt, vt):
    """Any KV cache types, K and V apart, on the GPU path's scheduling (static slots, here on the CPU):
    the same greedy tokens as the CPU path's engine with the same types, several requests at once."""
    from engine.synth import write_synthetic
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=17)
    prompts = [[1 + (5 * i + 3 * j) % 300 for j in range(25 + 11 * i)] for i in range(3)]
    out = {}
    for slots in (False, True):
        eng = Engine(EngineConfig(model=str(path), ctx_size=128, max_seqs=2, prefill_chunk=16, static_slots=slots,
                                  cache_type_k=kt, cache_type_v=vt))
        try:
            if slots:
                assert (eng.runner.cache_type_k, eng.runner.cache_type_v) == (kt, vt)
            hs = [eng.submit(Request(prompt_ids=p, sampling=_greedy(20, ignore_eos=True))) for p in prompts]
            out[slots] = [h.result()[1] for h in hs]
        finally:
            eng.shutdown()
    assert out[True] == out[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu_path(smollm2_path, cpu_tokens):
    eng = Engine(EngineConfig(model=str(smollm2_path), device="cuda", max_seqs=4, prefill_chunk=16))
    try:
        handles = [eng.submit(Request(messages=_chat(p), sampling=_greedy(12, ignore_eos=True))) for p in PROMPTS]
        assert [h.result()[1] for h in handles] == cpu_tokens
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35"])
def test_cuda_engine_matches_cpu_engine_on_synthetic_models(tmp_path, arch):
    """Every architecture family through the Engine on the GPU: the same greedy tokens as the CPU."""
    from engine.synth import write_synthetic
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=11)
    prompts = [[1 + (7 * i + j) % 300 for j in range(20 + 9 * i)] for i in range(3)]
    out = {}
    for device in ("cpu", "cuda"):
        eng = Engine(EngineConfig(model=str(path), device=device, ctx_size=256, max_seqs=4, prefill_chunk=16))
        try:
            hs = [eng.submit(Request(prompt_ids=p, sampling=_greedy(24, ignore_eos=True))) for p in prompts]
            out[device] = [h.result()[1] for h in hs]
            assert eng.stats()["device"] == device
        finally:
            eng.shutdown()
    assert out["cuda"] == out["cpu"]


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_parked_slot_serves_the_follow_up(tmp_path, arch):
    """GPU path (static slots, here on the CPU): a finished conversation stays in its slot and a follow-up
    that continues it computes only the new tokens, with the tokens a cold engine gives."""
    from engine.synth import write_synthetic
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=13)
    first = [1 + (3 * j + j * j) % 400 for j in range(50)]
    cfg = dict(model=str(path), ctx_size=256, max_seqs=2, prefill_chunk=16, static_slots=True)
    warm, cold = Engine(EngineConfig(**cfg)), Engine(EngineConfig(**cfg, resident_tokens=0))
    try:
        answer = warm.submit(Request(prompt_ids=first, sampling=_greedy(10, ignore_eos=True))).result()[1]
        follow = first + answer + [7, 8, 9, 10, 11]
        _, got, fin = warm.submit(Request(prompt_ids=follow, sampling=_greedy(10, ignore_eos=True))).result()
        assert fin.usage.cached_tokens >= len(first) + len(answer) - 1
        # a third, unrelated request and a fourth: slots are reused (parked ones evicted) without errors
        for seed in (1, 2):
            other = [1 + (seed * 11 + 7 * j) % 400 for j in range(30)]
            assert len(warm.submit(Request(prompt_ids=other, sampling=_greedy(4, ignore_eos=True))).result()[1]) == 4
        want = cold.submit(Request(prompt_ids=follow, sampling=_greedy(10, ignore_eos=True))).result()[1]
        assert got == want
        assert cold.stats()["totals"].get("cached_tokens", 0) == 0
    finally:
        warm.shutdown()
        cold.shutdown()


def test_runner_path_says_it_decodes_without_drafts(tmp_path, caplog):
    """Speculative decoding is not on the GPU path yet: asking for it there logs a warning, stats() says
    it is inactive, and the tokens are those of spec off."""
    from engine.synth import write_synthetic
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=3)
    cfg = dict(model=str(path), ctx_size=128, max_seqs=2, prefill_chunk=16, static_slots=True)
    prompt = [1 + (5 * j) % 300 for j in range(20)] * 2
    with caplog.at_level("WARNING", logger="hivejet.engine"):
        spec = Engine(EngineConfig(**cfg, spec="ngram"))
    plain = Engine(EngineConfig(**cfg))
    try:
        assert "CPU path only" in caplog.text
        assert spec.stats()["spec"]["active"] is False and plain.stats()["spec"]["active"] is False
        got = spec.submit(Request(prompt_ids=prompt, sampling=_greedy(8, ignore_eos=True))).result()[1]
        assert got == plain.submit(Request(prompt_ids=prompt, sampling=_greedy(8, ignore_eos=True))).result()[1]
    finally:
        spec.shutdown()
        plain.shutdown()
