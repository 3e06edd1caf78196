"""A full KV pool on the CPU (EngineConfig.kv_memory), on the CPU path and on the runner's slots
(static_slots): a prompt that can never fit is refused at submit, concurrent requests that together overflow
the pool wait or are pre-empted and recomputed and still give exactly their solo tokens, and a single request
that outgrows the pool stops with "length" (the CPU path: when its pool is full; the runner: at its context,
which the pool caps)."""
from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.tools.synth import write_synthetic
from engine.types import EngineError, Request


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("kvmem") / f"{request.param}.gguf"
    write_synthetic(path, request.param, "tiny", seed=6)
    return path


@pytest.fixture(params=[False, True], ids=["cpu_path", "runner"])
def static_slots(request):
    return request.param


def _ids(n, seed):
    return [1 + (seed * 17 + 5 * j) % 450 for j in range(n)]


def _engine(path, tokens=None, static_slots=False, **kw):
    probe = Engine(EngineConfig(model=str(path), ctx_size=1024))
    per_token = probe.model.kv_pool().bytes_per_token()
    probe.shutdown()
    mem = per_token * tokens if tokens else 0
    return Engine(EngineConfig(model=str(path), ctx_size=1024, prefill_chunk=32, kv_memory=mem,
                               static_slots=static_slots, **kw))


def _capacity(eng) -> int:
    return eng.stats()["kv_pool"]["capacity_tokens"]


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_pool_full_waits_preempts_and_recomputes_exactly(tiny, static_slots):
    prompts = [_ids(80, i) for i in range(3)]
    big = _engine(tiny, static_slots=static_slots)
    try:
        solo = [big.submit(Request(prompt_ids=p, sampling=_greedy(60))).result()[1] for p in prompts]
    finally:
        big.shutdown()
    eng = _engine(tiny, tokens=256, static_slots=static_slots)
    try:
        assert 240 <= _capacity(eng) <= 272
        hs = [eng.submit(Request(prompt_ids=p, sampling=_greedy(60))) for p in prompts]
        got = [h.result()[1] for h in hs]
        assert got == solo
        t = eng.stats()["totals"]
        assert t.get("preempted", 0) >= 1
    finally:
        eng.shutdown()


def test_prompt_that_never_fits_and_a_request_that_outgrows_the_pool(tiny, static_slots):
    eng = _engine(tiny, tokens=256, static_slots=static_slots)
    try:
        with pytest.raises(EngineError, match="raise kv_memory"):
            eng.submit(Request(prompt_ids=_ids(300, 1), sampling=_greedy(4)))
        _, ids, fin = eng.submit(Request(prompt_ids=_ids(100, 2), sampling=_greedy(400))).result()
        assert fin.reason == "length" and 100 <= len(ids) <= 160
        if static_slots:   # (the pool caps the runner's context: the request ends there)
            assert eng.stats()["kv_pool"]["seq_max_tokens"] == _capacity(eng)
        else:
            assert eng.stats()["totals"]["pool_full_stops"] == 1
        # the engine keeps serving afterwards
        _, ids, fin = eng.submit(Request(prompt_ids=_ids(40, 3), sampling=_greedy(8))).result()
        assert len(ids) == 8
    finally:
        eng.shutdown()
