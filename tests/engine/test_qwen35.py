"""qwen35 (Qwen3.5 hybrid: Gated DeltaNet + gated attention + MTP) on the CPU: chunked prefill carrying the recurrent state, snapshots, M-RoPE, the MTP block, and
perplexity against llama.cpp (a fixture made by tests/fixtures/make_llamacpp_ppl.py)."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.models import open_model
from engine.models.common import Rope, SeqChunk
from engine.models.qwen35 import MRope
from engine.tools.synth import write_synthetic

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GPL3 = Path(__file__).resolve().parents[3] / "shared" / "reference" / "texts" / "gpl3.txt"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qwen35")
    out = {}
    for name, kw in {"f32": dict(weight_type="F32"), "f32_mtp": dict(weight_type="F32", mtp=True),
                     "f16_mtp": dict(mtp=True)}.items():
        out[name] = d / f"{name}.gguf"
        write_synthetic(out[name], "qwen35", "tiny", seed=3, **kw)
    return out


@pytest.fixture(scope="module")
def model(files):
    m = open_model(files["f32_mtp"])
    yield m
    m.close()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 509, (n,), generator=torch.Generator().manual_seed(seed))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------------------------------------
# the model: layer kinds, chunked prefill, recurrent state

def test_spec_and_layers(model, files):
    s = model.spec
    assert (s.n_layer, s.n_layer_nextn) == (4, 1)
    assert s.recurrent_layers == (True, True, True, False)
    assert s.rope_sections == (2, 1, 1, 0) and s.rope_dim == 8
    assert (s.ssm_n_group, s.ssm_dt_rank, s.ssm_d_state, s.ssm_d_conv, s.ssm_d_inner) == (2, 4, 32, 4, 128)
    assert [L["recurrent"] for L in model.layers] == [True, True, True, False]
    assert model.mtp is not None
    # the MTP block changes nothing in the main model (same seed, same other tensors)
    m0 = open_model(files["f32"])
    try:
        assert m0.spec.n_layer == 4 and m0.spec.n_layer_nextn == 0 and m0.mtp is None
        t = tokens(20)
        (a,) = m0.forward([SeqChunk(t, 0, m0.new_kv(), "all")])
        (b,) = model.forward([SeqChunk(t, 0, model.new_kv(), "all")])
        assert torch.equal(a, b)
    finally:
        m0.close()


def _run_chunks(model, toks: torch.Tensor, size: int, kv_dtype=torch.float32) -> torch.Tensor:
    kv = model.new_kv(kv_dtype)
    out = []
    for start in range(0, len(toks), size):
        (lg,) = model.forward([SeqChunk(toks[start:start + size], start, kv, "all")])
        out.append(lg)
    assert kv.length == kv.recurrent_length == len(toks)
    return torch.cat(out)


def test_chunked_prefill_matches_one_pass(model):
    toks = tokens(300, seed=1)
    one = _run_chunks(model, toks, 300)
    assert one.shape == (300, 512) and torch.isfinite(one).all()
    for size in (1, 7, 64):
        d = rel_diff(_run_chunks(model, toks, size), one)
        print(f"chunks of {size}: max |diff| / max |logit| = {d:.2e}")
        assert d < 2e-5, (size, d)


def test_batched_sequences_match_alone(model):
    """Two sequences in one forward (prefill of one, decode of the other) = each alone."""
    a, b = tokens(50, 2), tokens(30, 3)
    kva, kvb = model.new_kv(torch.float32), model.new_kv(torch.float32)
    model.forward([SeqChunk(b[:29], 0, kvb, "none")])
    la, lb = model.forward([SeqChunk(a, 0, kva, "all"), SeqChunk(b[29:], 29, kvb, "all")])
    ra = _run_chunks(model, a, 50)
    rb = _run_chunks(model, b, 30)[29:]
    assert rel_diff(la, ra) < 2e-5 and rel_diff(lb, rb) < 2e-5


def test_snapshot_restore(model):
    toks = tokens(120, 4)
    kv = model.new_kv(torch.float32)
    model.forward([SeqChunk(toks[:100], 0, kv, "none")])
    snap = kv.snapshot()
    (x1,) = model.forward([SeqChunk(toks[100:110], 100, kv, "all")])
    (junk,) = model.forward([SeqChunk(toks[110:], 110, kv, "all")])
    with pytest.raises(ValueError, match="recurrent state"):
        model.forward([SeqChunk(toks[100:110], 100, kv, "all")])      # state is at 120, not 100
    kv.restore(snap)
    assert kv.length == kv.recurrent_length == 100
    (x2,) = model.forward([SeqChunk(toks[100:110], 100, kv, "all")])
    assert torch.equal(x1, x2)
    # starting again at 0 resets the recurrent state
    (y1,) = model.forward([SeqChunk(toks[:10], 0, kv, "all")])
    (y2,) = model.forward([SeqChunk(toks[:10], 0, model.new_kv(torch.float32), "all")])
    assert torch.equal(y1, y2)


def test_f16_weights_and_kv_run(files):
    """The default path (F16 weights, f16 KV): chunked equals one pass within f16 rounding."""
    m = open_model(files["f16_mtp"])
    try:
        toks = tokens(80, 5)
        one = _run_chunks(m, toks, 80, torch.float16)
        assert rel_diff(_run_chunks(m, toks, 16, torch.float16), one) < 1e-3
    finally:
        m.close()


# ------------------------------------------------------------------------------------------------
# M-RoPE

def test_mrope_matches_hf_interleaved_sections():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=256, num_attention_heads=1, head_dim=256, num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    hf = Qwen3_5TextRotaryEmbedding(cfg)
    ours = MRope(64, 1e7, (11, 11, 10, 0))
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 5000, (37, 3), generator=g)
    cos_h, sin_h = hf(torch.zeros(1, dtype=torch.float32), pos.T[:, None, :])
    cos, sin = ours.cos_sin(pos)
    assert torch.allclose(torch.cat([cos, cos], -1), cos_h[0], atol=2e-3)   # HF: float32 angles up to 5000 rad
    assert torch.allclose(torch.cat([sin, sin], -1), sin_h[0], atol=2e-3)
    # text positions (same on all axes) = ordinary NEOX rope over the rotated dims
    p = torch.arange(100)
    c1, s1 = ours.cos_sin(p)
    c3, s3 = ours.cos_sin(p[:, None].expand(-1, 3))
    c0, s0 = Rope(64, 1e7, neox=True).cos_sin(p)
    assert torch.equal(c1, c3) and torch.equal(s1, s3) and torch.allclose(c1, c0) and torch.allclose(s1, s0)
    x = torch.randn(100, 2, 256)
    assert torch.allclose(ours.apply(x, c1, s1), Rope(64, 1e7, neox=True).apply(x, c0, s0), atol=1e-6)


def test_mrope_positions_in_forward(model):
    toks = tokens(30, 6)
    (base,) = model.forward([SeqChunk(toks, 0, model.new_kv(torch.float32), "all")])
    text = torch.arange(30)[:, None].expand(-1, 3)
    (same,) = model.forward([SeqChunk(toks, 0, model.new_kv(torch.float32), "all", positions=text)])
    assert torch.equal(base, same)
    img = text.clone()
    img[10:20, 1] = torch.arange(10) % 5 + 10     # a 2x5 "image" grid: h, w differ from t
    img[10:20, 2] = torch.arange(10) // 5 + 10
    (other,) = model.forward([SeqChunk(toks, 0, model.new_kv(torch.float32), "all", positions=img)])
    assert torch.equal(other[:10], base[:10]) and not torch.allclose(other[10:], base[10:])


# ------------------------------------------------------------------------------------------------
# MTP

def _hand_mtp(path, tokens_: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP block written out from the GGUF tensors (read with the gguf package), for positions
    0..n-1 in one pass: llama.cpp graph_mtp."""
    r = gguf.GGUFReader(str(path))
    T = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in r.tensors}
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer")}
    L = md["qwen35.block_count"] - md["qwen35.nextn_predict_layers"]
    eps = md["qwen35.attention.layer_norm_rms_epsilon"]
    H, Hkv, hd = md["qwen35.attention.head_count"], md["qwen35.attention.head_count_kv"], md["qwen35.attention.key_length"]
    rd, base = md["qwen35.rope.dimension_count"], md["qwen35.rope.freq_base"]
    p = f"blk.{L}."

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def lin(x, name):
        return x @ T[p + name].T

    n = len(tokens_)
    e = T["token_embd.weight"][tokens_]
    x = lin(torch.cat([rms(e, T[p + "nextn.enorm.weight"]), rms(hidden, T[p + "nextn.hnorm.weight"])], -1),
            "nextn.eh_proj.weight")
    h = rms(x, T[p + "attn_norm.weight"])
    qg = lin(h, "attn_q.weight").view(n, H, 2 * hd)
    q, gate = rms(qg[..., :hd], T[p + "attn_q_norm.weight"]), qg[..., hd:]
    k = rms(lin(h, "attn_k.weight").view(n, Hkv, hd), T[p + "attn_k_norm.weight"])
    v = lin(h, "attn_v.weight").view(n, Hkv, hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    c, s = ang.cos().float()[:, None], ang.sin().float()[:, None]

    def rope(t):
        a, b = t[..., : rd // 2], t[..., rd // 2: rd]
        return torch.cat([a * c - b * s, a * s + b * c, t[..., rd:]], -1)

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    att = att.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, H * hd) * torch.sigmoid(gate.reshape(n, H * hd))
    x = x + lin(o, "attn_output.weight")
    h = rms(x, T[p + "post_attention_norm.weight"])
    x = x + lin(F.silu(lin(h, "ffn_gate.weight")) * lin(h, "ffn_up.weight"), "ffn_down.weight")
    return rms(x, T[p + "nextn.shared_head_norm.weight"]) @ T["output.weight"].T


def test_mtp_forward(model, files):
    toks = tokens(12, 7)
    (logits,), (hid,) = model.forward_with_hidden([SeqChunk(toks, 0, model.new_kv(torch.float32), "all")])
    assert hid.shape == (12, 128)
    assert torch.allclose(model.output.matmul(hid), logits, atol=1e-5)   # hidden = output-normed last layer
    # MTP row p: token x_p with h_{p-1} (zeros before the first token, as llama.cpp) -> predicts x_{p+1}
    h_prev = torch.cat([torch.zeros(1, 128), hid[:-1]])
    mkv = model.new_mtp_kv(torch.float32)
    (mtp_all,), (mh,) = model.mtp_forward([SeqChunk(toks, 0, mkv, "all")], [h_prev])
    assert mtp_all.shape == (12, 512) and mh.shape == (12, 128) and mkv.length == 12
    hand = _hand_mtp(files["f32_mtp"], toks, h_prev)
    d = rel_diff(mtp_all, hand)
    print(f"MTP vs hand computation: {d:.2e}")
    assert d < 1e-5
    # step by step with its own KV: the same numbers
    mkv = model.new_mtp_kv(torch.float32)
    steps = []
    for i in range(5):
        (lg,), _ = model.mtp_forward([SeqChunk(toks[i:i + 1], i, mkv, "last")], [h_prev[i:i + 1]])
        steps.append(lg)
    assert rel_diff(torch.cat(steps), hand[:5]) < 1e-5
    # the MTP block is not part of the main forward, and a model without it refuses
    with pytest.raises(ValueError, match="no MTP"):
        m0 = open_model(files["f32"])
        try:
            m0.mtp_forward([SeqChunk(toks, 0, m0.new_mtp_kv(), "all")], [h_prev])
        finally:
            m0.close()


# ------------------------------------------------------------------------------------------------
# perplexity against llama.cpp (b11434, CPU) on the same synthetic files

@pytest.mark.parametrize("arch", ["qwen35", "qwen3"])
def test_perplexity_matches_llama_cpp(tmp_path, arch):
    from engine.tools.perplexity import load_base, perplexity
    from engine.tokenizer import Tokenizer
    fx = FIXTURES / f"llamacpp_ppl_{arch}.npz"
    ref = np.load(fx)
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, "tiny", seed=0)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha == str(ref["model_sha256"]), (
        f"engine/tools/synth.py now writes a different {arch} tiny file than the one llama.cpp scored; "
        "regenerate the fixture with tests/fixtures/make_llamacpp_ppl.py")
    m = open_model(path)
    try:
        tok = Tokenizer.from_metadata(m.file.metadata)
        if GPL3.is_file():   # our tokenizer gives llama.cpp's tokens
            ids = tok.encode(GPL3.read_text(encoding="utf-8"), add_special=True, parse_special=True)
            assert np.array_equal(np.array(ids[:ref["tokens"].size]).reshape(ref["tokens"].shape), ref["tokens"])
        r = perplexity(m, tok, base=load_base(fx), n_batch=128)
    finally:
        m.close()
    llama_ppl = float(ref["ppl"])
    print(f"{arch}: PPL ours {r.ppl:.4f} llama.cpp {llama_ppl:.4f} (ratio {r.ppl / llama_ppl:.6f}), "
          f"KLD {r.kld_mean:.2e}, same top {r.same_top:.4f}")
    assert abs(r.ppl / llama_ppl - 1) < 0.01
    assert np.allclose(r.chunk_ppl, ref["chunk_ppl"], rtol=0.01)
    assert r.kld_mean < 1e-3 and r.same_top > 0.98


