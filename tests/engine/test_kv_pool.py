"""The paged KV pool and SequenceKV: blocks, free list, reference counts, growth and a fixed size,
sliding-window layers keeping only their window, copy-on-write sharing, release; the models on the
pool with every cache type (the real SmolLM2 and Gemma-3, a synthetic qwen35); the engine and the
perplexity command with cache types."""
from __future__ import annotations

import gc
import math
import re
import time

import pytest
import torch

from engine.kv import KVPool, LayerKV, PoolFullError, SequenceKV
from kernels.attention import causal_attention
from kernels.kvcodec import CACHE_TYPES


def _kv(n, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)


def test_blocks_free_list_and_refcounts():
    pool = KVPool({0: LayerKV(2, 64, 64)}, "f32", block_size=4, n_blocks=6)
    g = pool.group(0)
    a = g.alloc(2)
    b = g.alloc(3)
    assert a == [0, 1] and b == [2, 3, 4] and g.n_free == 1
    g.incref(a)
    g.free(a)
    assert g.n_free == 1                 # still referenced once
    g.free(a)
    assert g.n_free == 3
    with pytest.raises(ValueError, match="freed twice"):
        g.free([a[0]])
    with pytest.raises(PoolFullError):
        g.alloc(4)
    assert pool.bytes_per_token() == 2 * 2 * 64 * 4


def test_sequences_share_one_pool_without_clobbering():
    pool = KVPool(cache_type_k="f32", block_size=4)       # grows on demand
    seqs = [SequenceKV(pool=pool) for _ in range(3)]
    data = [_kv(23, seed=i) for i in range(3)]
    for start in range(0, 23, 5):                          # interleaved chunk writes, block boundaries crossed
        for s, (k, v) in zip(seqs, data):
            s.append(0, start, k[start:start + 5], v[start:start + 5])
    for s, (k, v) in zip(seqs, data):
        K, V = s.append(0, 23, k[:0], v[:0])
        assert torch.equal(K, k) and torch.equal(V, v)
    used = pool.group(0).n_used
    assert used == 3 * math.ceil(23 / 4)
    del seqs, s
    gc.collect()
    assert pool.group(0).n_used == 0                       # released when the sequences go away


def test_old_signature_and_truncate():
    kv = SequenceKV(4, torch.float32)
    k, v = _kv(10)
    K, V = kv.append(2, 0, k, v)
    assert torch.equal(K, k) and kv.dtype == torch.float32 and kv.cache_types == ("f32", "f32")
    kv.length = 10
    kv.truncate(6)
    k2, v2 = _kv(3, seed=1)
    K, V = kv.append(2, 6, k2, v2)
    assert torch.equal(K[:6], k[:6]) and torch.equal(K[6:], k2)
    assert SequenceKV(2).cache_types == ("f16", "f16")
    assert SequenceKV(2, cache_type_k="q8_0", cache_type_v="turbo3").cache_types == ("q8_0", "turbo3")


def test_sliding_window_layers_keep_only_their_window():
    W, bs = 16, 4
    layers = {0: LayerKV(1, 64, 64, window=W), 1: LayerKV(1, 64, 64)}
    pool = KVPool(layers, "f32", block_size=bs)
    kv = SequenceKV(pool=pool)
    k, v = _kv(100, hkv=1)
    q = torch.randn(100, 2, 64)
    outs = {0: [], 1: []}
    for start in range(0, 100, 7):
        for il in (0, 1):
            outs[il].append(kv.attend(il, q[start:start + 7], k[start:start + 7], v[start:start + 7], start, 0.1,
                                      W if il == 0 else 0))
    for il, window in ((0, W), (1, 0)):
        want = causal_attention(q, k, v, 0, 0.1, window)
        assert torch.allclose(torch.cat(outs[il]), want, atol=1e-6)
    swa, full = pool.group(0), pool.group(1)
    assert full.n_used == 25
    assert swa.n_used <= (W + 7) // bs + 2                  # window + one chunk, not the whole sequence
    assert kv.first_position(0) > 0 and kv.first_position(1) == 0
    with pytest.raises(ValueError, match="dropped"):
        kv.attend(0, q[:1], k[:1], v[:1], 30, 0.1, W)       # going back before the kept window


def test_fork_shares_blocks_copy_on_write():
    pool = KVPool(cache_type_k="f32", block_size=4)
    a = SequenceKV(pool=pool)
    k, v = _kv(10)
    a.append(0, 0, k, v)
    a.length = 10
    b = a.fork()
    g = pool.group(0)
    assert g.n_used == 3 and all(g.refcount[x] == 2 for x in a.tables[0].blocks)
    kb, vb = _kv(4, seed=5)
    Kb, _ = b.append(0, 8, kb, vb)                          # writes into the shared 3rd block: copied
    Ka, _ = a.append(0, 10, k[:0], v[:0])
    assert torch.equal(Ka, k) and torch.equal(Kb[:8], k[:8]) and torch.equal(Kb[8:], kb)
    assert a.tables[0].blocks[:2] == b.tables[0].blocks[:2] and a.tables[0].blocks[2] != b.tables[0].blocks[2]
    a.release()
    b.release()
    assert g.n_used == 0


