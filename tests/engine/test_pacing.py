"""Prompt-chunk pacing (engine/pacing.py): the arithmetic on given step times, and the engine on the GPU
path's static slots (on the CPU) holding a long prompt's later chunks back while another sequence
generates, without changing anyone's tokens."""
from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.pacing import PrefillPacer
from engine.sampling import SamplingParams
from engine.types import EngineError, Request


def _steps(p: PrefillPacer, kinds: list[tuple[bool, float]]) -> None:
    """Steps of (takes chunks, seconds), each planned, then finished."""
    for chunks, dt in kinds:
        p.finished(p.planned(chunks), dt, chunks)


def test_a_chunk_waits_for_decode_steps_worth_its_extra_time():
    p = PrefillPacer(0.5)
    assert p.allow()                                  # nothing measured yet
    _steps(p, [(False, 0.03125), (True, 0.15625)])
    # (0.5 x 156 - 31) / 0.5 = 94 ms of decode-only steps owed: then the generating sequences made 4
    # tokens in 250 ms, against 8 in 250 ms without the chunk
    assert not p.allow()
    _steps(p, [(False, 0.03125)] * 2)
    assert not p.allow()                              # 62 ms
    _steps(p, [(False, 0.03125)])
    assert p.allow()                                  # 94 ms
    assert p.held == 2


def test_share_sets_the_ratio_and_one_means_no_pacing():
    p = PrefillPacer(0.25)             # (0.75 x 156 - 31) / 0.25 = 344 ms owed: 12 tokens in 500 ms, not 16
    _steps(p, [(False, 0.03125), (True, 0.15625)] + [(False, 0.03125)] * 10)
    assert not p.allow()
    _steps(p, [(False, 0.03125)])
    assert p.allow()
    q = PrefillPacer(1.0)
    _steps(q, [(False, 0.03125), (True, 0.15625)])
    assert q.allow()
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="prefill_share"):
            PrefillPacer(bad)


def test_times_arriving_late_count_only_steps_planned_after_the_chunk():
    """Device times arrive once a step has completed (overlapped steps): a decode-only step planned
    before the last chunk step but finished after it does not count toward the next chunk."""
    p = PrefillPacer(0.5)
    _steps(p, [(False, 0.03125), (True, 0.15625)])
    early = p.planned(False)                          # planned, still running
    chunk = p.planned(True)                           # the next step takes a chunk (allowed earlier)
    p.finished(early, 0.03125, False)                 # arrives late: before the chunk, not banked
    p.finished(chunk, 0.15625, True)
    assert p.bank == 0.0 and not p.allow()


def test_engine_holds_later_chunks_back_and_keeps_the_tokens(tmp_path):
    """A sequence generates while a 10-chunk prompt arrives: with a small share the prompt's later chunks
    wait (counted in stats), and both requests get the tokens an unpaced engine gives."""
    from engine.tools.synth import write_synthetic
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=3)
    short = [1 + (5 * j) % 300 for j in range(12)]
    long = [1 + (7 * j + j * j) % 300 for j in range(160)]
    got = {}
    for share in (1.0, 0.05):
        eng = Engine(EngineConfig(model=str(path), ctx_size=256, max_seqs=2, prefill_chunk=16, static_slots=True,
                                  prefill_share=share))
        try:
            a = eng.submit(Request(prompt_ids=short, sampling=SamplingParams(max_tokens=80, temperature=0.0,
                                                                             ignore_eos=True)))
            b = eng.submit(Request(prompt_ids=long, sampling=SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True)))
            got[share] = (a.result()[1], b.result()[1])
            held = eng.stats()["prefill_pacing"]["chunks_held"]
            assert (held == 0) if share == 1.0 else (held > 0)
        finally:
            eng.shutdown()
    assert got[1.0] == got[0.05]


