"""The Engine stepping through engine/runner/runner.py (the GPU path's static slots), on the CPU with the
real demo model: same greedy tokens as the CPU path, several requests at once in one decode call,
slots freed and reused, chunked prompts, clear errors. On a GPU the same with device="cuda"."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.runner_fit import RunnerFit
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
        assert eng.stats()["running"] == 0 and sorted(eng.slots.free + list(eng.slots.parked)) == [0, 1]
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
    from engine.tools.synth import write_synthetic
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
def test_cuda_engine_matches_cpu_path(smollm2_path, monkeypatch):
    """The Engine on CUDA gives the greedy tokens of the CPU path computing the same function: with the GPU's
    fp16 matmul inputs (tests/engine/test_runner.py: fp16_activations) instead of llama.cpp's 8-bit ones."""
    from tests.engine.test_runner import fp16_activations
    fp16_activations(monkeypatch)
    out = {}
    for device in ("cpu", "cuda"):
        eng = Engine(EngineConfig(model=str(smollm2_path), device=device, ctx_size=512, max_seqs=4, prefill_chunk=16))
        try:
            handles = [eng.submit(Request(messages=_chat(p), sampling=_greedy(12, ignore_eos=True))) for p in PROMPTS]
            out[device] = [h.result()[1] for h in handles]
        finally:
            eng.shutdown()
    assert out["cuda"] == out["cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35"])
def test_cuda_engine_matches_cpu_engine_on_synthetic_models(tmp_path, arch):
    """Every architecture family through the Engine on the GPU: the same greedy tokens as the CPU."""
    from engine.tools.synth import write_synthetic
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
    from engine.tools.synth import write_synthetic
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_runner_path_drafters(tmp_path, device):
    """The GPU path (static slots on the CPU, and CUDA) drafts with every drafter and chain: n-grams, the
    MTP block (tests/engine/test_spec_mtp.py has more) and a DFlash drafter reading the runner's rows at
    its target layers; the tokens are those of spec off every way, and the derived synthetic DFlash
    drafter's drafts are accepted often."""
    from engine.tools.synth_dflash import synthetic_drafter, write_gguf
    from engine.tools.synth import write_synthetic
    path = tmp_path / "mtp.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=3, mtp=True)
    drafter = write_gguf(tmp_path / "drafter.gguf", *synthetic_drafter(path, seed=1))
    cfg = dict(model=str(path), ctx_size=160, max_seqs=3, prefill_chunk=16, static_slots=True, device=device,
               spec_drafter=str(drafter), spec_adaptive=False, spec_max_drafts=4)   # (fixed lengths: deterministic)
    prompts = [[1 + (5 * j) % 300 for j in range(20)] * 2, [7 + (3 * j) % 200 for j in range(37)]]

    def run(mode):
        eng = Engine(EngineConfig(**cfg, spec=mode))
        try:
            assert eng.spec_active == set(mode.split("+")) - {"off"}
            hs = [eng.submit(Request(prompt_ids=p, sampling=_greedy(24, ignore_eos=True))) for p in prompts]
            return [h.result()[1] for h in hs], eng.stats()["spec"]["drafters"]
        finally:
            eng.shutdown()
    want, _ = run("off")
    for mode in ("mtp+ngram", "mtp", "dflash", "dflash+ngram"):
        out, by = run(mode)
        assert out == want, mode
        first = mode.split("+")[0]
        assert by[first]["drafted"] > 0, (mode, by)
        if first == "dflash":
            assert by["dflash"]["accepted"] > 0, by


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backed_off_drafters_overlap_steps(tmp_path, device, monkeypatch):
    """A sequence whose drafter is backed off (the adaptive length chose 0 drafts; here forced) decodes like
    one without drafts: its steps are overlapped (the next launched before the host reads the tokens) and
    the drafter's upkeep is deferred, yet every probe drafts exactly what it drafts without overlap (the
    MTP rows and DFlash context written late are the same), and the tokens are those of spec off. An n-gram
    lookup that finds nothing waits a few steps, which are overlapped."""
    import engine.spec.speculator as es
    from engine.tools.synth_dflash import synthetic_drafter, write_gguf
    from engine.tools.synth import write_synthetic
    path = tmp_path / "mtp.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=3, mtp=True)
    drafter = write_gguf(tmp_path / "drafter.gguf", *synthetic_drafter(path, seed=1))
    monkeypatch.setattr(es, "choose_k", lambda *a, **k: 0)      # drafting never pays: back off, probe now and then
    seen = []                                                   # (tokens known, drafts) at every drafting call
    real_catch_up, real_propose = es.catch_up, es.propose

    def catch_up(model, items, timing=None):
        real_catch_up(model, items, timing)
        seen.extend((len(it.tokens), list(it.state.drafts)) for it in items if it.state.drafts)

    def propose(d, model, reqs):
        real_propose(d, model, reqs)
        seen.extend((len(r.history), list(r.state.drafts)) for r in reqs)
    monkeypatch.setattr(es, "catch_up", catch_up)
    monkeypatch.setattr(es, "propose", propose)
    prompts = [[1 + (5 * j) % 300 for j in range(20)] * 2, [7 + (3 * j) % 200 for j in range(37)]]

    def run(mode, overlap):
        seen.clear()
        eng = Engine(EngineConfig(model=str(path), ctx_size=200, max_seqs=3, prefill_chunk=16, static_slots=True,
                                  device=device, spec_drafter=str(drafter), spec=mode, spec_max_drafts=4,
                                  overlap_steps=overlap))
        try:
            hs = [eng.submit(Request(prompt_ids=p, sampling=_greedy(60, ignore_eos=True))) for p in prompts]
            return [h.result()[1] for h in hs], eng.stats()["totals"], sorted(seen)
        finally:
            eng.shutdown()
    want, _, _ = run("off", True)
    for mode in ("mtp", "dflash", "ngram"):
        out, totals, drafts = run(mode, True)
        assert out == want, mode
        assert totals["drafted_tokens"] > 0, (mode, totals)     # the first step and the probes
        out2, totals2, drafts2 = run(mode, False)
        assert out2 == want and "overlapped_steps" not in totals2
        if mode == "ngram":   # a lookup that finds nothing waits 3 overlapped steps (~62 steps in all; how
            # many lookups match depends on when the second request is admitted: 28-36 overlapped seen)
            assert totals["overlapped_steps"] > 20, totals
            continue
        assert totals["overlapped_steps"] > 50, (mode, totals)
        assert drafts == drafts2, mode
        assert totals["drafted_tokens"] == totals2["drafted_tokens"], mode


