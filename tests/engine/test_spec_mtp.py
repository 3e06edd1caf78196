"""MTP speculative decoding (engine/spec/mtp.py) on a synthetic qwen35 with an MTP block: greedy output
is token-for-token the output without drafts, drafts are proposed and verified, the sampled
distribution at temperature 0.8 is unchanged (chi-square), and models without the block say so."""
from __future__ import annotations

import collections

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.tools.synth import write_synthetic
from engine.types import EngineError, Request
from tests.engine.test_spec_ngram import _chi2_p


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "qwen35_mtp.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=8, mtp=True)
    return path


PROMPTS = [[3 + (5 * i + 11 * j) % 400 for j in range(40 + 13 * i)] for i in range(3)]


def test_greedy_identical_with_mtp_drafts(mtp_model):
    out, totals = {}, {}
    for spec in ("off", "mtp"):
        eng = Engine(EngineConfig(model=str(mtp_model), spec=spec, ctx_size=256, prefill_chunk=16,
                                  resident_tokens=0))
        try:
            hs = [eng.submit(Request(prompt_ids=p, sampling=SamplingParams(max_tokens=24, temperature=0.0,
                                                                             ignore_eos=True))) for p in PROMPTS]
            out[spec] = [h.result()[1] for h in hs]
            totals[spec] = eng.stats()["totals"]
        finally:
            eng.shutdown()
    assert out["mtp"] == out["off"]
    assert totals["mtp"]["drafted_tokens"] > 20


