"""The Engine contract on the CPU with the real demo model: streaming, concurrency, cancel, errors."""
from __future__ import annotations

import threading
import time

import pytest

from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.types import ContextTooLongError, EngineError, FinishEvent, Request, TokenEvent


@pytest.fixture(scope="module")
def engine(smollm2_path):
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=2048))
    yield eng
    eng.shutdown()


def _greedy(n=16, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def _chat(text):
    return [{"role": "user", "content": text}]


def test_stream_and_finish(engine):
    h = engine.submit(Request(messages=_chat("What is the capital of France?"), sampling=_greedy(24)))
    events = list(h)
    assert isinstance(events[-1], FinishEvent)
    toks = [e for e in events if isinstance(e, TokenEvent)]
    text = "".join(e.text for e in toks)
    ids = [i for e in toks for i in e.ids]
    assert text.strip()
    assert events[-1].reason in ("stop", "length")
    assert events[-1].usage.completion_tokens >= len(ids)
    assert events[-1].usage.prompt_tokens == h.n_prompt
    # streamed text equals the detokenized ids
    assert text == engine.tokenizer.decode(ids)


def test_concurrent_requests_match_solo(engine):
    """Two requests in the same steps give the same greedy tokens as each alone."""
    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime."]
    solo = [engine.submit(Request(messages=_chat(p), sampling=_greedy(20, ignore_eos=True))).result()[1]
            for p in prompts]
    handles = [engine.submit(Request(messages=_chat(p), sampling=_greedy(20, ignore_eos=True))) for p in prompts]
    together = [h.result()[1] for h in handles]
    assert together == solo
    assert all(len(t) == 20 for t in together)


def test_seeded_sampling_reproducible(engine):
    def run(seed):
        p = SamplingParams(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, ignore_eos=True)
        return engine.submit(Request(prompt="Once upon a time", sampling=p)).result()[1]
    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


def test_stop_string(engine):
    text, ids, fin = engine.submit(Request(messages=_chat("Count from 1 to 10 separated by commas."),
                                           sampling=_greedy(40, stop=["5"]))).result()
    assert fin.reason == "stop"
    assert "5" not in text and "4" in text


def test_max_tokens_length(engine):
    _, ids, fin = engine.submit(Request(prompt="The", sampling=_greedy(5, ignore_eos=True))).result()
    assert fin.reason == "length" and len(ids) == 5 and fin.usage.completion_tokens == 5


def test_cancel_frees_sequence(engine):
    h = engine.submit(Request(prompt="Tell me a long story.", sampling=_greedy(500, ignore_eos=True)))
    first = next(iter(h))
    assert isinstance(first, TokenEvent)
    h.cancel()
    fin = [e for e in h if isinstance(e, FinishEvent)][-1]
    assert fin.reason == "cancelled"
    deadline = time.time() + 10
    while engine.stats()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert engine.stats()["running"] == 0


def test_stats_while_running(engine):
    h = engine.submit(Request(prompt="Hello", sampling=_greedy(30, ignore_eos=True), session="agent-1"))
    seen = []
    for ev in h:
        if isinstance(ev, TokenEvent) and not seen:
            seen = engine.stats()["sequences"]
    (s,) = [x for x in seen if x["session"] == "agent-1"]
    assert s["state"] == "decoding" and s["context"] > s["prompt_tokens"] - 1 and s["ctx_limit"] == 2048
    st = engine.stats()
    assert st["running"] == 0 and st["totals"]["generated_tokens"] > 0


def test_bad_requests_raise(engine):
    with pytest.raises(ValueError):
        engine.submit(Request(prompt="x", sampling=SamplingParams(temperature=-1)))
    with pytest.raises(EngineError, match="exactly one"):
        engine.submit(Request(prompt="x", messages=_chat("y")))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.submit(Request(prompt_ids=[1, 10**9]))
    with pytest.raises(ContextTooLongError, match="too many"):
        engine.submit(Request(prompt_ids=[1] * 4000))
    with pytest.raises(EngineError, match="chat template"):
        engine.submit(Request(messages=[{"content": "no role"}]))


def test_many_threads_submit(engine):
    """Submitting from several threads at once is safe; all finish."""
    results = []

    def worker(i):
        results.append(engine.submit(Request(prompt=f"Number {i}:", sampling=_greedy(4, ignore_eos=True))).result())
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert len(results) == 4 and all(r[2].reason == "length" for r in results)


class _OnlyDigits:
    """A toy constraint: digits only, done after 3 tokens."""

    def __init__(self, tokenizer):
        self.allowed = [i for i in range(tokenizer.vocab_size)
                        if tokenizer.token_bytes(i).decode("utf-8", "replace").strip().isdigit()]
        self.n = 0

    def mask(self, logits):
        keep = logits[self.allowed].clone()
        logits.fill_(float("-inf"))
        logits[self.allowed] = keep

    def accept(self, token_id):
        self.n += 1

    def is_done(self):
        return self.n >= 3


def test_constraint_masks_and_finishes(engine):
    c = _OnlyDigits(engine.tokenizer)
    req = Request(prompt="My favourite colour is", constraint=c,
                  sampling=SamplingParams(max_tokens=20, temperature=0.0, logprobs=2))
    events = list(engine.submit(req))
    fin = events[-1]
    toks = [e for e in events if isinstance(e, TokenEvent) and e.ids]
    assert fin.reason == "stop" and len(toks) == 3
    assert all(set(ids) <= set(c.allowed) for ids in (t.ids for t in toks))
    # logprobs describe the model's own distribution, not the masked one
    assert all(t.logprobs and t.logprobs[0].logprob <= 0 and len(t.logprobs[0].top) == 2 for t in toks)