@pytest.mark.parametrize("kt,vt", [("turbo3", "turbo3"), ("q8_0", "turbo2_tcq"), ("turbo4", "f16")])
def test_rotated_domain_attention_equals_decoded(kt, vt):
    """attend() scores rotated keys with a rotated query and un-rotates the output: the same as
    plain attention over the K/V decoded back to the original domain."""
    kv = SequenceKV(1, cache_type_k=kt, cache_type_v=vt)
    k, v = _kv(40, hkv=2, d=64)
    q = torch.randn(40, 6, 64)
    out = kv.attend(0, q, k, v, 0, 0.125)
    K, V = kv.append(0, 40, k[:0], v[:0])
    assert torch.allclose(out, causal_attention(q, K, V, 0, 0.125), atol=2e-5)


@pytest.mark.parametrize("kt,vt", [("turbo3", "q8_0"), ("turbo2_tcq", "turbo4")])
def test_triton_kernels_read_the_pool(kt, vt, monkeypatch):
    """The Triton decode and prefill kernels on the pool's own storage and block tables (a
    full-attention layer and a sliding-window one with dropped blocks) give what SequenceKV.attend
    computes, with the query prepared like the stored keys (smoothing weights, per-segment centers;
    segments of 16 positions here, so the 40 tokens have three)."""
    pytest.importorskip("triton")
    from kernels.attention.paged import paged_decode_attention, paged_prefill_attention
    monkeypatch.setattr(SequenceKV, "SEGMENT", 16)
    monkeypatch.setattr(SequenceKV, "SEG_MIN_KEYS", 4)
    pool = KVPool({0: LayerKV(2, 64, 64), 1: LayerKV(2, 64, 64, window=12)}, kt, vt, block_size=8)
    kv = SequenceKV(pool=pool)
    k, v = _kv(40, hkv=2, d=64, seed=3)
    k[:, :, 7] += 5.0
    q = torch.randn(40, 6, 64, generator=torch.Generator().manual_seed(4))
    for il, W in ((0, 0), (1, 12)):
        out = kv.attend(il, q[:35], k[:35], v[:35], 0, 0.125, W)
        out2 = torch.cat([kv.attend(il, q[i:i + 1], k[i:i + 1], v[i:i + 1], i, 0.125, W) for i in range(35, 39)])
        last = kv.attend(il, q[39:], k[39:], v[39:], 39, 0.125, W)
        assert kv.kprep[il]["w"] is not None and len(kv.kprep[il]["centers"]) == 3
        g = pool.group(il)
        bt = torch.tensor([kv.tables[g.gid].blocks], dtype=torch.int32)
        if W:
            assert (bt[0, :3] == -1).all()                      # blocks before the window were dropped
        bias, seg = kv.score_bias(il, q[39:])
        dec = paged_decode_attention(kv.prep_query(il, q[39:]), g.k[il], g.v[il], bt, torch.tensor([40]),
                                     pool.codec_k, pool.codec_v, 0.125, 64, window=W, n_split=2, block_t=16, min_keys=16,
                                     seg_bias=bias, seg_len=seg)
        assert torch.allclose(dec, last, atol=1e-4)
        bias, seg = kv.score_bias(il, q[35:])
        pre = paged_prefill_attention(kv.prep_query(il, q[35:]), g.k[il], g.v[il], bt, torch.tensor([0, 5]),
                                      torch.tensor([35]), pool.codec_k, pool.codec_v, 0.125, 64, window=W,
                                      block_t=16, seg_bias=bias, seg_len=seg)
        assert torch.allclose(pre, torch.cat([out2, last]), atol=1e-4)
        if not W:
            K, V = kv.append(il, 40, k[:0], v[:0])               # decoded back to the original domain
            assert torch.allclose(torch.cat([out, out2, last]), causal_attention(q, K, V, 0, 0.125), atol=1e-4)


# ----- the models on the pool -----

def _kld(ref_logits, logits):
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from engine.models import open_model
    m = open_model(smollm2_path)
    yield m
    m.close()