# --- tokens chosen on the device, and the next step launched before the host streams them ------------------
# (engine/sample_device.py; EngineConfig.device_sampling / overlap_steps; docs/ARCHITECTURE.md, Decode step graphs)

def _outcome(h):
    """Everything a client sees of a request: text, ids, finish reason, stop string, usage, and how many
    token events carried logprobs."""
    from engine.types import TokenEvent
    text, ids, lps, fin = [], [], 0, None
    for ev in h:
        if isinstance(ev, TokenEvent):
            text.append(ev.text)
            ids.extend(ev.ids)
            lps += ev.logprobs is not None
        else:
            fin = ev
    u = fin.usage
    return "".join(text), ids, fin.reason, fin.stop_string, (u.prompt_tokens, u.completion_tokens, u.cached_tokens), lps


def _stop_inside(text: str) -> str:
    """Two printable characters of text that first occur past its start (a stop string ending mid-output,
    often inside a token)."""
    for k in range(3, len(text) - 2):
        s = text[k:k + 2]
        if s.isprintable() and not s.isspace() and text.find(s) == k:
            return s
    raise AssertionError(f"no stop string in {text!r}")


def _sampled(n, seed, **kw):
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, **kw)


def _mixed_requests(path, prompts):
    """Greedy and seeded sampled requests (device rows: top-k, top-p without top-k, min-p only) with stop
    strings that end mid-output, an end-of-generation token (stop_token_ids) mid-output, max_tokens 1 and
    others; and host rows in the same steps (repetition penalty, logprobs)."""
    cfg = dict(model=str(path), ctx_size=128, max_seqs=len(prompts), prefill_chunk=16, static_slots=True)
    plain = [_greedy(24, ignore_eos=True), _greedy(24, ignore_eos=True), _sampled(24, 5, top_k=20, ignore_eos=True),
             _greedy(24, ignore_eos=True), _greedy(16, repetition_penalty=1.3, ignore_eos=True),
             _sampled(20, 9, top_k=0, top_p=0.9, logprobs=2, ignore_eos=True), _greedy(1),
             _sampled(12, 3, top_k=0, top_p=1.0, min_p=0.1, ignore_eos=True)]
    eng = Engine(EngineConfig(**cfg, overlap_steps=False))
    try:
        ref = [_outcome(eng.submit(Request(prompt_ids=p, sampling=sp))) for p, sp in zip(prompts, plain)]
    finally:
        eng.shutdown()
    reqs = list(plain)
    reqs[1] = _greedy(24, stop=[_stop_inside(ref[1][0])])
    reqs[2] = _sampled(24, 5, top_k=20, stop=[_stop_inside(ref[2][0])])
    reqs[3] = _greedy(24, stop_token_ids=[ref[3][1][6]])          # an end of generation mid-output
    reqs[5] = _sampled(20, 9, top_k=0, top_p=0.9, logprobs=2, stop=[_stop_inside(ref[5][0])])
    return cfg, reqs


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_overlapped_steps_give_the_outputs_of_plain_steps(tmp_path, arch):
    """Eight concurrent requests, device and host rows mixed in each step: with overlap_steps (step N+1
    launched before step N's tokens are streamed), without it, and with every token sampled on the host
    (device_sampling=False), every client sees the same text, ids, finish reason, stop string, usage and
    logprobs; stop strings and an end-of-generation token end requests mid-output (their extra row is
    discarded) and max_tokens ends others. Without recurrent layers the slots are left exactly as without
    overlap (parked tokens, pool blocks)."""
    from engine.tools.synth import write_synthetic
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=17)
    prompts = [[1 + (7 * i + 3 * j + i * j) % 400 for j in range(20 + 5 * i)] for i in range(8)]
    cfg, reqs = _mixed_requests(path, prompts)
    out, parked, pools, totals = {}, {}, {}, {}
    for name, kw in (("overlap", {}), ("plain", dict(overlap_steps=False)), ("host", dict(device_sampling=False))):
        eng = Engine(EngineConfig(**cfg, **kw))
        try:
            hs = [eng.submit(Request(prompt_ids=p, sampling=sp)) for p, sp in zip(prompts, reqs)]
            out[name] = [_outcome(h) for h in hs]
            assert eng.stats()["running"] == 0
            parked[name] = sorted(tuple(t) for t in eng.slots.parked.values())
            pools[name] = eng.stats()["kv_pool"]
            totals[name] = eng.stats()["totals"]
        finally:
            eng.shutdown()
    assert out["overlap"] == out["plain"] == out["host"]
    reasons = [o[2] for o in out["overlap"]]
    assert reasons == ["length", "stop", "stop", "stop", "length", "stop", "length", "length"]
    stops = [None, reqs[1].stop[0], reqs[2].stop[0], None, None, reqs[5].stop[0], None, None]
    assert [o[3] for o in out["overlap"]] == stops
    assert out["overlap"][5][5] == out["overlap"][5][4][1] > 0        # logprobs on every token of the host row
    n_gen = sum(o[4][1] for o in out["overlap"])
    host_rows = out["overlap"][4][4][1] + out["overlap"][5][4][1]
    assert totals["overlap"]["device_sampled_tokens"] == totals["plain"]["device_sampled_tokens"] == n_gen - host_rows
    assert "device_sampled_tokens" not in totals["host"]
    # the two stop strings and the end-of-generation token each finished a request with a row on the GPU
    assert totals["overlap"]["discarded_rows"] == 3 and "discarded_rows" not in totals["plain"]
    assert parked["plain"] == parked["host"]
    if arch == "llama":
        assert parked["overlap"] == parked["plain"] and pools["overlap"] == pools["plain"]
    else:   # the recurrent states moved past the finishing token: those conversations are parked with it
        longer = [t for t in parked["overlap"] if t not in parked["plain"]]
        assert len(longer) == 3 and all(t[:-1] in parked["plain"] for t in longer)