@pytest.mark.parametrize("slots", [False, True], ids=["cpu_path", "gpu_path"])
def test_sampled_distribution_with_mtp(mtp_model, slots, monkeypatch):
    """The first 3 tokens at temperature 0.8 (top-k 4) with MTP drafts and without, 500 seeds each: the same
    distribution (chi-square). The GPU path verifies the drafts on the device (speculative sampling in
    engine/sample_device.py: verify_drafts, only tokens back), the CPU path on the host."""
    import engine.spec.speculator as es
    calls = collections.Counter()
    real = es.Speculator.verify_chosen
    monkeypatch.setattr(es.Speculator, "verify_chosen", lambda self, *a: (calls.update(["device"]), real(self, *a))[1])
    n = 500
    samples = {}
    for spec in ("off", "mtp"):
        eng = Engine(EngineConfig(model=str(mtp_model), spec=spec, ctx_size=256, max_seqs=16, resident_tokens=0,
                                  spec_max_drafts=3, max_queue=n + 16, static_slots=slots,
                                  prefill_chunk=64 if slots else 512,
                                  spec_adaptive=not slots))   # (GPU path: fixed lengths, no timing)
        try:
            hs = [eng.submit(Request(prompt_ids=PROMPTS[0], sampling=SamplingParams(
                max_tokens=4, temperature=0.8, top_k=4, top_p=1.0, min_p=0.0, seed=seed, ignore_eos=True)))
                for seed in range(n)]
            samples[spec] = collections.Counter(tuple(h.result()[1][:3]) for h in hs)
            if spec == "mtp":   # (a random MTP block's argmax is rarely in the target's top 4: mostly the
                # rejection branch runs here; tests/engine/test_spec_ngram.py exercises both with one verifier)
                assert eng.stats()["totals"]["drafted_tokens"] >= n // 2   # (adaptive lengths: timing-dependent)
                assert (calls["device"] > n // 4) if slots else not calls, calls
        finally:
            eng.shutdown()
    p = _chi2_p(samples["off"], samples["mtp"])
    print(f"MTP ({'GPU' if slots else 'CPU'} path): chi-square homogeneity of the first 3 tokens, {n} seeds per arm: p = {p:.3f}")
    assert p > 0.001, p


def test_warm_up_leaves_the_pool_and_the_drafts_as_they_were(mtp_model):
    """Speculator.warm_up (the GPU path captures the MTP block's pass graphs and compiles its eager kernels with it at
    start) runs the block on the scratch slot only (forced here on the CPU, where warm_up does nothing): the pool's
    blocks are all free after it, and a greedy request then gives the tokens it gives without drafts, with drafts
    proposed."""
    import torch
    cfg = dict(model=str(mtp_model), ctx_size=256, prefill_chunk=16, resident_tokens=0, static_slots=True,
               max_seqs=16)
    out = {}
    for spec in ("off", "mtp"):
        eng = Engine(EngineConfig(spec=spec, **cfg))
        try:
            if spec == "mtp":
                r, m = eng.runner, eng.speculator.mtp_slots
                free = r.pool.n_free
                E = r.spec.n_embd
                for R, S in ((5, 1), (7, 3), (1, 1)):
                    ids, h = m.run_slots([(r.scratch, 0, R - S + 1)] + [(r.scratch, 0, 1)] * (S - 1),
                                         torch.zeros(R, dtype=torch.long), torch.zeros(R, E), [True] * S)
                    assert ids.shape == (S,) and h.shape == (S, E)
                eng.speculator.warm_up()
                assert r.pool.n_free == free == r.pool.n_blocks
            out[spec] = eng.submit(Request(prompt_ids=PROMPTS[1], sampling=SamplingParams(
                max_tokens=24, temperature=0.0, ignore_eos=True))).result()[1]
            if spec == "mtp":
                assert eng.stats()["totals"]["drafted_tokens"] > 0
        finally:
            eng.shutdown()
    assert out["mtp"] == out["off"]


def test_model_without_mtp_block(tmp_path):
    path = tmp_path / "plain.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=8)
    with pytest.raises(EngineError, match="no MTP"):
        Engine(EngineConfig(model=str(path), spec="mtp"))


def test_catch_up_matches_a_full_recompute(mtp_model):
    """The MTP cache kept step by step (prompt chunks, then a verify step whose drafts are all
    accepted) drafts what the block gives when recomputed from scratch over the whole sequence."""
    import torch

    from engine.models import open_model
    from engine.models.common import SeqChunk
    from engine.spec.mtp import CatchUp, MtpState, SequenceRows, catch_up
    m = open_model(mtp_model)
    try:
        def reference_first_draft(tokens):
            kv = m.new_kv(torch.float32)
            _, (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(tokens[:-1]), 0, kv, "last")])
            hid = torch.cat([h.new_zeros(1, h.shape[1]), h])              # h_{p-1} for p = 0..n-1
            (lg,), _ = m.mtp_forward([SeqChunk(torch.tensor(tokens), 0, m.new_mtp_kv(torch.float32), "last")], [hid])
            return int(lg[-1].argmax())

        toks = PROMPTS[1][:37]
        kv, st = m.new_kv(torch.float32), MtpState(m.new_mtp_kv(torch.float32))
        for lo in range(0, len(toks), 16):
            hi = min(lo + 16, len(toks))
            (lg,), (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(toks[lo:hi]), lo, kv, "last")])
            if hi == len(toks):
                toks = toks + [int(lg[-1].argmax())]
            catch_up(SequenceRows(m), [CatchUp(st, toks, lo, h, hi - lo, 3 if hi == len(toks) - 1 else 0)])
        assert len(st.drafts) == 3
        assert st.drafts[0] == reference_first_draft(toks)
        # a verify step [last token, d1, d2] whose drafts are accepted, with a bonus token after them
        start = len(toks) - 1
        chunk = toks[-1:] + st.drafts[:2]
        (lg,), (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(chunk), start, kv, "all", rowwise=True)])
        toks = toks + st.drafts[:2] + [int(lg[-1].argmax())]
        catch_up(SequenceRows(m), [CatchUp(st, toks, start, h, 3, 2)])
        assert st.valid == len(toks)
        assert st.drafts[0] == reference_first_draft(toks)
    finally:
        m.close()


