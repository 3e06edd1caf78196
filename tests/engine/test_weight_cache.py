"""The CPU path keeps repacked weights within a process-wide budget (engine/models/common.py:
DequantBudget): the same logits as expanding them on every call, the budget respected and given back."""
from __future__ import annotations

import gc

import torch

from engine.models import common, open_model
from engine.models.common import DequantBudget, SeqChunk

TINY_SEED = 3


def _logits(path):
    model = open_model(path)
    return model, model.forward([SeqChunk(torch.arange(5, 25), 0, model.new_kv(torch.float32))])[0]


def _budget(monkeypatch, nbytes: int) -> DequantBudget:
    b = DequantBudget(nbytes)
    monkeypatch.setattr(common, "DEQUANT_CACHE", b)
    return b


def _expanded(model) -> int:
    """Bytes of the model's weights kept repacked (integers and scales, or dequantized float32 tiles)."""
    ints = sum(w._ints.nbytes for w in _weights(model) if w._ints is not None)
    return ints + sum(t.numel() * 4 for w in _weights(model) if w._tiles is not None for t in w._tiles)


def _weights(obj, depth=0, seen=None):
    """Every Weight reachable from obj (its attributes, lists and dicts), once."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, common.Weight):
        yield obj
        return
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    for v in items:
        yield from _weights(v, depth + 1, seen)


def test_kept_weights_same_logits_within_budget(tiny, monkeypatch):
    path = tiny("llama")
    _budget(monkeypatch, 0)
    plain_model, plain = _logits(path)
    assert _expanded(plain_model) == 0
    budget = _budget(monkeypatch, 1 << 30)
    model, kept = _logits(path)
    used = (1 << 30) - budget.left
    assert used > 0 and _expanded(model) == used
    assert torch.equal(kept, plain)
    model.close()
    del model
    gc.collect()
    assert budget.left == 1 << 30                  # given back when the weights are freed
    _budget(monkeypatch, used // 2)                # room for some matrices only
    model, part = _logits(path)
    assert 0 < _expanded(model) <= used // 2 and torch.equal(part, plain)
    model.close()
    plain_model.close()