@pytest.mark.parametrize("overlap", [True, False])
def test_queued_requests_and_follow_ups_with_overlap(tmp_path, overlap):
    """Two slots, five requests (three wait for a slot), then a follow-up to a conversation a stop string
    ended mid-output: the same outputs with and without overlap, the follow-up takes the parked slot over (cached
    tokens as without overlap) and gives a cold engine's tokens."""
    from engine.tools.synth import write_synthetic
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=23)
    prompts = [[1 + (11 * i + 5 * j + i * j) % 400 for j in range(18 + 7 * i)] for i in range(5)]
    cfg = dict(model=str(path), ctx_size=128, max_seqs=2, prefill_chunk=16, static_slots=True)
    ref = Engine(EngineConfig(**cfg, overlap_steps=False, resident_tokens=0))
    try:
        alone = [_outcome(ref.submit(Request(prompt_ids=p, sampling=_greedy(20, ignore_eos=True)))) for p in prompts]
    finally:
        ref.shutdown()
    stop = _stop_inside(alone[0][0])
    reqs = [_greedy(20, stop=[stop])] + [_greedy(20, ignore_eos=True)] * 3 + [_sampled(20, 4, ignore_eos=True)]
    eng = Engine(EngineConfig(**cfg, overlap_steps=overlap))
    try:
        got = [_outcome(h) for h in [eng.submit(Request(prompt_ids=p, sampling=sp)) for p, sp in zip(prompts, reqs)]]
        assert got[1:4] == alone[1:4]
        assert got[0][2:4] == ("stop", stop) and alone[0][0].startswith(got[0][0])
        assert _outcome(eng.submit(Request(prompt_ids=prompts[0], sampling=reqs[0])))[:4] == got[0][:4]   # (parked now)
        follow = prompts[0] + got[0][1] + [7, 8, 9]
        fu = _outcome(eng.submit(Request(prompt_ids=follow, sampling=_greedy(8, ignore_eos=True))))
        assert fu[4][2] == len(follow) - 4            # all but the answer's last token and the 3 new ones
        assert eng.stats()["running"] == 0 and sorted(eng.slots.free + list(eng.slots.parked)) == [0, 1]
    finally:
        eng.shutdown()
    cold = Engine(EngineConfig(**cfg, resident_tokens=0))
    try:
        assert fu[:3] == _outcome(cold.submit(Request(prompt_ids=follow, sampling=_greedy(8, ignore_eos=True))))[:3]
        other = Engine(EngineConfig(**cfg, overlap_steps=not overlap))
        try:   # the sampled request and the stop string also agree across the switch
            assert got == [_outcome(h) for h in [other.submit(Request(prompt_ids=p, sampling=sp))
                                                 for p, sp in zip(prompts, reqs)]]
        finally:
            other.shutdown()
    finally:
        cold.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_cancel_while_a_row_runs_ahead(tmp_path, overlap):
    """A request cancelled mid-generation beside another: it finishes "cancelled" with usage counting exactly
    the tokens it streamed (a prefix of its uncancelled output); the other's output is unchanged; the slot
    is parked with the tokens whose KV was computed before the cancel (the row that ran ahead discarded)."""
    from engine.tools.synth import write_synthetic
    from engine.types import TokenEvent
    path = tmp_path / "llama.gguf"
    write_synthetic(path, "llama", "tiny", seed=29)
    a, b = [1 + (3 * j + 1) % 400 for j in range(30)], [1 + (13 * j + 5) % 400 for j in range(26)]
    cfg = dict(model=str(path), ctx_size=256, max_seqs=2, prefill_chunk=16, static_slots=True)
    ref = Engine(EngineConfig(**cfg, resident_tokens=0))
    try:
        full_a, full_b = [ref.submit(Request(prompt_ids=p, sampling=_greedy(120, ignore_eos=True))).result()[1]
                          for p in (a, b)]
    finally:
        ref.shutdown()
    eng = Engine(EngineConfig(**cfg, overlap_steps=overlap))
    try:
        ha = eng.submit(Request(prompt_ids=a, sampling=_greedy(120, ignore_eos=True)))
        hb = eng.submit(Request(prompt_ids=b, sampling=_greedy(120, ignore_eos=True)))
        ids, fin = [], None
        for ev in ha:
            if isinstance(ev, TokenEvent):
                ids.extend(ev.ids)
                if len(ids) >= 5:
                    ha.cancel()
            else:
                fin = ev
        assert fin.reason == "cancelled" and fin.usage.completion_tokens == len(ids) and ids == full_a[:len(ids)]
        assert hb.result()[1] == full_b
        assert eng.stats()["running"] == 0
        parked = [t for t in eng.slots.parked.values() if t[:len(a)] == a]
        assert parked == [a + ids[:-1]]          # the KV of its last streamed token was never needed
        assert eng.stats()["totals"].get("discarded_rows", 0) == (1 if overlap else 0)
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_cuda_overlapped_steps_give_the_outputs_of_plain_steps(tmp_path, arch):
    """On the GPU (CUDA graphs, ids copied to pinned memory, the next step launched first): the same client
    outputs with and without overlap_steps; greedy ones also those of the host Sampler (device_sampling
    off) and of the CPU path."""
    from engine.tools.synth import write_synthetic
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=17)
    prompts = [[1 + (7 * i + 3 * j + i * j) % 400 for j in range(20 + 5 * i)] for i in range(8)]
    _, reqs = _mixed_requests(path, prompts)
    cfg = dict(model=str(path), ctx_size=128, max_seqs=8, prefill_chunk=16)
    out = {}
    for name, kw in (("overlap", dict(device="cuda")), ("plain", dict(device="cuda", overlap_steps=False)),
                     ("host", dict(device="cuda", device_sampling=False)), ("cpu", dict(device="cpu"))):
        eng = Engine(EngineConfig(**cfg, **kw))
        try:
            out[name] = [_outcome(h) for h in [eng.submit(Request(prompt_ids=p, sampling=sp))
                                                for p, sp in zip(prompts, reqs)]]
        finally:
            eng.shutdown()
    assert out["overlap"] == out["plain"]
    greedy = [i for i, sp in enumerate(reqs) if sp.greedy]
    assert [out["overlap"][i] for i in greedy] == [out["host"][i] for i in greedy]
    # against the CPU path: the same ids up to the first near tie of the CPU's logits (the GPU's fp16
    # activations move a random tiny model's logits by up to ~1e-2 of the largest; seed 17's qwen35 has a
    # top-2 gap of 0.0017 at its first token); rows with penalties are left out (the gap is not theirs)
    from engine.models import open_model
    from tests.engine.test_runner import reference_greedy
    model = open_model(path)
    try:
        for i in greedy:
            if reqs[i].repetition_penalty != 1.0:
                continue
            ids, cpu_ids = out["overlap"][i][1], out["cpu"][i][1]
            _, logits = reference_greedy(model, prompts[i], len(cpu_ids))
            gaps = [float(lg.float().topk(2).values.diff().abs()) for lg in logits[:len(cpu_ids)]]
            scale = max(float(lg.float().abs().max()) for lg in logits)
            clear = next((t for t, g in enumerate(gaps) if g < 2e-2 * scale), len(gaps))
            assert ids[:clear] == cpu_ids[:clear], (i, clear)
    finally:
        model.close()


