"""engine/tools/synth.py (with synth_gguf.py, synth_quant.py): synthetic GGUF models (layout, values, determinism, CLI, optional llama.cpp check)."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections import Counter

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from engine.tools import synth, synth_gguf, synth_quant
from engine.gguf.reader import GGUFFile

TINY_CASES = [("llama", False), ("gemma3", False), ("qwen2", False), ("qwen3", False),
              ("qwen35", False), ("qwen35", True)]


def _nbytes(qtype, shape) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def _deq(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensors[name]
    return gguf.quants.dequantize(np.asarray(f.tensor_bytes(name)), t.qtype).reshape(t.shape)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for arch, mtp in TINY_CASES:
        p = d / f"{arch}{'-mtp' if mtp else ''}.gguf"
        out[(arch, mtp)] = (p, synth.write_synthetic(p, arch, "tiny", mtp=mtp, seed=1))
    return out


# ------------------------------------------------------------------------------------------------
# tiny presets: read back, values finite and well-scaled

@pytest.mark.parametrize("arch,mtp", TINY_CASES)
def test_tiny_reads_back(tiny_files, arch, mtp):
    path, summary = tiny_files[(arch, mtp)]
    spec, md = synth.synth_spec(arch, "tiny", mtp=mtp, seed=1)
    f = GGUFFile(path)
    try:
        assert f.architecture == arch
        assert [(n, t.qtype, t.shape) for n, t in f.tensors.items()] == spec
        assert summary["tensors"] == spec
        assert summary["n_bytes"] == sum(_nbytes(q, s) for _, q, s in spec)
        assert summary["file_size"] == path.stat().st_size
        for k, v in md.items():
            assert f.metadata[k] == (pytest.approx(v) if isinstance(v, float) else v), k
        for name, t in f.tensors.items():
            x = _deq(f, name)
            assert np.isfinite(x).all(), name
            if name.endswith("_norm.weight") or ".nextn.enorm" in name or ".nextn.hnorm" in name:
                assert 0.85 < x.min() and x.max() < 1.15, name              # stored norm weights ~1
            elif name.endswith(".ssm_a"):
                assert (x < 0).all() and (x > -4.01).all(), name             # -exp(A_log)
            elif name.endswith("ssm_conv1d.weight"):
                assert t.shape[-1] == 4 and t.qtype == QT.F32
            elif len(t.shape) == 2:
                std = float(x.std())
                n_in = t.shape[1]
                assert 0.1 / math.sqrt(n_in) < std < 2.5, (name, std)
                assert abs(float(x.mean())) < 0.2 * std + 1e-3, name
    finally:
        f.close()


def test_tiny_is_small_and_fast(tiny_files):
    for (arch, mtp), (path, s) in tiny_files.items():
        assert s["file_size"] < 4 << 20
        assert s["seconds"] < 5


def test_tiny_metadata_conventions(tiny_files):
    md = GGUFFile(tiny_files[("qwen35", False)][0]).metadata
    assert md["qwen35.block_count"] == 4
    assert md["qwen35.full_attention_interval"] == 4
    assert md["qwen35.ssm.conv_kernel"] == 4
    assert md["qwen35.ssm.inner_size"] == md["qwen35.ssm.state_size"] * md["qwen35.ssm.time_step_rank"]
    assert sum(md["qwen35.rope.dimension_sections"]) * 2 == md["qwen35.rope.dimension_count"]
    assert "qwen35.nextn_predict_layers" not in md
    md = GGUFFile(tiny_files[("qwen35", True)][0]).metadata
    assert md["qwen35.block_count"] == 5 and md["qwen35.nextn_predict_layers"] == 1
    for arch in ("llama", "gemma3", "qwen2", "qwen3"):
        md = GGUFFile(tiny_files[(arch, False)][0]).metadata
        assert md["tokenizer.ggml.model"] == "gpt2"
        toks = md["tokenizer.ggml.tokens"]
        assert toks[md["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
        assert toks[md["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
        assert "<|im_start|>" in md["tokenizer.chat_template"]
    assert GGUFFile(tiny_files[("gemma3", False)][0]).metadata["gemma3.attention.sliding_window"] == 32


def test_qwen35_tiny_layer_kinds(tiny_files):
    f = GGUFFile(tiny_files[("qwen35", True)][0])
    md, T = f.metadata, f.tensors
    E, hd, nh, nkv = 128, 32, 4, 2
    dk, nk, nv = md["qwen35.ssm.state_size"], md["qwen35.ssm.group_count"], md["qwen35.ssm.time_step_rank"]
    conv_dim = 2 * nk * dk + nv * dk
    for il in range(3):                                    # Gated DeltaNet
        p = f"blk.{il}."
        assert T[p + "attn_qkv.weight"].shape == (conv_dim, E)
        assert T[p + "attn_gate.weight"].shape == (nv * dk, E)
        assert T[p + "ssm_conv1d.weight"].shape == (conv_dim, 4)
        assert T[p + "ssm_a"].shape == (nv,) and T[p + "ssm_dt.bias"].shape == (nv,)
        assert T[p + "ssm_alpha.weight"].shape == (nv, E) and T[p + "ssm_beta.weight"].shape == (nv, E)
        assert T[p + "ssm_norm.weight"].shape == (dk,)
        assert T[p + "ssm_out.weight"].shape == (E, nv * dk)
        assert p + "attn_q.weight" not in T
    for il in (3, 4):                                      # gated full attention; 4 = MTP block
        p = f"blk.{il}."
        assert T[p + "attn_q.weight"].shape == (2 * nh * hd, E)     # [q, gate] per head
        assert T[p + "attn_k.weight"].shape == (nkv * hd, E)
        assert T[p + "attn_output.weight"].shape == (E, nh * hd)
        assert T[p + "attn_q_norm.weight"].shape == (hd,)
        assert p + "attn_qkv.weight" not in T and p + "ssm_a" not in T
        assert T[p + "post_attention_norm.weight"].shape == (E,)
    assert T["blk.4.nextn.eh_proj.weight"].shape == (E, 2 * E)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        assert T[f"blk.4.nextn.{n}.weight"].shape == (E,)
    assert "output.weight" in T
    a = _deq(f, "blk.0.ssm_a")
    decay = np.exp(a * math.log(2))                        # softplus(0) = ln 2
    assert ((decay > 0) & (decay < 1)).all()
    f.close()


def test_tensor_order_is_llama_cpp_order():
    names = [n for n, _, _ in synth.synth_spec("qwen35", "tiny", mtp=True)[0]]
    assert names[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]
    layers = [int(n.split(".")[1]) for n in names[3:]]
    assert layers == sorted(layers)


# ------------------------------------------------------------------------------------------------
# 27B layout (no data written)

def _spec27(mtp=False):
    return synth.synth_spec("qwen35", "27b-q4_k_m", mtp=mtp)


def test_27b_layout():
    spec, md = _spec27()
    T = {n: (q, s) for n, q, s in spec}
    assert len(spec) == 3 + 48 * 14 + 16 * 11 == 851
    assert md["qwen35.block_count"] == 64
    assert md["qwen35.embedding_length"] == 5120 and md["qwen35.feed_forward_length"] == 17408
    assert md["qwen35.attention.head_count"] == 24 and md["qwen35.attention.head_count_kv"] == 4
    assert md["qwen35.attention.key_length"] == 256 and md["qwen35.rope.dimension_count"] == 64
    assert md["qwen35.ssm.group_count"] == 16 and md["qwen35.ssm.time_step_rank"] == 48
    assert md["qwen35.ssm.state_size"] == 128 and md["qwen35.ssm.inner_size"] == 6144
    assert md["qwen35.ssm.conv_kernel"] == 4 and md["qwen35.full_attention_interval"] == 4
    assert md["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert len(md["tokenizer.ggml.tokens"]) == 248320
    assert T["token_embd.weight"] == (QT.Q4_K, (248320, 5120))
    assert T["output.weight"] == (QT.Q6_K, (248320, 5120))
    assert T["output_norm.weight"] == (QT.F32, (5120,))
    gdn = [il for il in range(64) if (il + 1) % 4]
    full = [il for il in range(64) if (il + 1) % 4 == 0]
    assert len(gdn) == 48 and len(full) == 16
    for il in range(64):
        p = f"blk.{il}."
        hi = synth.use_more_bits(il, 64)
        assert T[p + "ffn_gate.weight"] == (QT.Q4_K, (17408, 5120))
        assert T[p + "ffn_up.weight"] == (QT.Q4_K, (17408, 5120))
        assert T[p + "ffn_down.weight"] == (QT.Q6_K if hi else QT.Q4_K, (5120, 17408))
        assert T[p + "attn_norm.weight"] == (QT.F32, (5120,))
        assert T[p + "post_attention_norm.weight"] == (QT.F32, (5120,))
        if il in gdn:
            assert T[p + "attn_qkv.weight"] == (QT.Q6_K if hi else QT.Q4_K, (10240, 5120))
            assert T[p + "attn_gate.weight"] == (QT.Q4_K, (6144, 5120))
            assert T[p + "ssm_conv1d.weight"] == (QT.F32, (10240, 4))
            assert T[p + "ssm_a"] == (QT.F32, (48,)) and T[p + "ssm_dt.bias"] == (QT.F32, (48,))
            assert T[p + "ssm_alpha.weight"] == (QT.Q4_K, (48, 5120))
            assert T[p + "ssm_beta.weight"] == (QT.Q4_K, (48, 5120))
            assert T[p + "ssm_norm.weight"] == (QT.F32, (128,))
            assert T[p + "ssm_out.weight"] == (QT.Q4_K, (5120, 6144))
        else:
            assert T[p + "attn_q.weight"] == (QT.Q4_K, (12288, 5120))
            assert T[p + "attn_k.weight"] == (QT.Q4_K, (1024, 5120))
            assert T[p + "attn_v.weight"] == (QT.Q6_K if hi else QT.Q4_K, (1024, 5120))
            assert T[p + "attn_output.weight"] == (QT.Q4_K, (5120, 6144))
            assert T[p + "attn_q_norm.weight"] == (QT.F32, (256,))
            assert T[p + "attn_k_norm.weight"] == (QT.F32, (256,))
    # use_more_bits(i, 64): layers 0-7, 56-63 and every third from 10
    assert [i for i in range(64) if synth.use_more_bits(i, 64)] == \
        list(range(8)) + list(range(10, 56, 3)) + list(range(56, 64))
    counts = Counter(q for _, q, _ in spec)
    assert counts == {QT.Q4_K: 433, QT.Q6_K: 65, QT.F32: 353}
    total = sum(_nbytes(q, s) for _, q, s in spec)
    assert 16.0e9 < total < 17.0e9


def test_27b_mtp_layout():
    spec, md = _spec27(mtp=True)
    T = {n: (q, s) for n, q, s in spec}
    assert len(spec) == 851 + 15
    assert md["qwen35.block_count"] == 65 and md["qwen35.nextn_predict_layers"] == 1
    assert T["blk.64.nextn.eh_proj.weight"] == (QT.Q4_K, (5120, 10240))
    assert T["blk.64.attn_q.weight"] == (QT.Q4_K, (12288, 5120))
    assert T["blk.64.attn_v.weight"][0] == QT.Q6_K and T["blk.64.ffn_down.weight"][0] == QT.Q6_K
    for n in ("enorm", "hnorm", "shared_head_norm"):
        assert T[f"blk.64.nextn.{n}.weight"] == (QT.F32, (5120,))


def test_27b_header_only(tmp_path):
    p = tmp_path / "q35-27b.gguf"
    s = synth.write_synthetic(p, "qwen35", "27b-q4_k_m", header_only=True)
    spec, _ = _spec27()
    f = GGUFFile(p)          # the data region is a sparse hole, so the reader's bounds checks pass
    try:
        assert [(n, t.qtype, t.shape) for n, t in f.tensors.items()] == spec
        assert sum(t.n_bytes for t in f.tensors.values()) == s["n_bytes"]
        assert 16.0e9 < s["file_size"] < 17.0e9 and p.stat().st_size == s["file_size"]
        assert f.metadata["tokenizer.ggml.merges"][0].count(" ") == 1
    finally:
        f.close()


# ------------------------------------------------------------------------------------------------
# determinism, types, quantizers

def test_same_seed_same_bytes(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    synth.write_synthetic(a, "qwen35", mtp=True, seed=7)
    synth.write_synthetic(b, "qwen35", mtp=True, seed=7, threads=1)
    synth.write_synthetic(c, "qwen35", mtp=True, seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_same_seed_same_bytes_direct_blocks():
    spec = synth.TensorSpec("blk.0.ffn_up.weight", QT.Q4_K, (2048, 4096), ("normal", 0.02))
    one = np.concatenate([j() for j in synth_gguf._jobs(spec, 3)])
    two = np.concatenate([j() for j in synth_gguf._jobs(spec, 3)])
    assert one.nbytes == spec.n_bytes and np.array_equal(one, two)


@pytest.mark.parametrize("wt", ["F32", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"])
def test_weight_types(tmp_path, wt):
    p = tmp_path / f"{wt}.gguf"
    s = synth.write_synthetic(p, "qwen35", weight_type=wt, vocab_size=1024)
    f = GGUFFile(p)
    try:
        types = {t.qtype for t in f.tensors.values()}
        for name, t in f.tensors.items():
            x = _deq(f, name)
            assert np.isfinite(x).all(), name
            if len(t.shape) == 2 and "conv1d" not in name:
                assert 0.1 / math.sqrt(t.shape[1]) < float(x.std()) < 2.5, (name, x.std())
        if wt == "Q4_K_M":
            # 128-wide rows cannot hold 256-blocks: llama.cpp's fallbacks Q4_K->Q5_0, Q6_K->Q8_0
            assert f.tensors["blk.0.attn_gate.weight"].qtype == QT.Q5_0
            for il in range(4):                                                # 256-wide rows
                want = QT.Q6_K if synth.use_more_bits(il, 4) else QT.Q4_K
                assert f.tensors[f"blk.{il}.ffn_down.weight"].qtype == want
            assert f.tensors["blk.2.ffn_down.weight"].qtype == QT.Q6_K
            assert f.tensors["output.weight"].qtype == QT.Q8_0
        elif wt in ("Q4_K", "Q5_K", "Q6_K"):
            assert QT[wt] in types and f.tensors["blk.0.ffn_down.weight"].qtype == QT[wt]
        else:
            assert QT[wt] in types
        assert f.metadata["general.file_type"] == synth._FILE_TYPE[wt]
        assert s["weight_type"] == wt
    finally:
        f.close()


@pytest.mark.parametrize("qt,fn,tol", [(QT.Q4_K, synth.quantize_q4_k, 0.12),
                                       (QT.Q5_K, synth.quantize_q5_k, 0.06),
                                       (QT.Q6_K, synth.quantize_q6_k, 0.03)])
def test_k_quantizers_roundtrip(qt, fn, tol):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 512)) * 0.05).astype(np.float32)
    x[3] = 0.0                                              # an all-zero row stays valid
    x[5] += 0.2                                             # and an offset one
    q = fn(x)
    assert q.dtype == np.uint8 and q.shape == (64, 512 // 256 * GGML_QUANT_SIZES[qt][1])
    y = gguf.quants.dequantize(q, qt)
    assert y.shape == x.shape and np.isfinite(y).all()
    assert np.all(y[3] == 0)
    err = np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x ** 2))
    assert err < tol, err


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0])
def test_direct_blocks_have_intended_scale(qt):
    std = 0.013
    n_blocks = 4096 * 32 // GGML_QUANT_SIZES[qt][0]
    b = synth_quant.direct_blocks(qt, n_blocks, std, np.random.SFC64(1))
    y = gguf.quants.dequantize(b.reshape(n_blocks, -1), qt).reshape(-1)
    assert np.isfinite(y).all()
    assert abs(float(y.std()) / std - 1) < 0.05
    assert abs(float(y.mean())) < 0.02 * std


# ------------------------------------------------------------------------------------------------
# vocabulary and tokenizer

@pytest.mark.parametrize("n", [259, 512, 5000, 248320])
def test_vocab_is_valid_bpe(n):
    tokens, types, merges = synth.build_vocab(n)
    assert len(tokens) == len(types) == n and len(set(tokens)) == n
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[-3:] == [3, 3, 3] and set(types[:-3]) == {1}
    b2u = synth.bytes_to_unicode()
    assert tokens[:256] == [b2u[b] for b in range(256)]
    assert len(merges) == n - 3 - 256
    known = set(tokens[:256])
    for m, tok in zip(merges, tokens[256:]):
        a, b = m.split(" ")
        assert a in known and b in known and a + b == tok
        known.add(tok)


def test_tokenizer_roundtrip(tiny_files):
    from engine.tokenizer import Tokenizer
    text = "Hello world!\n  The quick brown fox, 1234 times. <|im_start|>user\nÜber café 日本<|im_end|>"
    for arch in ("llama", "qwen35"):
        f = GGUFFile(tiny_files[(arch, False)][0])
        tok = Tokenizer.from_metadata(f.metadata)
        f.close()
        ids = tok.encode(text, add_special=False, parse_special=True)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())                 # merges are used
        assert tok.encode("<|im_end|>", add_special=False, parse_special=True) == [511]


def test_engine_runs_tiny_models(tiny_files):
    from engine.models import ARCHITECTURES, open_model
    from engine.tools.perplexity import perplexity
    from engine.tokenizer import Tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * 20
    for arch in sorted(set(ARCHITECTURES) & set(synth.ARCHS)):
        m = open_model(tiny_files[(arch, False)][0])
        try:
            tok = Tokenizer.from_metadata(m.file.metadata)
            r = perplexity(m, tok, text, n_ctx=64, n_chunks=1)
            assert math.isfinite(r.ppl) and 1.0 < r.ppl < 50 * 512, (arch, r.ppl)
        finally:
            m.close()


# ------------------------------------------------------------------------------------------------
# command line

def test_cli(tmp_path, capsys):
    from app.cli import main
    out = tmp_path / "q.gguf"
    assert main(["synth", "--arch", "qwen35", "--mtp", "--seed", "3", "--weight-type", "q8_0", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    f = GGUFFile(out)
    assert f.metadata["qwen35.nextn_predict_layers"] == 1
    assert f.tensors["blk.0.ffn_up.weight"].qtype == QT.Q8_0
    f.close()
    assert main(["synth", "--arch", "llama", "--preset", "27b-q4_k_m", str(tmp_path / "x.gguf")]) == 1
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()


def test_errors():
    with pytest.raises(ValueError, match="unknown architecture"):
        synth.synth_spec("gpt2")
    with pytest.raises(ValueError, match="preset"):
        synth.synth_spec("llama", "huge")
    with pytest.raises(ValueError, match="mtp"):
        synth.synth_spec("llama", mtp=True)
    with pytest.raises(ValueError, match="too small"):
        synth.synth_spec("llama", vocab_size=100)


# ------------------------------------------------------------------------------------------------
# optional: llama.cpp loads and runs every tiny file

def _llama_perplexity() -> str | None:
    cand = os.environ.get("HIVEJET_LLAMA_PERPLEXITY") or "/tmp/llamacpp-build/build/bin/llama-perplexity"
    return cand if os.access(cand, os.X_OK) else shutil.which("llama-perplexity")


@pytest.mark.parametrize("arch,mtp", TINY_CASES)
def test_llama_cpp_runs_tiny(tiny_files, tmp_path, arch, mtp):
    exe = _llama_perplexity()
    if exe is None:
        pytest.skip("llama-perplexity not built (set HIVEJET_LLAMA_PERPLEXITY)")
    text = tmp_path / "t.txt"
    text.write_text(("The quick brown fox jumps over the lazy dog. 0123456789\n" * 40), encoding="utf-8")
    r = subprocess.run([exe, "-m", str(tiny_files[(arch, mtp)][0]), "-f", str(text), "-c", "128", "--chunks", "2",
                        "-t", "2", "-b", "128"], capture_output=True, text=True, timeout=120)
    out = r.stderr + r.stdout
    assert r.returncode == 0, out[-3000:]
    # per-chunk values "[1]862.3,[2]..."; llama.cpp logs asynchronously, so under load the last lines
    # ("Final estimate: PPL = ...") can be lost at exit: require at least the first chunk's value
    ppl = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+(?:e[+-]?\d+)?),", out)]
    assert ppl and all(math.isfinite(v) and v > 1 for v in ppl), out[-3000:]
