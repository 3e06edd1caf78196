"""The padded prompt chunk (engine/runner/prefill.py): every chunk run as `chunk` rows with padding, the
slot's recurrent state through a device index, attention split out of the model's code. On the CPU it
must give the plain prefill's logits bit for bit (the same kernels on the real rows; padding rows change
no state); on a GPU its captured segments must give the eager padded chunk's logits bit for bit.
(On the CPU a row's matmul result depends on the other rows of its 16-row block: the tests' real rows
fill whole blocks.)"""
from __future__ import annotations

import pytest
import torch

from engine.models import open_model
from engine.runner import Runner
from engine.kv.sequence import SequenceKV

TINY_SEED = 5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(runner: Runner, slot: int, toks: list[int], cut: int, chunk: int) -> list[torch.Tensor]:
    """A prompt in two calls (the second a follow-up at `cut`), then two decode steps: all logits."""
    out = [runner.prefill(slot, toks[:cut], chunk=chunk, all_logits=True),
           runner.prefill(slot, toks[cut:], start=cut, chunk=chunk)]
    n = len(toks)
    out.append(runner.decode([slot], [5], [n]))
    out.append(runner.decode([slot, (slot + 1) % runner.n_slots], [7, 9], [n + 1, 0]))
    return [t.float().cpu() for t in out]


@pytest.mark.parametrize("arch,ct,chunk", [("qwen35", "f16", 32), ("llama", "q8_0", 32), ("gemma3", "f16", 32),
                                           ("qwen35", "turbo3", 32), ("qwen2", "f32", 32),
                                           ("qwen35", "f16", 128), ("gemma3", "turbo3", 128)])
def test_padded_chunks_equal_plain_chunks(tiny, arch, ct, chunk, monkeypatch):
    """Prompts whose last chunk is partial (padding rows), a follow-up at a position inside a chunk,
    two slots used one after another (the device slot index): the same logits as unpadded chunks.
    turbo3: key preconditioning (segments of 8) on the real rows only. Chunks of 128: pieces of at most
    64 tokens run as small prompt chunks of 64 rows (engine/runner/runner.py: chunk_rows), longer ones as 128."""
    monkeypatch.setattr(SequenceKV, "SEGMENT", 8)
    monkeypatch.setattr(SequenceKV, "SEG_MIN_KEYS", 4)
    model = open_model(tiny(arch))
    try:
        runs = []
        for padded in (False, True):
            r = Runner(model, device="cpu", n_slots=3, max_ctx=384, cache_type=ct, padded_prefill=padded)
            runs.append(_run(r, 2, _prompt(80 + 2 * chunk, 1), 48 + chunk, chunk)
                        + _run(r, 0, _prompt(32, 2), 16, chunk))
            if padded:
                sizes = {32} if chunk == 32 else {chunk, 64}
                assert set(r._prefill_graphs) == sizes                      # (no capture on the CPU)
                assert not any(g.segments for g in r._prefill_graphs.values())
        for a, b in zip(*runs):
            assert torch.equal(a, b), (a - b).abs().max()
    finally:
        model.close()


def test_padding_rows_leave_the_recurrent_state_alone(tiny):
    """qwen35: a 16-token chunk padded to 64 rows leaves the slot's conv window and delta-rule state
    where 16 unpadded rows leave them, and no other slot's."""
    model = open_model(tiny("qwen35"))
    try:
        states = []
        for padded in (False, True):
            r = Runner(model, device="cpu", n_slots=2, max_ctx=128, padded_prefill=padded)
            r.prefill(1, _prompt(16, 3), chunk=64)
            states.append([t.clone() for d in (r.conv_state, r.ssm_state) for t in d.values()])
        for a, b in zip(*states):
            assert torch.equal(a, b)
            assert not a[0].any()          # slot 0 untouched
    finally:
        model.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch,ct,chunk", [("qwen35", "f16", 32), ("llama", "q8_0", 32), ("gemma3", "turbo3", 32),
                                           ("qwen35", "turbo3_tcq", 32), ("qwen35", "f16", 128),
                                           ("llama", "q8_0", 128)])