def test_recurrent_conversation_ended_by_a_stop_string_parks_its_last_token(tmp_path):
    """qwen35 with overlap: a stop string ends the request while its next row (fed the last token) runs; the
    recurrent states are past that token, so the slot is parked with it, and a follow-up that continues the
    conversation (the answer's ids, last one included) takes the slot over and gives a cold engine's tokens."""
    from engine.tools.synth import write_synthetic
    path = tmp_path / "qwen35.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=19)
    prompt = [1 + (9 * j + j * j) % 400 for j in range(40)]
    cfg = dict(model=str(path), ctx_size=128, max_seqs=2, prefill_chunk=16, static_slots=True)
    cold = Engine(EngineConfig(**cfg, resident_tokens=0))
    try:
        text = _outcome(cold.submit(Request(prompt_ids=prompt, sampling=_greedy(20, ignore_eos=True))))[0]
        stop = _greedy(20, stop=[_stop_inside(text)])
        res = {}
        for overlap in (True, False):
            eng = Engine(EngineConfig(**cfg, overlap_steps=overlap))
            try:
                first = _outcome(eng.submit(Request(prompt_ids=prompt, sampling=stop)))
                assert first[2] == "stop"
                follow = prompt + first[1] + [5, 6, 7]
                again = eng.submit(Request(prompt_ids=follow, sampling=_greedy(8, ignore_eos=True)))
                res[overlap] = first, _outcome(again)
                assert eng.stats()["totals"].get("discarded_rows", 0) == (1 if overlap else 0)
            finally:
                eng.shutdown()
        assert res[True][0] == res[False][0]
        want = _outcome(cold.submit(Request(prompt_ids=follow, sampling=_greedy(8, ignore_eos=True))))
        assert res[True][1][:2] == res[False][1][:2] == want[:2]
        assert res[True][1][4][2] == len(follow) - 3 and res[False][1][4][2] == len(follow) - 4
    finally:
        cold.shutdown()


