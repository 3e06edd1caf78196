"""/metrics' and /slots' speculative-decoding figures read what engine.stats() reports (they once read keys
the engine never wrote, and stayed 0): a real engine drafting with n-gram lookup on a tiny synthetic model."""
from __future__ import annotations

import re

from app.server.metrics import Metrics
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.tools.synth import write_synthetic
from engine.types import Request

PATTERN = [11, 12, 13, 14, 15, 16, 17]


def _value(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^hivejet_{name}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, (name, labels)
    return float(m.group(1))


def test_draft_metrics_follow_the_engine(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, "llama", "tiny", seed=4)
    eng = Engine(EngineConfig(model=str(path), spec="ngram", ctx_size=256, resident_tokens=0))
    try:
        eng.submit(Request(prompt_ids=PATTERN * 6 + PATTERN[:3],
                           sampling=SamplingParams(max_tokens=16, temperature=0.0))).result()
        st = eng.stats()
    finally:
        eng.shutdown()
    text = Metrics().render(st)
    drafted, accepted = st["totals"]["drafted_tokens"], st["totals"]["accepted_tokens"]
    assert drafted > 0
    assert _value(text, "draft_tokens_proposed_total") == drafted
    assert _value(text, "draft_tokens_accepted_total") == accepted
    assert _value(text, "drafter_tokens_proposed_total", '{drafter="ngram"}') == drafted
    assert _value(text, "drafter_tokens_accepted_total", '{drafter="ngram"}') == accepted
    assert abs(_value(text, "draft_acceptance_ratio") - accepted / drafted) < 1e-5
    from app.top.client import metric, parse_metrics       # what `hivejet top` reads: one total each
    m = parse_metrics(text)
    assert metric(m, "draft_tokens_proposed_total") == drafted
    assert metric(m, "draft_acceptance_ratio") == _value(text, "draft_acceptance_ratio")


def test_state_checkpoint_metrics_follow_the_engine(tmp_path):
    """A qwen35 engine on the GPU path's scheduling (static slots on the CPU) with host checkpoints: /metrics
    reports how many it keeps, where, their bytes and evictions, as engine.stats() does."""
    path = tmp_path / "q.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=21)
    eng = Engine(EngineConfig(model=str(path), ctx_size=256, max_seqs=2, prefill_chunk=16, static_slots=True,
                              state_checkpoints=4, checkpoint_memory="host"))
    try:
        eng.submit(Request(prompt_ids=list(range(3, 93)), sampling=SamplingParams(max_tokens=4, temperature=0.0))).result()
        st = eng.stats()
    finally:
        eng.shutdown()
    ck = st["kv_pool"]["state_checkpoints"]
    assert ck["kept"] == 2 and ck["memory"] == "host" and ck["bytes"] > 0     # at 64 (every 4th) and 80 (the end)
    text = Metrics().render(st)
    assert _value(text, "state_checkpoints", '{memory="host"}') == 2
    assert _value(text, "state_checkpoint_bytes", '{memory="host"}') == ck["bytes"]
    assert _value(text, "state_checkpoints_evicted_total") == 0
    assert "hivejet_state_checkpoints" not in Metrics().render(dict(st, kv_pool=dict(st["kv_pool"], state_checkpoints=None)))