def test_captured_chunks_equal_eager_padded_chunks(tiny, arch, ct, chunk):
    """The captured segments (one per stretch between attention layers) replayed for later chunks give
    the eager padded chunk's logits bit for bit, on several slots, depths and chunk fillings; the plain
    (unpadded) prefill gives the same greedy tokens. Chunks of 128: the pieces of at most 64 tokens run
    as small prompt chunks (64 rows, the packed matmul), the others as 128 rows (dequantize + cuBLAS)."""
    model = open_model(tiny(arch))
    try:
        runs = {}
        for mode in ("graphs", "eager", "plain"):
            r = Runner(model, device="cuda", n_slots=3, max_ctx=256, cache_type=ct, graphs=mode != "eager",
                       padded_prefill=mode != "plain")
            runs[mode] = [_run(r, 1, _prompt(100, 1), 70, chunk), _run(r, 0, _prompt(40, 2), 31, chunk),
                          _run(r, 1, _prompt(64, 3), 32, chunk)]
            if mode == "graphs":
                assert set(r._prefill_graphs) == ({32} if chunk == 32 else {chunk, 64})
                n_attn = sum(1 for il in range(model.spec.n_layer) if not model.spec.is_recurrent(il))
                for g in r._prefill_graphs.values():
                    assert len(g.segments) == n_attn + 1 and len(g.splits) == n_attn
            r.close()
        for a, b in zip(runs["graphs"], runs["eager"]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        for a, b in zip(runs["graphs"], runs["plain"]):
            for x, y in zip(a, b):
                assert torch.equal(x.argmax(-1), y.argmax(-1))
                assert (x - y).abs().max() <= 0.02 * y.abs().max()
    finally:
        model.close()


def _features(r: Runner, toks: list[int], chunk: int) -> list[torch.Tensor]:
    """A DFlash drafter's view of a prompt and two decode steps: the runner's rows at capture_layers."""
    r.prefill(0, toks, chunk=chunk, hidden=True)
    out = [r.features.float().cpu()]
    for i, t in enumerate((5, 7)):
        r.decode([0], [t], [len(toks) + i])
        out.append(r.features.float().cpu())
    return out


def test_runner_features_are_the_models(tiny):
    """The rows' hidden states at the model's capture_layers (what a DFlash drafter reads on the GPU path)
    from prompt chunks, plain and padded, and decode steps: those of the CPU path's forward (keep_features),
    the last layer output-normed."""
    from engine.models.common import SeqChunk
    model = open_model(tiny("qwen35"))
    try:
        model.capture_layers = (0, 2, model.spec.n_layer - 1)
        toks = _prompt(48, 4)
        kv = model.new_kv(torch.float32)
        ref = []
        for lo, n in ((0, 48), (48, 1), (49, 1)):
            c = SeqChunk(torch.tensor((toks + [5, 7])[lo:lo + n]), lo, kv, "last")
            model.forward([c])
            ref.append(c.features)
        for padded in (False, True):
            r = Runner(model, device="cpu", n_slots=1, max_ctx=128, cache_type="f32", padded_prefill=padded)
            got = _features(r, toks, 16)
            for a, b in zip(got, ref):
                assert a.shape == b.shape
                assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()
    finally:
        model.capture_layers = ()
        model.close()


@pytest.mark.gpu
@needs_cuda
def test_captured_chunks_keep_the_drafters_features(tiny):
    """The features of the chunk that is run eagerly and then captured are that chunk's (not the new
    graph's buffer), and replayed chunks and decode graphs give the eager ones bit for bit."""
    model = open_model(tiny("qwen35"))
    try:
        model.capture_layers = (0, 2, model.spec.n_layer - 1)
        runs = {}
        for mode in ("graphs", "eager"):
            r = Runner(model, device="cuda", n_slots=1, max_ctx=256, graphs=mode == "graphs", padded_prefill=True)
            runs[mode] = _features(r, _prompt(40, 5), 32) + _features(r, _prompt(70, 6), 32)
            r.close()
        for a, b in zip(runs["graphs"], runs["eager"]):
            assert torch.equal(a, b)
    finally:
        model.capture_layers = ()
        model.close()
