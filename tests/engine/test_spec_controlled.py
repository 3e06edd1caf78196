"""Drafts at a controlled acceptance (engine/spec/controlled.py): each position replaced by the target's
token at its rate, the others rejected; through the engine the verification stays exact and accepts
exactly what the rates say."""
from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.spec.controlled import ControlledAcceptance, parse_rates
from engine.tools.synth import write_synthetic
from engine.types import Request


def test_parse_rates():
    assert parse_rates("0.92, 0.80,0.65") == [0.92, 0.8, 0.65]
    for bad, why in [("", "one rate per draft position"), ("0.9,,0.5", "one rate per draft position"),
                     ("0.9,x", "'x' is not a number"), ("1.2", "outside [0, 1]"), ("-0.1", "outside [0, 1]")]:
        with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
            parse_rates(bad)


def test_replace_follows_the_rates_position_by_position():
    full = [1, 2, 3, 10, 11, 12, 13, 14]
    c = ControlledAcceptance([1.0, 0.0], [full], vocab_size=100)
    # after [1, 2, 3] the target continues 10, 11, 12: position 1 kept (rate 1), 2 rejected (rate 0), 3 past the rates
    assert c.replace([1, 2, 3], [50, 50, 50]) == [10, 12, 13]
    assert c.replace([1, 2, 3, 10, 11, 12, 13], [7, 7, 7]) == [14]   # the continuation ends: fewer drafts
    assert c.replace([9, 9], [4, 5]) == [4, 5]                      # not a known request: the drafter's own
    assert c.replace([1, 2, 3], []) == []
    assert (c.replaced, c.by_truth) == (4, 2)
    wrap = ControlledAcceptance([0.0], [[1, 99]], vocab_size=100)
    assert wrap.replace([1], [5]) == [0]                           # the rejected token stays in the vocabulary
    with pytest.raises(ValueError):
        ControlledAcceptance([0.5, 1.5], [full], vocab_size=100)


def test_replace_draws_each_position_at_its_rate():
    full = list(range(100))
    c = ControlledAcceptance([0.9, 0.5, 0.1], [full], vocab_size=1000, seed=3)
    hits = [0, 0, 0]
    for _ in range(4000):
        out = c.replace(full[:10], [0, 0, 0])
        for i in range(3):
            hits[i] += out[i] == full[10 + i]
    assert [round(h / 4000, 1) for h in hits] == [0.9, 0.5, 0.1]
    again = ControlledAcceptance([0.9, 0.5, 0.1], [full], vocab_size=1000, seed=3)
    first = ControlledAcceptance([0.9, 0.5, 0.1], [full], vocab_size=1000, seed=3)
    assert [again.replace(full[:10], [0] * 3) for _ in range(20)] == [first.replace(full[:10], [0] * 3) for _ in range(20)]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctl") / "qwen35_mtp.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=8, mtp=True)
    return path


PROMPTS = [[3 + (7 * i + 13 * j) % 400 for j in range(24 + 5 * i)] for i in range(2)]


@pytest.mark.parametrize("static_slots", [False, True])
def test_engine_accepts_what_the_rates_say(mtp_model, static_slots):
    """Rates (1, 1, 0) with three drafts: every verification accepts the first two and rejects the third, so
    the output is the plain run's and accepted = 2/3 of drafted; rate 0: nothing accepted, same output."""
    greedy = SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True)
    cfg = dict(model=str(mtp_model), ctx_size=128, prefill_chunk=16, static_slots=static_slots, max_seqs=2,
               resident_tokens=0)
    off = Engine(EngineConfig(**cfg))
    try:
        plain = [h.result()[1] for h in [off.submit(Request(prompt_ids=p, sampling=greedy)) for p in PROMPTS]]
    finally:
        off.shutdown()
    truth = [p + o for p, o in zip(PROMPTS, plain)]
    eng = Engine(EngineConfig(**cfg, spec="mtp", spec_max_drafts=3, spec_adaptive=False))
    try:
        for rates, share in [([1.0, 1.0, 0.0], None), ([0.0], 0.0)]:
            eng.speculator.control = control = ControlledAcceptance(rates, truth, eng.spec.vocab_size)
            before = dict(eng.stats()["totals"])
            out = [h.result()[1] for h in [eng.submit(Request(prompt_ids=p, sampling=greedy)) for p in PROMPTS]]
            tot = {k: v - before.get(k, 0) for k, v in eng.stats()["totals"].items()}
            assert out == plain
            assert tot["drafted_tokens"] == control.replaced > 10
            assert tot["accepted_tokens"] == control.by_truth if share is None else tot["accepted_tokens"] == 0
    finally:
        eng.shutdown()
