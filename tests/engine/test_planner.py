"""engine/planner.py: weights from the tensor index, KV per cache type, recurrent state, SWA caps."""
from __future__ import annotations

import argparse
import math

import pytest

from app import cli_plan as C
from engine import planner as P
from engine.gguf.reader import GGUFError, GGUFFile
from engine.tools.synth import write_synthetic
from kernels.packed_layout import PACKED_LAYOUT, packed_bytes


@pytest.fixture(scope="module")
def q27(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "q27.gguf"
    write_synthetic(path, "qwen35", "27b-q4_k_m", header_only=True)
    return path


def test_kv_type_sizes():
    assert P.kv_bytes_per_value("f16") == 2
    assert P.kv_bytes_per_value("q8_0") == 34 / 32
    assert P.kv_bytes_per_value("turbo4") == 66 / 128
    assert P.kv_bytes_per_value("turbo3") == 14 / 32
    assert P.kv_bytes_per_value("turbo2") == 10 / 32
    assert P.kv_bytes_per_value("turbo3_tcq") == 52 / 128
    assert P.kv_bytes_per_value("turbo2_tcq") == 36 / 128
    with pytest.raises(ValueError):
        P.kv_bytes_per_value("q4_0")


def test_qwen35_27b_layout(q27):
    f = P.model_facts(q27)
    g = GGUFFile(q27)
    assert f.weight_bytes == sum(t.n_bytes for t in g.tensors.values())
    g.close()
    assert 16.0e9 < f.weight_bytes < 17.0e9           # the 16.5 GB of the design
    assert f.n_full_attn == 16 and f.n_swa == 0 and f.n_recurrent_layers == 48
    # per attention layer: 4 KV heads x 256 dims for K and for V
    assert P.kv_bytes_per_token(f, "f16") == 16 * 2 * 4 * 256 * 2
    assert P.kv_bytes(f, 1000, "f16") == 1000 * 16 * 2 * 4 * 256 * 2
    assert P.kv_bytes(f, 1000, "turbo3") == 1000 * 16 * 2 * (1024 // 32) * 14
    # Gated DeltaNet: conv window 3 x (2*16*128 + 6144) + 48 heads x 128 x 128, f32
    assert f.recurrent_bytes_per_layer == 4 * (3 * (2 * 16 * 128 + 6144) + 48 * 128 * 128)
    p = P.plan(f, 8192, "f16", vram=P.parse_size("24GiB"))
    assert p.total == p.weights + p.kv + p.recurrent + p.workspace
    assert p.fits and p.recurrent == f.recurrent_bytes


def test_prompt_pieces_graphs_counted_with_several_slots(q27):
    """The prompt pieces' pass graphs (engine/runner/runner.py: prefill_pieces) count in the workspace of a plan for
    several sequences, about the 390 MiB they reserved on the 27B, and not in a one-sequence plan."""
    from engine.runner import PIECE_PASS_ROWS
    assert P.PIECE_PASS_ROWS == PIECE_PASS_ROWS
    f = P.model_facts(q27)
    assert P.piece_graph_bytes(f, 1) == 0
    assert 380 * P.MiB < P.piece_graph_bytes(f, 4) == P.piece_graph_bytes(f, 16) < 400 * P.MiB
    one, four = P.workspace_bytes(f, 1, ctx=8192), P.workspace_bytes(f, 4, ctx=8192)
    assert four - one == P.piece_graph_bytes(f, 4) + 3 * P.LOGIT_ROWS_PER_SEQ * f.vocab_size * 4
    assert P.plan(f, 8192, "f16", n_seqs=4).workspace == P.workspace_bytes(f, 4, ctx=4 * 8192)


def test_plan_without_shared_passes(q27, capsys):
    """`serve --no-shared-passes` leaves the pass graphs' memory to the KV cache: a plan made for it (and
    `hivejet plan --no-shared-passes`) has that much less workspace, and a longer context fits."""
    import argparse
    f = P.model_facts(q27)
    vram = P.parse_size("24GiB")
    on, off = P.plan(f, 8192, "f16", n_seqs=16, vram=vram), P.plan(f, 8192, "f16", n_seqs=16, vram=vram,
                                                                    shared_passes=False)
    assert on.workspace - off.workspace == P.piece_graph_bytes(f, 16) > 0
    assert on.kv == off.kv and on.total - off.total == P.piece_graph_bytes(f, 16)
    assert P.piece_graph_bytes(f, 16, shared_passes=False) == 0
    mc_on = P.max_context(f, "f16", vram, 16)
    mc_off = P.max_context(f, "f16", vram, 16, shared_passes=False)
    assert mc_off > mc_on and P.plan(f, mc_off, "f16", 16, vram, shared_passes=False).fits
    assert P.plan_table(f, vram, kv_types=["f16"], n_seqs=16, shared_passes=False)["f16"][0].workspace \
        == P.plan(f, P.CONTEXTS[0], "f16", 16, vram, shared_passes=False).workspace
    ap = argparse.ArgumentParser()
    C.add_plan_args(ap)
    for extra in ([], ["--no-shared-passes"]):
        assert C.run_plan(ap.parse_args(["-m", str(q27), "--vram", "24GiB", "--seqs", "16", "--kv", "f16"] + extra)) == 0
    table_on, table_off = capsys.readouterr().out.split(f"{f.name} (")[1:]
    assert "--no-shared-passes leaves to the KV cache" in table_on
    assert "--no-shared-passes" not in table_off
    assert f"{mc_on:>11}" in table_on and f"{mc_off:>11}" in table_off
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--seqs", "16", "--ctx", "8192", "--no-shared-passes"])) == 0
    assert f"{off.workspace:>15,} B" in capsys.readouterr().out


def test_max_context_24gb(q27):
    f = P.model_facts(q27)
    vram = P.parse_size("24GiB")
    mc = {kt: P.max_context(f, kt, vram) for kt in P.KV_TYPES}
    for kt, c in mc.items():
        assert c % P.KV_BLOCK_TOKENS == 0
        assert P.plan(f, c, kt, vram=vram).fits
        if c < f.context_length:
            assert not P.plan(f, c + P.KV_BLOCK_TOKENS, kt, vram=vram).fits
    assert mc["f16"] < mc["q8_0"] <= mc["turbo4"]
    # the GPU path's weights are the packed layout (18.2 GB, not the file's 16.5 GB: fp16 scale products)
    assert f.device_weight_bytes == pytest.approx(18.19e9, rel=0.002)
    assert 80_000 < mc["f16"] < 100_000
    assert mc["turbo3_tcq"] == 262144                   # 200K+ context in 24 GB with compressed KV
    assert P.max_context(f, "f16", P.parse_size("8GiB")) == 0     # weights alone do not fit
    two = P.max_context(f, "turbo3", vram, n_seqs=2)
    assert P.plan(f, two, "turbo3", 2, vram).fits


def test_gemma3_sliding_window(gemma3_path):
    f = P.model_facts(gemma3_path)
    assert f.n_swa == 15 and f.n_full_attn == 3
    w = f.attn_layers[0][2]
    assert w == 512
    per_tok_full = 2 * 1 * 256 * 2
    assert P.kv_bytes(f, 400, "f16") == 18 * 400 * per_tok_full
    assert P.kv_bytes(f, 8192, "f16") == 15 * 512 * per_tok_full + 3 * 8192 * per_tok_full


def test_smollm2(smollm2_path):
    f = P.model_facts(smollm2_path)
    assert f.arch == "llama" and f.n_full_attn == 30 and f.recurrent_bytes == 0
    # head_dim 64 with 128-value groups: each of the 3 heads is padded to 128 values -> 3 groups per K
    assert P.kv_bytes_per_token(f, "turbo4") == 30 * 2 * 3 * 66
    assert P.kv_bytes_per_token(f, "q8_0") == 30 * 2 * math.ceil(192 / 32) * 34


def test_parse_size_and_errors(tmp_path):
    assert P.parse_size("24GiB") == 24 << 30 and P.parse_size("24 GB") == 24 << 30
    assert P.parse_size("512M") == 512 << 20 and P.parse_size("100") == 100
    with pytest.raises(ValueError):
        P.parse_size("lots")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(GGUFError):
        P.model_facts(bad)


def test_cli(q27, capsys):
    ap = argparse.ArgumentParser()
    C.add_plan_args(ap)
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--vram", "24GiB"])) == 0
    out = capsys.readouterr().out
    assert "turbo3_tcq" in out and "262K" in out and "max context" in out
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--vram", "lots"])) == 2
    assert C.run_plan(ap.parse_args(["-m", "/nonexistent.gguf"])) == 1


@pytest.mark.parametrize("coded", [False, True])
def test_packed_layout_is_the_gpu_packers(coded, monkeypatch):
    """packed_bytes (kernels/packed_layout.py, torch-free, for the planner) is what pack_weight makes, with
    the scales stored either way (layout.CODED_SCALES: the engine's fp16 products, or the codes that
    pack_weight(coded=True) keeps)."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES

    import kernels.packed_layout as layout
    from kernels.quant.packing import _PACKERS, pack_weight
    monkeypatch.setattr(layout, "CODED_SCALES", coded)
    assert {qt.name for qt in _PACKERS} == set(PACKED_LAYOUT)
    for n, k in ((8, 512), (16400, 256), (8, 768)):   # rows padded to a tile of 64, and of 128 for wide
        # matrices; K = 768: tiles of 256 values
        for qt in _PACKERS:
            bs, ts = GGML_QUANT_SIZES[qt]
            raw = np.zeros((n * k // bs, ts), dtype=np.uint8)      # zero blocks: valid for every type
            p = pack_weight(torch.from_numpy(raw.reshape(-1)), qt, n, k)
            assert packed_bytes(qt.name, n, k) == p.nbytes, qt.name
            group, hi_bits, _ = PACKED_LAYOUT[qt.name]
            kind = layout.scale_kind(qt.name)
            assert (p.group, p.hi_bits, p.codes, p.minv is not None) == \
                (group, hi_bits, {"codes": 1, "codes+min": 2}.get(kind, 0), kind == "f16+min"), qt.name
    n, k = 8, 512
    assert packed_bytes("F16", n, k) is None


def _packed_zero_q4_k(n: int, k: int):
    """An [n, k] Q4_K matrix of zero blocks, packed as the engine packs it."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as QT

    from kernels.quant.packing import pack_weight
    raw = torch.from_numpy(np.zeros(n * k // 256 * GGML_QUANT_SIZES[QT.Q4_K][1], dtype=np.uint8))
    return pack_weight(raw, QT.Q4_K, n, k)


def test_wide_rows_setting_moves_the_tile_height(monkeypatch):
    """layout.WIDE_ROWS: matrices of at least that many rows take 128-row tiles,
    in the packer and in the planner's byte count alike."""
    import kernels.packed_layout as layout
    n, k = 130, 256     # 192 rows in 64-row tiles, 256 in 128-row ones
    before = packed_bytes("Q4_K", n, k)
    assert layout.default_tile_n(n) == 64 and _packed_zero_q4_k(n, k).n_pad == 192
    monkeypatch.setattr(layout, "WIDE_ROWS", 64)
    p = _packed_zero_q4_k(n, k)
    assert layout.default_tile_n(n) == 128 and p.tile_n == 128 and p.n_pad == 256
    assert packed_bytes("Q4_K", n, k) == p.nbytes > before
    assert layout.default_tile_n(63) == 64


def test_head_bytes_are_the_codecs():
    from kernels.kvcodec import CACHE_TYPES, get_codec
    for t in CACHE_TYPES:
        for d in (64, 128, 256):
            assert P.head_bytes(d, t) == get_codec(t).row_bytes(d), (t, d)


@pytest.mark.parametrize("arch,wt", [("qwen35", "Q8_0"), ("llama", "Q4_0"), ("gemma3", "F16")])
def test_device_weight_bytes_are_what_the_model_puts_on_the_gpu(tmp_path, arch, wt):
    """The planner's weights (from the header) against the model's own tensors packed as
    DecoderModel.to_device packs them (pack_weight on the CPU here) plus its dense vectors and
    qwen35's float32 conv kernels."""
    import torch

    from engine.models import open_model
    from kernels.quant.packing import pack_weight
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", weight_type=wt)
    m = open_model(path)
    try:
        total = 0
        for w in m.w._cache.values():
            if w.dense is not None:
                total += w.dense.numel() * 4
            elif w.qtype.name in PACKED_LAYOUT:
                total += pack_weight(w.raw, w.qtype, w.n_out, w.n_in).nbytes
            else:
                total += w.raw.numel()
        for L in list(getattr(m, "layers", [])):
            total += sum(v.numel() * v.element_size() for v in L.values() if isinstance(v, torch.Tensor))
        assert P.model_facts(path).device_weight_bytes == total
    finally:
        m.close()


def test_cli_one_plan(q27, capsys):
    ap = argparse.ArgumentParser()
    C.add_plan_args(ap)
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--vram", "24GiB", "--kv", "turbo3_tcq", "--ctx", "200032"])) == 0
    out = capsys.readouterr().out
    f = P.model_facts(q27)
    p = P.plan(f, 200032, "turbo3_tcq", vram=P.parse_size("24GiB"))
    assert f"{p.allocated:,}" in out and "fits in 24.00 GiB" in out and p.fits
    # 200K tokens of turbo3_tcq K and V: 16 layers x 4 heads x 2 x 2 groups x 52 bytes per token
    assert p.kv == 16 * 4 * 2 * 2 * 52 * (200032 + 16)
    assert p.prep == 2 * 16 * (4 * 4 * 256 * (1 + 782) + 8)       # the slot and the scratch slot
    assert P.plan(f, 200032, "turbo3_tcq", kv_type_v="f16").kv > p.kv


def test_prompt_attention_workspace_matches_the_runner():
    """The planner's prompt-attention allowance uses the runner's piece size, and counts what each cache
    type's path holds: a gathered f16 context, 8192-key decoded pieces, nothing for f32."""
    from engine.runner.attention import DECODED_PIECE
    assert P.DECODED_PIECE_TOKENS == DECODED_PIECE
    f = P.ModelFacts(path="x", name="x", arch="llama", weight_bytes=0, file_bytes=0, context_length=1 << 17,
                     n_embd=64, n_ff=128, vocab_size=100, n_head=4, head_dim=16, attn_layers=[(32, 32, 0)] * 2)
    assert P.prompt_attention_bytes(f, 100_000, "f16") == 100_000 * 64 * 2
    assert P.prompt_attention_bytes(f, 100_000, "turbo3_tcq") == 8192 * 64 * 14
    assert P.prompt_attention_bytes(f, 1000, "q8_0") == 1000 * 64 * 14
    assert P.prompt_attention_bytes(f, 100_000, "f32") == 0
    assert P.activation_bytes(f, 100_000, "f16") - P.activation_bytes(f, 0, "f16") == 100_000 * 64 * 2


@pytest.mark.parametrize("kv", ["f16", "turbo3_tcq"])
def test_mtp_kv_matches_the_engines_pool(tmp_path, kv):
    """`hivejet plan --mtp` counts the MTP block's KV as the GPU path allocates it (one more layer in the runner's
    block layout, engine/runner/mtp.py: the pool's blocks and the scratch block; q8_0 beside compressed caches),
    and only when asked."""
    from engine.models import open_model
    from engine.runner import Runner
    from engine.runner.mtp import MtpSlots
    path = tmp_path / "q27mtp.gguf"
    write_synthetic(path, "qwen35", "27b-q4_k_m", header_only=True, mtp=True)
    f = P.model_facts(path)
    assert f.n_layer_nextn == 1
    ctx, seqs = 4096, 2
    with_mtp, without = P.plan(f, ctx, kv, seqs, mtp=True), P.plan(f, ctx, kv, seqs)
    assert without.mtp == 0 and with_mtp.total - without.total == with_mtp.mtp > 0
    t = P.mtp_cache_type(kv)
    assert t == ("f16" if kv == "f16" else "q8_0")
    tiny = tmp_path / "tiny_mtp.gguf"      # (the runner's allocation, on a model small enough to open)
    write_synthetic(tiny, "qwen35", "tiny", seed=3, mtp=True)
    m = open_model(tiny)
    try:
        r = Runner(m, device="cpu", n_slots=seqs, max_ctx=256, cache_type=kv)
        assert MtpSlots(r, t).nbytes() == P.mtp_kv_bytes(P.model_facts(tiny), seqs * 256, kv)
    finally:
        m.close()


def test_dflash_drafter_counted(tmp_path, q27, capsys):
    """`hivejet plan --ctx N --drafter D` counts a DFlash drafter as the GPU path holds it: its weights in
    bfloat16 (what DFlashDrafter.to_device leaves) and its context K/V for every pool token (what the
    engine's memory fit reserves); a drafter made for another model is a clear error."""
    import torch

    from engine.spec.dflash import load_drafter
    from engine.tools.synth_dflash import synthetic_drafter, write_gguf
    model = tmp_path / "tiny.gguf"
    write_synthetic(model, "qwen35", "tiny", seed=2)
    path = write_gguf(tmp_path / "drafter.gguf", *synthetic_drafter(model, seed=1))
    d = load_drafter(path)
    f = P.model_facts(model)
    ctx, seqs = 1024, 2
    with_d, without = P.plan(f, ctx, "f16", seqs, drafter=d), P.plan(f, ctx, "f16", seqs)
    per_token = d.context_bytes_per_token()
    assert per_token == d.cfg.n_layer * 2 * d.cfg.n_head_kv * d.cfg.head_dim * 2
    d.to_device(torch.device("cpu"))
    assert with_d.drafter == d.weight_bytes() + per_token * seqs * ctx
    assert with_d.total - without.total == with_d.drafter and without.drafter == 0
    ap = argparse.ArgumentParser()
    C.add_plan_args(ap)
    assert C.run_plan(ap.parse_args(["-m", str(model), "--ctx", str(ctx), "--seqs", str(seqs),
                                     "--drafter", str(path)])) == 0
    out = capsys.readouterr().out
    assert "DFlash drafter" in out and f"{with_d.drafter:,}" in out and f"{with_d.total:,}" in out
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--ctx", "4096", "--drafter", str(path)])) == 2
    assert "made for another model" in capsys.readouterr().err
    llama = tmp_path / "llama.gguf"                 # the same hidden size, 2 layers: its layer ids do not fit
    write_synthetic(llama, "llama", "tiny", seed=1)
    assert P.model_facts(llama).n_layer == 2
    assert C.run_plan(ap.parse_args(["-m", str(llama), "--ctx", "4096", "--drafter", str(path)])) == 2
    assert "out of range" in capsys.readouterr().err
    assert C.run_plan(ap.parse_args(["-m", str(model), "--ctx", "4096", "--drafter", str(tmp_path / "none")])) == 2


def test_prompt_chunk_follows_the_card(q27):
    """plan() counts the prompt chunk the engine picks for the card (auto_prefill_chunk): 512 rows on a
    24 GiB card or with no card given, 1024 with 16 GiB or more free after the weights, whose graphs need
    more workspace than twice 512's rows (activation_bytes)."""
    f = P.model_facts(q27)
    small = P.plan(f, 8192, "f16", vram=P.parse_size("24GiB"))
    big = P.plan(f, 8192, "f16", vram=P.parse_size("141GiB"))
    assert small.workspace == P.workspace_bytes(f, 1, 512, small.seq_ctx, "f16")
    assert big.workspace == P.workspace_bytes(f, 1, 1024, big.seq_ctx, "f16")
    row = P.activation_bytes(f, 0, step_tokens=513) - P.activation_bytes(f, 0, step_tokens=512)
    assert big.workspace - small.workspace == 512 * row           # five rows' worth per row beyond 512
    assert P.activation_bytes(f, 0, step_tokens=512) - P.activation_bytes(f, 0, step_tokens=511) == row // 5
    assert P.plan(f, 8192, "f16").workspace == small.workspace


def test_checkpoints_counted_only_when_the_device_keeps_them(q27):
    """The engine keeps its default state checkpoints on the device only when 2 % of the KV cache holds
    at least MIN_DEVICE_CHECKPOINTS of them (else in host memory): the plan counts them in that case only."""
    from engine.planner import MIN_DEVICE_CHECKPOINTS
    f = P.model_facts(q27)
    one = f.recurrent_bytes
    small = P.plan(f, P.max_context(f, "f16", P.parse_size("24GiB"), 4), "f16", 4, P.parse_size("24GiB"))
    assert small.checkpoints == 0 and int(0.02 * small.kv) // one < MIN_DEVICE_CHECKPOINTS
    assert small.host_checkpoints == P.host_checkpoint_count(one) * one > 0           # in RAM, not in the total
    assert small.total == sum(v for k, v in small.breakdown().items()
                              if k in ("weights", "kv", "recurrent", "prep", "checkpoints", "workspace", "vision"))
    big = P.plan(f, 262144, "f16", 4)
    n = int(0.02 * big.kv) // one
    assert n >= MIN_DEVICE_CHECKPOINTS and big.checkpoints == min(64, n) * one and big.host_checkpoints == 0
    assert "host RAM" not in C.format_plan(big) and "host RAM" in C.format_plan(small)
    assert small.breakdown()["host_checkpoints"] == small.host_checkpoints


def test_cli_prints_the_decode_ceiling_on_a_named_card(q27, capsys):
    ap = argparse.ArgumentParser()
    C.add_plan_args(ap)
    read = P.model_facts(q27).decode_read_bytes
    # the 27B Q4_K_M reads most of its ~16.5 GB per token (not the embedding table, not the MTP block)
    assert 14e9 < read < P.model_facts(q27).device_weight_bytes
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--vram", "24GiB", "--card", "rtx3090"])) == 0
    out = capsys.readouterr().out
    assert f"decode ceiling on RTX 3090 (936 GB/s, 24 GB, sm_86): {936e9 / read:.1f} tok/s" in out
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--ctx", "4096", "--card", "RTX 5090"])) == 0
    assert f"{1792e9 / read:.1f} tok/s" in capsys.readouterr().out
    assert C.run_plan(ap.parse_args(["-m", str(q27), "--card", "gtx9000"])) == 2
    assert "unknown card 'gtx9000'" in capsys.readouterr().err
