"""Several slots' short prompt pieces in one padded pass (engine/runner/runner.py: prefill_pieces; engine/runner/prefill.py:
PromptPieces): each piece gets the logits, KV and recurrent state its own prefill gives it, bit for bit (on the
CPU too: pieces start at multiples of 16 rows and padding rows are the same in every pass), whatever the other
pieces are; the grouping into passes; bad input and a full pool change nothing."""
from __future__ import annotations

import pytest
import torch

from engine.kv.pool import PoolFullError
from engine.kv.sequence import SequenceKV
from engine.models import open_model
from engine.runner import Runner

TINY_SEED = 5
CHUNK = 128   # (pieces share passes only when the chunk is longer than a small prompt chunk's 64 rows)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(model, ct="f16", n_slots=4, padded=True, **kw) -> Runner:
    return Runner(model, device="cpu", n_slots=n_slots, max_ctx=256, cache_type=ct, padded_prefill=padded, **kw)


def _states(r: Runner) -> list[torch.Tensor]:
    return [t.clone() for d in (r.conv_state, r.ssm_state) for t in d.values()]


# (slot, length, start): a follow-up inside slot 0's first chunk, new prompts of 13, 32 and 1 tokens
PIECES = [(0, 20, 40), (1, 13, 0), (2, 32, 0), (3, 1, 0)]


def _run(r: Runner, together: bool) -> list[torch.Tensor]:
    """Slot 0 gets a 40-token context first; then PIECES together (one pass) or one prefill each; then two
    decode steps of every slot. All logits."""
    out = [r.prefill(0, _prompt(40, 9), chunk=CHUNK)]
    pieces = [(sl, _prompt(n, sl + 1), st) for sl, n, st in PIECES]
    if together:
        out.append(r.prefill_pieces(pieces, chunk=CHUNK))
    else:
        out.append(torch.cat([r.prefill(sl, t, start=st, chunk=CHUNK) for sl, t, st in pieces]))
    pos = [st + n for _, n, st in PIECES]
    for step in range(2):
        out.append(r.decode([0, 1, 2, 3], [5 + step, 6, 7, 8], [p + step for p in pos]))
    return [t.float() for t in out]


@pytest.mark.parametrize("arch,ct", [("qwen35", "f16"), ("qwen35", "turbo3"), ("llama", "q8_0"), ("gemma3", "f16")])
def test_pieces_in_one_pass_equal_their_own_prefills(tiny, arch, ct, monkeypatch):
    """Together, apart (padded passes of one slot), and through the unpadded prefill: the same bits.
    turbo3: key preconditioning (segments of 8) per piece; gemma3: sliding-window layers."""
    monkeypatch.setattr(SequenceKV, "SEGMENT", 8)
    monkeypatch.setattr(SequenceKV, "SEG_MIN_KEYS", 4)
    model = open_model(tiny(arch))
    try:
        runs, states = [], []
        for mode in ("together", "apart", "unpadded"):
            r = _runner(model, ct, padded=mode != "unpadded")
            assert r.prompt_pieces == (1 if mode == "unpadded" else 4)
            runs.append(_run(r, mode == "together"))
            states.append(_states(r))
            if mode == "together":
                assert set(r._prefill_graphs) == {64} and set(r._pass_graphs) == {128}   # (96 aligned rows)
        for other in (1, 2):
            for a, b in zip(runs[0], runs[other]):
                assert torch.equal(a, b), (a - b).abs().max()
            for a, b in zip(states[0], states[other]):
                assert torch.equal(a, b)
    finally:
        model.close()


def test_wider_pass_and_the_pieces_kernel(tiny, monkeypatch):
    """qwen35, pieces filling a 256-row pass, through the GPU's path for the recurrent layers: the windows
    gathered by the layout's device buffers and every piece's delta rule in one launch (kernels/gdn/rows.py,
    made to take CPU tensors: Triton's interpreter). Together and apart they give the same bits (the same
    kernel on the same rows); against the CPU's float64 loop, the kernel's float32 rounding."""
    pytest.importorskip("triton")
    import kernels.gdn.block as gdn_block
    model = open_model(tiny("qwen35"))
    pieces = [(sl, _prompt(n, 20 + sl), 0) for sl, n in enumerate((64, 48, 30, 17))]   # 176 aligned rows
    try:
        out = {}
        for mode in ("loop", "kernel-together", "kernel-apart"):
            if mode.startswith("kernel"):
                monkeypatch.setattr(gdn_block, "pieces_kernel_applies", lambda x: True)
            r = _runner(model, "f32")
            if mode == "kernel-apart":
                lg = torch.cat([r.prefill(sl, t, start=st, chunk=256) for sl, t, st in pieces])
            else:
                lg = r.prefill_pieces(pieces, chunk=256)
                assert set(r._pass_graphs) == {256}
            dec = r.decode([0, 1, 2, 3], [1, 2, 3, 4], [len(t) for _, t, _ in pieces])
            out[mode] = [lg, dec] + _states(r)
        for a, b in zip(out["kernel-together"], out["kernel-apart"]):
            assert torch.equal(a, b), (a - b).abs().max()
        for a, b in zip(out["kernel-together"][:2], out["loop"][:2]):
            assert torch.allclose(a, b, atol=2e-3 * b.abs().max().item()), (a - b).abs().max()
    finally:
        model.close()