# ------------------------------------------------------------------------------------------------
# through the Engine: chunked prompts + recurrent decode, concurrent sequences

def test_engine_greedy_matches_manual_loop(files):
    from engine.engine import Engine, EngineConfig
    from engine.sampling import SamplingParams
    from engine.types import Request
    prompts = [tokens(40, 8).tolist(), tokens(23, 9).tolist()]
    m = open_model(files["f32"])
    try:
        manual = []
        for p in prompts:           # one prompt pass, then one token at a time (recurrent form)
            kv, out = m.new_kv(), []
            (lg,) = m.forward([SeqChunk(torch.tensor(p), 0, kv, "last")])
            for _ in range(12):
                out.append(int(lg[-1].argmax()))
                (lg,) = m.forward([SeqChunk(torch.tensor(out[-1:]), len(p) + len(out) - 1, kv, "last")])
            manual.append(out)
    finally:
        m.close()
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = Engine(EngineConfig(model=str(files["f32"]), prefill_chunk=16, step_tokens=32))
    try:
        solo = [eng.submit(Request(prompt_ids=p, sampling=greedy)).result()[1] for p in prompts]
        handles = [eng.submit(Request(prompt_ids=p, sampling=greedy)) for p in prompts]
        together = [h.result()[1] for h in handles]
    finally:
        eng.shutdown()
    assert solo == manual and together == manual


def test_spec_reads_recurrent_layers_array(files):
    """Converted checkpoints with HF layer_types carry an explicit per-block array; it wins over
    full_attention_interval (llama.cpp load_arch_hparams)."""
    from types import SimpleNamespace

    from engine.gguf.reader import GGUFFile
    from engine.gguf.spec import spec_from_gguf
    f = GGUFFile(files["f32_mtp"])
    md = dict(f.metadata)
    f.close()
    md["qwen35.attention.recurrent_layers"] = [True, False, True, False, False]
    s = spec_from_gguf(SimpleNamespace(metadata=md, architecture="qwen35", path="x.gguf"))
    assert s.n_layer == 4 and s.recurrent_layers == (True, False, True, False)
    del md["qwen35.attention.recurrent_layers"]
    md["qwen35.full_attention_interval"] = 2
    s = spec_from_gguf(SimpleNamespace(metadata=md, architecture="qwen35", path="x.gguf"))
    assert s.recurrent_layers == (True, False, True, False)
