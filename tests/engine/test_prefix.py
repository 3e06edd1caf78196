"""Prefix reuse (engine/prefix.py): a follow-up request processes only its new tokens and gets exactly
the tokens a cold engine gives; concurrent agents share a common prompt prefix; resident conversations
are evicted least recently used first; qwen35 resumes from recurrent-state snapshots."""
from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.tools.synth import write_synthetic
from engine.types import Request


def _greedy(n=12):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(eng, ids, n=12):
    h = eng.submit(Request(prompt_ids=ids, sampling=_greedy(n)))
    _, toks, fin = h.result()
    return toks, fin


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen35"])
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix") / f"{request.param}.gguf"
    write_synthetic(path, request.param, "tiny", seed=21)
    return path


def _ids(n, seed):
    return [1 + (seed * 31 + 7 * j + j * j) % 400 for j in range(n)]


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_follow_up_reuses_the_conversation_and_matches_a_cold_engine(model_path, spec):
    """(with n-gram drafts too: rolled-back draft rows must not leak into what a follow-up reuses)"""
    first = _ids(70, 1)
    cfg = dict(model=str(model_path), ctx_size=512, prefill_chunk=32)
    warm = Engine(EngineConfig(**cfg, spec=spec))
    cold = Engine(EngineConfig(**cfg, resident_tokens=0))
    try:
        answer, _ = _run(warm, first)
        follow = first + answer + _ids(25, 2)          # the client resends everything plus a new turn
        got, fin = _run(warm, follow)
        assert fin.usage.cached_tokens >= 64        # what the APIs report as cached prompt tokens
        st = warm.stats()
        assert st["totals"]["cached_tokens"] >= 64       # most of the first conversation was not recomputed
        assert st["resident"]["conversations"] == 2
        want, _ = _run(cold, follow)
        assert got == want
        assert cold.stats()["totals"].get("cached_tokens", 0) == 0
    finally:
        warm.shutdown()
        cold.shutdown()


def test_shared_prefix_and_eviction(model_path):
    system = _ids(96, 3)                      # a shared system prompt + tool list
    eng = Engine(EngineConfig(model=str(model_path), ctx_size=512, prefill_chunk=32, resident_tokens=300))
    try:
        a, _ = _run(eng, system + _ids(10, 4))
        b, _ = _run(eng, system + _ids(12, 5))
        window = eng.spec.sliding_window if eng.spec.arch == "gemma3" else 0
        if not window or window >= 128:
            assert eng.stats()["totals"]["cached_tokens"] >= 64
        else:   # the first sequence went on past the prefix and its local layers dropped blocks the
            # window at the prefix's end needs: nothing reusable (engine/prefix.py: _window_ok)
            assert eng.stats()["totals"].get("cached_tokens", 0) == 0
        cold = Engine(EngineConfig(model=str(model_path), ctx_size=512, prefill_chunk=32, resident_tokens=0))
        try:
            assert _run(cold, system + _ids(12, 5))[0] == b
        finally:
            cold.shutdown()
        for seed in range(6, 9):               # 3 more conversations of ~130 tokens: the budget of 300 evicts
            _run(eng, _ids(120, seed))
        st = eng.stats()["resident"]
        assert st["tokens"] <= 300 and st["evicted"] >= 2
    finally:
        eng.shutdown()