@pytest.mark.parametrize("arch", ["qwen35", "llama"])
def test_arriving_prompts_share_padded_passes(tmp_path, arch, monkeypatch):
    """Several requests' short prompts in one padded pass of several slots (Runner.prefill_pieces, the
    scheduler's chunks; EngineConfig.shared_prompt_passes): the tokens and logprobs each request gets without it, and a
    pass did hold several of them. (On the CPU the padded passes are asked for here; the first step waits
    until every request is in, so that later steps have several arrivals to group.)"""
    import threading

    from engine.runner import Runner
    from engine.step_runner import RunnerExecutor
    from engine.tools.synth import write_synthetic
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=29)
    prompts = [[1 + (13 * i + 7 * j + i * j) % 400 for j in range(n)] for i, n in enumerate((20, 33, 47, 64, 9))]
    init, step, pass_ = Runner.__init__, RunnerExecutor._step, Runner._piece_pass
    passes, go = [], threading.Event()

    def padded_init(self, *a, **kw):
        kw["padded_prefill"] = True
        init(self, *a, **kw)

    def held_step(self, prev):
        go.wait(30)
        return step(self, prev)

    def counted_pass(self, pieces, chunk):
        passes.append(len(pieces))
        return pass_(self, pieces, chunk)
    monkeypatch.setattr(Runner, "__init__", padded_init)
    monkeypatch.setattr(RunnerExecutor, "_step", held_step)
    monkeypatch.setattr(Runner, "_piece_pass", counted_pass)
    out = {}
    for on in (False, True):
        go.clear()
        eng = Engine(EngineConfig(model=str(path), ctx_size=256, max_seqs=5, prefill_chunk=128, static_slots=True,
                                  shared_prompt_passes=on))
        try:
            assert eng.runner.prompt_pieces == (5 if on else 1)
            hs = [eng.submit(Request(prompt_ids=p, sampling=SamplingParams(max_tokens=10, temperature=0.0,
                                                                          ignore_eos=True, logprobs=2)))
                  for p in prompts]
            go.set()
            out[on] = [_outcome(h) for h in hs]
            assert (eng.stats()["totals"].get("shared_prompt_passes", 0) > 0) == on
        finally:
            eng.shutdown()
    assert out[True] == out[False]
    assert passes and max(passes) >= 2, passes


@pytest.mark.parametrize("arch", ["qwen35", "llama"])
def test_prompt_pieces_graphs_kept_out_of_the_pool(tmp_path, arch):
    """The GPU path's pool fit leaves room for the pieces' pass graphs (the planner's piece_graph_bytes)
    when the runner will capture them: several slots and the pieces on (EngineConfig.shared_prompt_passes)."""
    from engine import planner as P
    from engine.tools.synth import write_synthetic
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=5)
    facts = P.model_facts(path)
    every = P.piece_graph_bytes(facts, 4)
    assert every > 0
    for seqs, shared, want in ((4, True, every), (1, True, 0), (4, False, 0)):
        eng = Engine(EngineConfig(model=str(path), ctx_size=64, max_seqs=seqs, prefill_chunk=32, static_slots=True,
                                  shared_prompt_passes=shared))
        try:
            assert RunnerFit(eng.config, eng.model, eng.speculator).pieces_workspace(facts) == want
        finally:
            eng.shutdown()