def test_piece_passes_grouping(tiny):
    model = open_model(tiny("llama"))
    try:
        r = _runner(model, n_slots=8)
        # 64-token pieces: four to a 256-row pass; a 65-token piece is not a small one: alone
        assert r.piece_passes([64, 64, 64, 64, 64, 65, 1], 512) == [[0, 1, 2, 3], [4, 6], [5]]
        assert r.piece_passes([64, 64, 64, 13], CHUNK) == [[0, 1], [2, 3]]   # (no pass longer than a chunk)
        assert r.piece_passes([13, 13, 13], 64) == [[0], [1], [2]]   # (chunks of 64: small chunks already)
        # the engine's start runs every pass size once (captured on a GPU), on free slots it hands back
        r.capture_prefill(CHUNK)
        assert set(r._prefill_graphs) == {64, CHUNK} and set(r._pass_graphs) == {128}
        r.capture_prefill(256)
        assert set(r._prefill_graphs) == {64, CHUNK, 256} and set(r._pass_graphs) == {128, 256}
        assert r.pool.n_free == r.n_blocks and not any(r.tables.blocks)
        r.prompt_pieces = 2
        assert r.piece_passes([1, 1, 1], CHUNK) == [[0, 1], [2]]
        assert _runner(model, shared_prompt_passes=False).prompt_pieces == 1
        assert Runner(model, device="cpu", n_slots=2, max_ctx=64, padded_prefill=False).prompt_pieces == 1
    finally:
        model.close()


def test_bad_pieces_and_a_full_pool_change_nothing(tiny):
    model = open_model(tiny("qwen35"))
    try:
        r = Runner(model, device="cpu", n_slots=3, max_ctx=128, n_blocks=4, block_size=16, padded_prefill=True)
        r.prefill(0, _prompt(16, 1), chunk=CHUNK)
        before = _states(r)
        free = r.pool.n_free
        with pytest.raises(ValueError, match="one piece per slot"):
            r.prefill_pieces([(1, [1, 2], 0), (1, [3], 0)], chunk=CHUNK)
        with pytest.raises(ValueError):
            r.prefill_pieces([(1, [], 0), (2, [3], 0)], chunk=CHUNK)
        with pytest.raises(PoolFullError):   # 3 free blocks of 16 tokens: 33 + 17 tokens need 4
            r.prefill_pieces([(1, _prompt(33, 2), 0), (2, _prompt(17, 3), 0)], chunk=CHUNK)
        assert r.pool.n_free == free
        assert all(torch.equal(a, b) for a, b in zip(before, _states(r)))
    finally:
        model.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch,ct", [("qwen35", "f16"), ("llama", "q8_0"), ("qwen35", "turbo3")])
def test_captured_passes_of_pieces_gpu(tiny, arch, ct):
    """On a GPU with graphs: the pieces' pass eagerly (first), then replayed, then each piece in its own
    pass: the same bits every time; the unpadded prefill's logits within the captured chunks' tolerance
    (test_runner_prefill.py) and its greedy tokens."""
    model = open_model(tiny(arch))
    try:
        r = Runner(model, device="cuda", n_slots=4, max_ctx=256, cache_type=ct)
        assert r.padded_prefill and r.prompt_pieces == 4
        runs = [_run(r, True), _run(r, True), _run(r, False)]
        assert r._pass_graphs[128].segments          # (captured)
        r.close()
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert torch.equal(a, b), (a - b).abs().max()
        plain = Runner(model, device="cuda", n_slots=4, max_ctx=256, cache_type=ct, padded_prefill=False)
        ref = _run(plain, False)
        plain.close()
        for a, b in zip(runs[0], ref):
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            assert (a - b).abs().max() <= 0.02 * b.abs().max()
    finally:
        model.close()
