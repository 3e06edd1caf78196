"""Adaptive draft length (engine/spec/adaptive.py): the chooser with synthetic costs (large k when drafts
are cheap and usually right, k = 0 when they are never right, when the drafter costs too much or when
rows are not free), the step-cost estimate, back-off with re-probing, and in the engine (synthetic
qwen35 with an MTP block and a DFlash drafter): useless drafters back off (drafted tokens stop growing)
with output token-for-token the output without drafts, cheap right drafts keep the full length, and
the drafters' upkeep put off while backed off (MTP catch-up, DFlash context) gives the same numbers."""
from __future__ import annotations

import types

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.models import open_model
from engine.models.common import SeqChunk
from engine.sampling import SamplingParams
from engine.spec.adaptive import DraftLength, StepCosts, choose_k, expected_tokens
from engine.spec.dflash import load_drafter
from engine.tools.synth_dflash import write_synthetic_dflash
from engine.spec.mtp import CatchUp, MtpState, SequenceRows, catch_up
from engine.tools.synth import write_synthetic
from engine.types import Request

PROMPTS = [[3 + (5 * i + 11 * j) % 400 for j in range(40 + 13 * i)] for i in range(3)]


def linear(fixed: float, per_row: float):
    return lambda n: fixed + per_row * n


# ----- the chooser ------------------------------------------------------------------------------

def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(0.7, 0) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.9, 8) == pytest.approx(sum(0.9 ** i for i in range(9)))


def test_high_acceptance_and_cheap_drafts_take_a_long_draft():
    # memory-bound: a row costs 1 % of the step, drafting is free (n-gram)
    k = choose_k(0.9, 8, linear(10.0, 0.1), 1, lambda k: 0.0)
    assert k >= 6
    assert choose_k(0.97, 16, linear(10.0, 0.1), 1, lambda k: 0.0) >= 14


def test_no_acceptance_no_drafts():
    assert choose_k(0.0, 8, linear(10.0, 0.0), 1, lambda k: 0.0) == 0   # even when rows are free
    assert choose_k(0.0, 8, linear(10.0, 0.1), 1, lambda k: 0.0) == 0


def test_expensive_drafter_backs_off_even_at_moderate_acceptance():
    t = linear(10.0, 0.5)
    # a drafter as costly as the target step: needs E(k) > 2, i.e. alpha above 1/2
    assert choose_k(0.5, 8, t, 1, lambda k: 10.5 if k else 0.0) == 0
    assert choose_k(0.6, 8, t, 1, lambda k: 21.0 if k else 0.0) == 0   # twice as costly
    assert choose_k(0.6, 8, t, 1, lambda k: 0.5 if k else 0.0) > 0     # the same acceptance, a cheap drafter
    # MTP-like: each chained draft costs a little: long drafts only while they pay
    per_draft = 2.0
    k_cheap = choose_k(0.8, 8, t, 1, lambda k: 0.1 * max(0, k - 1))
    k_dear = choose_k(0.8, 8, t, 1, lambda k: per_draft * max(0, k - 1))
    assert 0 < k_dear < k_cheap


def test_rows_that_cost_as_much_as_steps_never_pay():
    # compute-bound: T proportional to the rows, so k drafts cost k rows and yield at most k tokens
    for alpha in (0.5, 0.9, 0.99):
        assert choose_k(alpha, 8, linear(0.0, 1.0), 1, lambda k: 0.0) == 0


def test_shared_step_counts_the_other_sequences():
    t = linear(10.0, 1.0)
    assert choose_k(0.5, 8, t, 1, lambda k: 0.0) > 0                    # alone: its drafts pay
    # with 7 others in the step, its extra rows slow all 8 for half a token each: no
    assert choose_k(0.5, 8, t, 8, lambda k: 0.0, others_tokens=7.0) == 0


def test_nothing_measured_is_optimistic():
    assert choose_k(0.5, 8, lambda n: None, 1, lambda k: 1e9) == 8
    assert choose_k(0.0, 8, lambda n: None, 1, lambda k: 0.0) == 0


# ----- step costs ------------------------------------------------------------------------------

