"""/metrics' and /slots' speculative-decoding figures read what engine.stats() reports (they once read keys
the engine never wrote, and stayed 0): a real engine drafting with n-gram lookup on a tiny synthetic model."""
from __future__ import annotations

import re

from app.server.metrics import Metrics
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.synth import write_synthetic
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