def test_mtp_state_resumes_and_forks(mtp_model):
    """A kept MTP cache continues another request (the GPU path's parked conversations and shared
    prefixes): the rows before n stay, the row of n is written again from the kept h_{n-1}, and the
    drafts are those of a cache that saw the new tokens all along. Where h_{n-1} is not kept, it says so."""
    import torch

    from engine.models import open_model
    from engine.models.common import SeqChunk
    from engine.spec.mtp import CatchUp, MtpState, SequenceRows, catch_up
    m = open_model(mtp_model)
    try:
        def hidden(tokens):
            kv = m.new_kv(torch.float32)
            _, (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(tokens), 0, kv, "all")])
            return h

        def run(st, tokens, h, bounds, k=3):
            for lo, hi in bounds:
                catch_up(SequenceRows(m), [CatchUp(st, tokens, lo, h[lo:hi], hi - lo, k if hi == len(tokens) - 1 else 0)])
            return list(st.drafts)

        old = PROMPTS[2][:45]
        new = old[:32] + [7, 9, 11, 13, 15, 17, 19, 21, 23]            # the same first 32 tokens, then others
        h_old, h_new = hidden(old), hidden(new)
        first = [(0, 16), (16, 32)]
        ref = MtpState(m.new_mtp_kv(torch.float32), mark_every=16)     # the new tokens all along
        run(ref, new, h_new, first)
        assert ref.resume_at(32)                                       # (same grouping of rows as below)
        want = run(ref, new, h_new, [(32, len(new) - 1)])
        assert len(want) == 3

        kept = MtpState(m.new_mtp_kv(torch.float32), mark_every=16)
        run(kept, old, h_old, first + [(32, 44)])
        assert kept.valid == 45 and sorted(kept.marks) == [0, 16, 32]
        fork = kept.fork(32)                                           # another conversation's prefix
        assert fork is not None and fork.valid == 32 and fork.deferred.shape[0] == 1
        assert run(fork, new, h_new, [(32, len(new) - 1)]) == want
        assert kept.valid == 45                                        # the donor is untouched
        assert kept.resume_at(32)                                      # its own follow-up
        assert run(kept, new, h_new, [(32, len(new) - 1)]) == want
        assert not kept.resume_at(20)                                  # h_19 is not kept
        fork.release()
        kept.release()
    finally:
        m.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("oracle", [False, True])