def test_step_costs_interpolate_and_extrapolate():
    c = StepCosts()
    assert c.step_time(4) is None and c.draft_time("dflash", 3) == 0.0
    c.add_step(4, 0.004)
    assert c.step_time(1) == c.step_time(100) == pytest.approx(0.004)   # one bucket: flat
    for n in (1, 2, 4, 8, 16):
        for _ in range(30):
            c.add_step(n, 0.002 + 0.0005 * n)
    assert c.step_time(3) == pytest.approx(0.0035, rel=1e-3)
    assert c.step_time(12) == pytest.approx(0.008, rel=1e-3)
    assert c.step_time(32) == pytest.approx(0.018, rel=1e-3)            # the last segment's slope
    assert [c.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    c.add_step(6, 0.0001)           # a fast outlier in a slower bucket: the curve stays non-decreasing
    ts = [c.step_time(n) for n in range(1, 40)]
    assert all(b >= a for a, b in zip(ts, ts[1:]))
    c.add_draft("dflash", 0.006, 3)
    c.add_draft("mtp", 0.004, 4)
    assert c.draft_time("dflash", 1) == c.draft_time("dflash", 7) == pytest.approx(0.002)
    assert c.draft_time("mtp", 1) == 0.0 and c.draft_time("mtp", 5) == pytest.approx(0.004)
    assert c.draft_time("dflash", 0) == 0.0 and c.draft_time(None, 3) == 0.0
    assert set(c.summary()) == {"step_ms", "draft_ms"}


# ----- back-off and re-probing -----------------------------------------------------------------

def test_back_off_and_probe_schedule():
    d = DraftLength(8)
    assert d.k == 8 and not d.backed_off
    d.observe(8, 0)
    assert d.alpha < 0.5
    ks = [d.decide(0) for _ in range(40)]
    assert d.backed_off
    assert ks[:15] == [0] * 15 and ks[15] == 2        # a probe of 2 drafts after 16 steps
    d.observe(2, 0)                                    # it fails: the next one after 32 steps
    ks = [d.decide(0) for _ in range(40)]
    assert ks.index(2) == 31
    d.observe(2, 2)                                    # fully accepted: at once, twice as long
    assert d.decide(0) == 4
    d.observe(4, 4)
    assert d.decide(0) == 8
    d.observe(8, 8)                                    # k_max reached: back to the plain schedule
    assert d.decide(0) == 0
    assert d.decide(5) == 5 and not d.backed_off       # the chooser takes it up again


def test_fresh_sequence_that_starts_backed_off_probes_at_once():
    d = DraftLength(8)
    assert d.decide(0) == 2 and d.backed_off


def test_sequence_that_turns_repetitive_picks_speculation_up_again():
    """Simulated: drafts useless for 100 steps, then right 95 % of the time (a code edit), with the
    chooser and costs of a memory-bound target; a deterministic stand-in for acceptance."""
    t, draft = linear(10.0, 0.2), (lambda k: 0.0)
    d = DraftLength(8)
    rng = torch.Generator().manual_seed(0)
    drafted_before = drafted_after = 0
    resumed_at = None
    for step in range(220):
        k = d.k
        good = 0.95 if step >= 100 else 0.0
        n_acc = 0
        while n_acc < k and torch.rand((), generator=rng).item() < good:
            n_acc += 1
        d.observe(k, n_acc)
        if step < 100:
            drafted_before += k
        else:
            drafted_after += k
        d.decide(choose_k(d.alpha, d.k_max, t, 1, draft))
        if step >= 100 and resumed_at is None and not d.backed_off:
            resumed_at = step
    assert drafted_before <= 8 + 8 * 2                 # the first step, then probes only
    assert resumed_at is not None and resumed_at < 100 + 40
    assert d.k >= 6 and drafted_after > 400


# ----- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A synthetic qwen35 with an MTP block (a random one: its drafts are almost never right), a
    DFlash drafter with random weights (useless drafts) and a derived one (often right)."""
    d = tmp_path_factory.mktemp("adaptive")
    target = d / "qwen35.gguf"
    write_synthetic(target, "qwen35", "tiny", seed=8, mtp=True)
    return types.SimpleNamespace(target=target,
                                 useless=write_synthetic_dflash(d / "useless", target, seed=1, derived=False))


def _engine(pair, spec, **kw):
    return Engine(EngineConfig(model=str(pair.target), spec=spec, spec_drafter=str(pair.useless), ctx_size=512,
                               prefill_chunk=16, resident_tokens=0, **kw))


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _off(pair, prompts, n):
    eng = _engine(pair, "off")
    try:
        return [h.result()[1] for h in [eng.submit(Request(prompt_ids=p, sampling=_greedy(n))) for p in prompts]]
    finally:
        eng.shutdown()


class FrozenCosts(StepCosts):
    """Fixed synthetic costs: T(n) = fixed + per_row * n, a constant drafting time per unit."""

    def __init__(self, fixed, per_row, draft=0.0):
        super().__init__()
        self.t, self.d = linear(fixed, per_row), draft

    def add_step(self, rows, secs):
        pass

    def add_draft(self, drafter, secs, units):
        pass

    def step_time(self, rows):
        return self.t(rows)

    def draft_time(self, drafter, k):
        return self.d * (k > 0)


class Recorded(DraftLength):
    """DraftLength that logs every decision (k, backed off) and observation: what the engine chose,
    step by step, without racing the engine thread."""
    log: list = []

    def decide(self, k):
        out = super().decide(k)
        Recorded.log.append(("decide", out, self.backed_off))
        return out

    def observe(self, drafted, accepted):
        super().observe(drafted, accepted)
        if drafted:
            Recorded.log.append(("observe", drafted, accepted))


@pytest.fixture
def recorded(monkeypatch):
    import engine.spec.speculator as spec_mod
    monkeypatch.setattr(spec_mod, "DraftLength", Recorded)
    Recorded.log = []
    return Recorded.log


def _watch(eng, spec):
    """Hooks on one engine: the sequences it attaches drafters to, and whether a step ended with
    drafter upkeep put off (MTP hidden rows / DFlash context rows deferred)."""
    seen = types.SimpleNamespace(seqs=[], deferred=0)
    sp = eng.speculator
    attach, after = sp.attach, (sp.dflash_step if spec == "dflash" else sp.adapt_draft_lengths)

    def grab(s):
        seen.seqs.append(s)
        attach(s)

    def check(*a):
        after(*a)
        for s in seen.seqs:   # (MTP: the deferral of the step before this one's catch-up)
            seen.deferred += getattr(s.dflash if spec == "dflash" else s.mtp, "deferred", None) is not None
    sp.attach, sp.dflash_step, sp.adapt_draft_lengths = grab, \
        (check if spec == "dflash" else sp.dflash_step), (check if spec == "mtp" else sp.adapt_draft_lengths)
    return seen


@pytest.mark.parametrize("spec", ["dflash", "mtp"])
def test_useless_drafts_back_off_with_identical_output(pair, spec, recorded):
    """Measured costs: the drafts are almost never accepted, so after the first steps the sequence
    drafts only in probes; the output is the output without drafts. DFlash: the context put off
    while backed off and appended in one batch later holds the rows a full recompute gives."""
    n = 90
    (base,) = _off(pair, [PROMPTS[0]], n)
    eng = _engine(pair, spec)
    try:
        seen = _watch(eng, spec)
        h = eng.submit(Request(prompt_ids=PROMPTS[0], sampling=_greedy(n)))
        st = None
        out = []
        for ev in h:
            out += getattr(ev, "ids", [])
            st = st or next((x for x in eng.stats()["sequences"] if x["id"] == h.id), None)
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert out == base
    assert st is None or st["spec_lengths"][spec]["k"] == st["spec_k"]
    decisions = [(k, b) for what, k, b in recorded if what == "decide"]
    drafted = [d for what, d, _ in recorded if what == "observe"]
    assert len(decisions) > 60 and sum(b for _, b in decisions) > len(decisions) - 8   # backed off almost at once
    late = sum(k for k, _ in decisions[10:])
    assert 0 < late <= 2 * (len(decisions) // 16 + 1), decisions   # only probes of 2, at most every 16 steps
    assert stats["totals"]["drafted_tokens"] == sum(drafted) < 3 * n // 4   # (without back-off: 8 a step)
    assert stats["spec"]["adaptive"] and stats["spec"]["costs"]["draft_ms"].get(spec, 0) > 0
    assert seen.deferred > 20
    if spec == "dflash":
        (seq,) = seen.seqs
        dst = seq.dflash
        m = open_model(pair.target)
        try:
            dr = load_drafter(pair.useless)
            m.capture_layers = dr.cfg.target_layer_ids
            c = SeqChunk(torch.tensor(seq.tokens[:dst.length]), 0, m.new_kv(torch.float32), "last")
            m.forward([c])
            ref = dr.new_state()
            dr.extend([(ref, c.features)])
            assert dst.length > len(PROMPTS[0]) + 40
            for il in range(dr.cfg.n_layer):
                got, want = dst.keys[il].rows(0, dst.length), ref.keys[il].rows(0, dst.length)
                assert (got - want).abs().max() < 2e-2 * want.abs().max(), il
        finally:
            m.close()


def test_cheap_right_drafts_keep_the_full_length(pair, recorded):
    """n-gram drafts (free) on a prompt whose continuation repeats a span of it, with a memory-bound
    synthetic cost (a row 1 % of the step): full length, not backed off, output unchanged. With
    rows costing as much as whole steps the same drafts do not pay: backed off, probes only."""
    (cont,) = _off(pair, [PROMPTS[0][:20]], 24)
    prompt = PROMPTS[0][:20] + cont + PROMPTS[0][:20] + cont[:4]
    (base,) = _off(pair, [prompt], 20)
    seen = {}
    for name, costs in (("cheap", FrozenCosts(0.01, 0.0001)), ("dear", FrozenCosts(0.0, 0.001))):
        recorded.clear()
        eng = _engine(pair, "ngram", spec_max_drafts=6)
        eng.speculator.costs = costs
        try:
            assert eng.submit(Request(prompt_ids=prompt, sampling=_greedy(20))).result()[1] == base
            seen[name] = ([(k, b) for what, k, b in recorded if what == "decide"], eng.stats()["totals"])
        finally:
            eng.shutdown()
    ks, t = seen["cheap"]
    # from the prior (alpha 0.5) at the start, then the full length: 20 tokens in a few steps
    assert ks[0][0] >= 4 and all(k == 6 and not b for k, b in ks[1:]) and not ks[0][1], ks
    assert t["accepted_tokens"] > 10 and t["steps"] <= 9
    ks, t = seen["dear"]
    assert ks[0] == (2, True) and all(b for _, b in ks), ks   # backed off from the start: a probe of 2 first
    assert t["steps"] > seen["cheap"][1]["steps"]


def test_deferred_mtp_catch_up_drafts_as_a_full_recompute(pair, monkeypatch):
    """Decode steps whose MTP catch-up is put off (drafting backed off), then one that drafts: the
    rows written in one batch give the first draft a recompute from scratch gives; also when the
    deferred rows overflow MAX_DEFERRED and are written on the way."""
    import engine.spec.mtp as mtp_mod
    m = open_model(pair.target)
    try:
        def reference_first_draft(tokens):
            kv = m.new_kv(torch.float32)
            _, (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(tokens[:-1]), 0, kv, "last")])
            hid = torch.cat([h.new_zeros(1, h.shape[1]), h])
            (lg,), _ = m.mtp_forward([SeqChunk(torch.tensor(tokens), 0, m.new_mtp_kv(torch.float32), "last")], [hid])
            return int(lg[-1].argmax())

        for limit in (64, 3):
            monkeypatch.setattr(mtp_mod, "MAX_DEFERRED", limit)
            toks = list(PROMPTS[1][:30])
            kv, st = m.new_kv(torch.float32), MtpState(m.new_mtp_kv(torch.float32))
            (lg,), (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(toks), 0, kv, "last")])
            toks.append(int(lg[-1].argmax()))
            catch_up(SequenceRows(m), [CatchUp(st, toks, 0, h, 30, 0)])
            seen = 0
            for step in range(8):
                start = len(toks) - 1
                (lg,), (h,) = m.forward_with_hidden([SeqChunk(torch.tensor(toks[-1:]), start, kv, "last")])
                toks.append(int(lg[-1].argmax()))
                last = step == 7
                catch_up(SequenceRows(m), [CatchUp(st, toks, start, h, 1, 2 if last else 0, defer=not last)])
                seen = max(seen, 0 if st.deferred is None else st.deferred.shape[0])
                assert st.valid + (0 if st.deferred is None else st.deferred.shape[0]) == len(toks)
            assert seen == min(7, limit) and st.deferred is None and st.valid == len(toks)
            assert len(st.drafts) == 2 and st.drafts[0] == reference_first_draft(toks)
    finally:
        m.close()