def test_smollm2_every_cache_type(smollm2, reference_dir):
    """160 tokens of real text in two chunks; each cache type's logits against the f16 cache's.
    (SmolLM2's 64-dim heads are padded to 128 for the turbo types.) Measured: f32 0.006 (the noise
    floor of this quantized model), q8_0 0.006, turbo3_tcq 0.065, turbo4 0.083, turbo3 0.19,
    turbo2_tcq 0.26, turbo2 0.72."""
    from engine.models.common import SeqChunk
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(smollm2.file.metadata)
    toks = torch.tensor(tok.encode((reference_dir / "texts" / "heapq_py.txt").read_text())[:160])

    def run(kt, vt):
        kv = smollm2.new_kv(cache_type_k=kt, cache_type_v=vt)
        (a,) = smollm2.forward([SeqChunk(toks[:96], 0, kv, "all")])
        (b,) = smollm2.forward([SeqChunk(toks[96:], 96, kv, "all")])
        assert kv.cache_types == (kt, vt)
        return torch.cat([a, b])

    ref = run("f16", "f16")
    k = {t: _kld(ref, run(t, t)) for t in CACHE_TYPES if t != "f16"}
    k["q8_0/turbo3"] = _kld(ref, run("q8_0", "turbo3"))
    print({t: round(x, 5) for t, x in k.items()})
    for t in ("f32", "bf16", "q8_0"):
        assert k[t] < 0.015, (t, k[t])
    assert k["turbo4"] < 0.12
    assert k["turbo4"] < k["turbo3"] < k["turbo2"] and k["turbo3_tcq"] < k["turbo3"] and k["turbo2_tcq"] < k["turbo2"]
    assert k["q8_0/turbo3"] < k["turbo3"]
    assert set(smollm2.kv_pool("turbo3", "turbo3").layers) == set(range(30))


def test_qwen35_pool_holds_attention_layers_only(tmp_path):
    from engine.models import open_model
    from engine.models.common import SeqChunk
    from engine.tools.synth import write_synthetic
    path = tmp_path / "q35.gguf"
    write_synthetic(path, "qwen35", "tiny", seed=3)
    m = open_model(path)
    try:
        attn = [il for il in range(m.spec.n_layer) if not m.spec.is_recurrent(il)]
        pool = m.kv_pool("turbo3_tcq", "turbo3_tcq")
        assert sorted(pool.layers) == attn and len(attn) < m.spec.n_layer
        toks = torch.arange(1, 30)
        (ref,) = m.forward([SeqChunk(toks, 0, m.new_kv(torch.float32), "all")])
        kv = m.new_kv(cache_type_k="turbo3_tcq", cache_type_v="turbo3_tcq")
        (a,) = m.forward([SeqChunk(toks[:20], 0, kv, "all")])
        snap = kv.snapshot()
        (b,) = m.forward([SeqChunk(toks[20:], 20, kv, "all")])
        kv.restore(snap)
        (b2,) = m.forward([SeqChunk(toks[20:], 20, kv, "all")])
        assert torch.equal(b, b2)
        assert _kld(ref, torch.cat([a, b])) < 0.1
        assert m.new_mtp_kv().cache_types == ("f16", "f16")
    finally:
        m.close()


def test_engine_with_cache_types(smollm2_path):
    from engine.engine import Engine, EngineConfig
    from engine.sampling import SamplingParams
    from engine.types import EngineError, Request
    with pytest.raises(EngineError, match="unknown KV cache type"):
        Engine(EngineConfig(model=str(smollm2_path), cache_type_k="q5_9", threads=1))
    eng = Engine(EngineConfig(model=str(smollm2_path), cache_type_k="q8_0", cache_type_v="turbo3", threads=1,
                              resident_tokens=0))   # no resident conversations: blocks go back at once
    try:
        h = eng.submit(Request(prompt="The capital of France is", sampling=SamplingParams(temperature=0, max_tokens=4)))
        text, ids, fin = h.result()
        assert len(ids) == 4 and fin.reason == "length"
        pool = eng.model.kv_pool()
        assert (pool.cache_type_k, pool.cache_type_v) == ("q8_0", "turbo3")
        for _ in range(100):  # the finished sequence's blocks go back (once the step's locals are gone)
            if pool.group(0).n_used == 0:
                break
            time.sleep(0.05)
        assert pool.group(0).n_used == 0
    finally:
        eng.shutdown()


def test_perplexity_cache_types_and_own_base(tmp_path, smollm2_path, reference_dir, capsys):
    """--save-kl-divergence-base writes llama.cpp's binary base file; our f16 run against its own
    base is exact, a q8_0 cache is close to it."""
    from app.cli import main
    text = str(reference_dir / "texts" / "gpl3.txt")
    base = tmp_path / "f16.kld"
    args = ["perplexity", "-m", str(smollm2_path), "-f", text, "-c", "64", "--chunks", "2", "-b", "64", "-t", "1"]
    assert main(args + ["--save-kl-divergence-base", str(base)]) == 0
    out = capsys.readouterr().out
    ppl = float(re.search(r"PPL = ([0-9.]+)", out).group(1))
    assert main(args[:5] + ["-c", "64", "--chunks", "2", "-b", "64", "-t", "1", "--kl-divergence-base", str(base)]) == 0
    out = capsys.readouterr().out
    assert abs(float(re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", out).group(1))) < 1e-5
    assert float(re.search(r"Same top p:\s+([0-9.]+)", out).group(1)) == 100.0
    assert abs(float(re.search(r"PPL = ([0-9.]+)", out).group(1)) - ppl) < 1e-9
    assert main(args[:5] + ["-c", "64", "--chunks", "2", "-b", "64", "-t", "1", "--kl-divergence-base", str(base),
                            "-ctk", "q8_0", "-ctv", "q8_0"]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", out).group(1)) < 0.03
    assert main(args + ["-ctk", "q9_9"]) == 1