def test_gpu_path_mtp_drafts(mtp_model, oracle, device, monkeypatch):
    """The GPU path (engine/runner/runner.py's slots, on the CPU as in CI, and on CUDA) drafts with the MTP block from the
    runner's hidden rows: greedy output equals decoding without drafts, with several sequences at once;
    a follow-up request continues its parked conversation's MTP cache and another conversation with the
    same first chunk forks it; the target's greedy tokens for the draft rows are chosen on the device (verify_chosen,
    no logits to the host). oracle: the random block's
    drafts are all rejected, so its drafts are replaced (after it wrote its rows) by the undrafted output's
    next tokens, the third of them wrong: accepted drafts, bonus tokens and partial acceptance too."""
    follow = PROMPTS[0] + [5, 6, 7]
    truth = []   # every request's prompt + output without drafts (filled by the first run)

    def oracle_catch_up(model, items, timing=None):
        real_catch_up(model, items, timing)
        for it in items:
            full = next((t for t in truth if t[:len(it.tokens)] == it.tokens), None)
            if full is not None and it.state.drafts:
                d = full[len(it.tokens):len(it.tokens) + len(it.state.drafts)]
                it.state.drafts = [t if i != 2 else t + 1 for i, t in enumerate(d)]

    import engine.spec.speculator as es
    real_catch_up = es.catch_up
    if oracle:
        monkeypatch.setattr(es, "catch_up", oracle_catch_up)
    calls = collections.Counter()   # greedy drafts are verified from the target tokens the device chose
    for name in ("verify", "verify_chosen"):
        real = getattr(es.Speculator, name)
        monkeypatch.setattr(es.Speculator, name,
                            lambda self, *a, _real=real, _name=name: (calls.update([_name]), _real(self, *a))[1])

    def serve(spec):
        eng = Engine(EngineConfig(model=str(mtp_model), spec=spec, ctx_size=256, prefill_chunk=16,
                                  static_slots=True, device=device, max_seqs=4, spec_max_drafts=3, spec_adaptive=False,
                                  state_checkpoints=8))
        try:
            greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            hs = [eng.submit(Request(prompt_ids=p, sampling=greedy)) for p in PROMPTS]
            out = [h.result()[1] for h in hs]
            # the first conversation goes on (its slot parked), then a new one shares its first 32 tokens
            out.append(eng.submit(Request(prompt_ids=PROMPTS[0] + out[0] + follow, sampling=greedy)).result()[1])
            out.append(eng.submit(Request(prompt_ids=PROMPTS[0][:32] + [9] * 20, sampling=greedy)).result()[1])
            stats = eng.stats()
            return out, dict(stats["totals"], mtp_pool=stats["spec"]["mtp_pool"]), eng
        finally:
            eng.shutdown()

    off, _, _ = serve("off")
    prompts = PROMPTS + [PROMPTS[0] + off[0] + follow, PROMPTS[0][:32] + [9] * 20]
    truth.extend(p + o for p, o in zip(prompts, off))
    on, totals, eng = serve("mtp")
    assert on == off
    assert calls["verify_chosen"] > 10 and calls["verify"] == 0, calls
    assert totals["drafted_tokens"] > 40 and totals["mtp_drafted"] == totals["drafted_tokens"]
    if oracle:
        assert 0.4 * totals["drafted_tokens"] < totals["accepted_tokens"] < totals["drafted_tokens"], totals
    assert totals["mtp_resumed"] >= 2, {k: v for k, v in totals.items() if "mtp" in k or "cached" in k or "shared" in k}
    st = totals["mtp_pool"]
    assert st["cache_type"] == "f16" and st["parked_states"] == len(eng.speculator.parked_mtp) > 0
    for slot in list(eng.speculator.parked_mtp):
        eng.speculator.drop_parked(slot)
    assert not eng.speculator.parked_mtp


def test_mtp_rows_room_in_the_runners_pool(mtp_model):
    """MtpSlots.room (the chained drafts' MTP rows past a slot's positions): blocks taken from the runner's pool up to
    the end asked for, never past the slot's context, only what is free when the pool runs short; done gives back
    what room took beyond the state's final rows."""
    from engine.models import open_model
    from engine.runner import Runner
    from engine.runner.mtp import MtpSlots
    from engine.spec.mtp import MtpState
    m = open_model(mtp_model)
    try:
        r = Runner(m, device="cpu", n_slots=2, max_ctx=48, n_blocks=5)
        mtp = MtpSlots(r, "f16")
        a, b = MtpState(None, slot=0), MtpState(None, slot=1)
        r.reserve(0, 38, 0)                                   # slot 0 holds positions 0..37: 3 blocks
        assert mtp.room(a, 38, 52) == 48 and r.held(0) == 3   # (the context ends at 48)
        r.truncate(0, 30)
        assert mtp.room(a, 30, 40) == 40 and r.held(0) == 3 and r.pool.n_free == 2
        a.valid = 31
        mtp.done(a)                                           # row 30 is final: its block stays
        assert r.held(0) == 2 and r.pool.n_free == 3
        r.reserve(1, 40, 0)                                   # slot 1 takes the 3 free blocks
        assert mtp.room(a, 31, 36) == 32 and r.held(0) == 2   # nothing free: what slot 0 holds
        mtp.done(a)
        assert r.held(0) == 2 and r.held(1) == 3
        assert mtp.room(b, 40, 48) == 48                      # (within what it holds)
    finally:
        m.close()
