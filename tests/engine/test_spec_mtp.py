"""MTP speculative decoding (engine/spec/mtp.py) on a synthetic qwen35 with an MTP block: greedy output
is token-for-token the output without drafts, drafts are proposed and verified, the sampled
distribution at temperature 0.8 is unchanged (chi-square), and models without the block say so."""
from __future__ import annotations

import collections

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.synth import write_synthetic
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


def test_sampled_distribution_with_mtp(mtp_model):
    n = 500
    samples = {}
    for spec in ("off", "mtp"):
        eng = Engine(EngineConfig(model=str(mtp_model), spec=spec, ctx_size=256, max_seqs=16, resident_tokens=0,
                                  spec_max_drafts=3, max_queue=n + 16))
        try:
            hs = [eng.submit(Request(prompt_ids=PROMPTS[0], sampling=SamplingParams(
                max_tokens=4, temperature=0.8, top_k=4, top_p=1.0, min_p=0.0, seed=seed, ignore_eos=True)))
                for seed in range(n)]
            samples[spec] = collections.Counter(tuple(h.result()[1][:3]) for h in hs)
            if spec == "mtp":   # (a random MTP block's argmax is rarely in the target's top 4: mostly the
                # rejection branch runs here; tests/engine/test_spec_ngram.py exercises both with one verifier)
                assert eng.stats()["totals"]["drafted_tokens"] > n
        finally:
            eng.shutdown()
    p = _chi2_p(samples["off"], samples["mtp"])
    print(f"MTP: chi-square homogeneity of the first 3 tokens, {n} seeds per arm: p = {p:.3f}")
    assert p > 0.001, p


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
    from engine.spec.mtp import CatchUp, MtpState, catch_up
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
            catch_up(m, [CatchUp(st, toks, lo, h, hi - lo, 3 if hi == len(toks) - 1 else 0)])
        assert len(st.drafts) == 3
        assert st.drafts[0] == reference_first_draft(toks)
        # a verify step [last token, d1, d2] whose drafts are accepted, with a bonus token after them
        start = len(toks) - 1
        chunk = toks[-1:] + st.drafts[:2]
        (lg,), (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(chunk), start, kv, "all", rowwise=True)])
        toks = toks + st.drafts[:2] + [int(lg[-1].argmax())]
        catch_up(m, [CatchUp(st, toks, start, h, 3, 2)])
        assert st.valid == len(toks)
        assert st.drafts[0] == reference_first_draft(toks)
    finally:
        m.close()