def test_engine_refuses_a_bad_share(tmp_path):
    from engine.tools.synth import write_synthetic
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=3)
    with pytest.raises(EngineError, match="prefill_share"):
        Engine(EngineConfig(model=str(path), prefill_share=0.0))


def test_steps_still_running_count_at_their_usual_time():
    """Decode-only steps planned after the chunk but not finished count at the decode steps' average, so
    the pacer does not hold chunks back longer than the share asks while device times arrive late."""
    p = PrefillPacer(0.5)
    _steps(p, [(False, 0.03125), (True, 0.15625), (False, 0.03125)])
    p.planned(False)
    assert not p.allow()                              # 31 ms done + 31 ms running < 94 ms
    p.planned(False)
    assert p.allow()


@pytest.mark.parametrize("runner", [False, True], ids=["cpu_engine", "runner"])
def test_a_whole_chunk_fits_beside_the_decode_rows(tmp_path, runner):
    """step_tokens = prefill_chunk: a prompt arriving while another sequence generates still advances a
    whole chunk per step beside the decode row (a chunk that waited for a step without decode rows would
    starve a long prompt until every other sequence had finished), with the same tokens."""
    from engine.tools.synth import write_synthetic
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=3)
    short = [1 + (5 * j) % 300 for j in range(12)]
    long = [1 + (7 * j + j * j) % 300 for j in range(64)]
    cfg = dict(model=str(path), ctx_size=256, max_seqs=2, prefill_chunk=16, step_tokens=16, prefill_share=1.0)
    eng = Engine(EngineConfig(**cfg, static_slots=runner))
    mixed = []
    sch = eng.scheduler
    plan = sch.plan if runner else sch.plan_cpu

    def logged(*a, **kw):
        p = plan(*a, **kw)
        mixed.append(bool(p.decode) and bool(p.chunks))   # (decode rows and chunks)
        return p
    if runner:
        sch.plan = logged
    else:
        sch.plan_cpu = logged
    try:
        a = eng.submit(Request(prompt_ids=short, sampling=SamplingParams(max_tokens=60, temperature=0.0,
                                                                         ignore_eos=True)))
        b = eng.submit(Request(prompt_ids=long, sampling=SamplingParams(max_tokens=4, temperature=0.0,
                                                                        ignore_eos=True)))
        got = (a.result()[1], b.result()[1])
    finally:
        eng.shutdown()
    assert sum(mixed) >= 3          # B's four chunks went beside A's decode rows (A still had ~50 to go)
    alone = Engine(EngineConfig(**cfg, static_slots=runner))
    try:
        ref_b = alone.submit(Request(prompt_ids=long, sampling=SamplingParams(max_tokens=4, temperature=0.0,
                                                                              ignore_eos=True))).result()[1]
    finally:
        alone.shutdown()
    assert got[1] == ref_b


def test_automatic_prefill_chunk(tmp_path):
    """prefill_chunk=0 picks PREFILL_CHUNK on the CPU and on a GPU short of memory, the larger chunk with
    LARGE_CHUNK_FREE free after the weights; a negative chunk is refused."""
    from engine.planner import LARGE_CHUNK_FREE, PREFILL_CHUNK, PREFILL_CHUNK_LARGE, auto_prefill_chunk
    from engine.tools.synth import write_synthetic
    assert auto_prefill_chunk(None) == PREFILL_CHUNK == 512
    assert auto_prefill_chunk(LARGE_CHUNK_FREE - 1) == PREFILL_CHUNK
    assert auto_prefill_chunk(LARGE_CHUNK_FREE) == PREFILL_CHUNK_LARGE == 1024
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=3)
    for runner in (False, True):
        eng = Engine(EngineConfig(model=str(path), ctx_size=256, max_seqs=2, static_slots=runner))
        try:
            assert eng.config.prefill_chunk == PREFILL_CHUNK
        finally:
            eng.shutdown()
    with pytest.raises(EngineError, match="prefill_chunk"):
        Engine(EngineConfig(model=str(path), prefill_chunk=-16))
