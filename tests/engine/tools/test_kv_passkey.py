"""Passkey retrieval (engine/tools/passkey.py): the forked trials equal fresh runs of the same prompt,
and, slow, a 2K-token version of docs/KV_CACHE.md's long-context test with every cache type."""
from __future__ import annotations

import pytest
import torch

from engine.tools.passkey import build_prompt, run_passkey, summary
from engine.models import open_model
from engine.models.common import SeqChunk
from engine.tokenizer import Tokenizer

TYPES = ["f16", "q8_0", "turbo4", "turbo3", "turbo3_tcq", "turbo2", "turbo2_tcq"]


def _open(path):
    m = open_model(path)
    return m, Tokenizer.from_metadata(m.file.metadata)


def test_forked_trials_equal_fresh_runs(smollm2_path):
    """Trials share the prompt up to the first key through fork() (copy-on-write blocks); each answer
    must be what the whole prompt gives in a fresh sequence."""
    m, tok = _open(smollm2_path)
    try:
        trials = run_passkey(m, tok, 300, [0.2, 0.7], ["f16"], seed=3, chunk=64, answer_tokens=4)
        pool = m.kv_pool("f16", "f16")
        assert all(g.n_used == 0 for g in pool.groups)          # trials release their blocks
        for t in trials:
            ids = build_prompt(tok, 300, t.depth, t.key)
            assert len(ids) == t.n_tokens
            kv = m.new_kv()
            (lg,) = m.forward([SeqChunk(torch.tensor(ids), 0, kv, "last")])
            out, p = [], len(ids)
            for _ in range(4):
                out.append(int(lg[-1].argmax()))
                (lg,) = m.forward([SeqChunk(torch.tensor(out[-1:]), p, kv, "last")])
                p += 1
            assert tok.decode(out) == t.answer
    finally:
        m.close()


@pytest.mark.slow
def test_passkey_2k_every_cache_type(gemma3_path):
    """Gemma-3-270M, a key in the middle of 2K tokens of filler (about 2 minutes on 2 cores)."""
    m, tok = _open(gemma3_path)
    try:
        trials = run_passkey(m, tok, 2048, [0.5], TYPES, seed=1)
    finally:
        m.close()
    rows = {ct: (found, n, same, nll) for ct, found, n, same, nll in summary(trials)}
    print(rows)
    assert rows["f16"][0] == 1
    for ct in ("q8_0", "turbo4", "turbo3", "turbo3_tcq"):
        assert rows[ct][0] == 1, (ct, [t.answer for t in trials if t.cache_type == ct])
