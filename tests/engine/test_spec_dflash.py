"""DFlash drafting (engine/spec/dflash.py) and drafter chains on the CPU engine path, with a synthetic
DFlash drafter (engine/tools/synth_dflash.py) for a synthetic qwen35 target:
- loading: a z-lab-style directory (config.json + model.safetensors) and the GGUF port give the same
  drafter; clear errors for drafters made for another target;
- the forward: the incrementally kept context K/V gives what an independent full recompute following
  z-lab's DFlashDraftModel gives (sliding / full layers, causal or not);
- the engine: greedy output with dflash, dflash+ngram and mtp+ngram is token-for-token the output
  without drafts; at temperature 0.8 the first 3 tokens keep their distribution (chi-square);
  stats() reports acceptance per drafter and per sequence."""
from __future__ import annotations

import collections
import dataclasses
import json
import types

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.models import open_model
from engine.models.common import SeqChunk
from engine.sampling import Sampler, SamplingParams
from engine.spec.dflash import DFlashError, DraftRequest, gguf_to_hf_name, load_drafter, propose, read_safetensors
from engine.tools.synth_dflash import hf_to_gguf_name, synthetic_drafter, write_dir, write_gguf, write_safetensors
from engine.tools.synth import write_synthetic
from engine.types import EngineError, Request
from tests.engine.test_spec_ngram import _chi2_p


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A synthetic qwen35 target (with an MTP block, for the mtp+ngram chain) and a derived DFlash
    drafter for it, written as a directory and as a GGUF."""
    d = tmp_path_factory.mktemp("dflash")
    target = d / "qwen35.gguf"
    write_synthetic(target, "qwen35", "tiny", seed=8, mtp=True)
    config, tensors = synthetic_drafter(target, seed=1)
    return types.SimpleNamespace(target=target, config=config, tensors=tensors,
                                 dir=write_dir(d / "drafter", config, tensors),
                                 gguf=write_gguf(d / "drafter.gguf", config, tensors))


PROMPTS = [[3 + (5 * i + 11 * j) % 400 for j in range(40 + 13 * i)] for i in range(3)]


# ----- loading ---------------------------------------------------------------------------------

def test_directory_and_gguf_load_the_same_drafter(pair):
    a, b = load_drafter(pair.dir), load_drafter(pair.gguf)
    assert dataclasses.replace(a.cfg, rms_eps=b.cfg.rms_eps) == b.cfg   # (GGUF keeps eps as float32)
    assert a.cfg.rms_eps == pytest.approx(b.cfg.rms_eps)
    assert a.cfg.target_layer_ids == (0, 2, 3) and a.cfg.block_size == 16 and a.cfg.sliding == (True, False)
    assert a.cfg.causal == (False, False) and a.cfg.sliding_window == 16
    assert torch.equal(a.fc, b.fc) and torch.equal(a.norm, b.norm)
    for la, lb in zip(a.layers, b.layers):
        assert la.keys() == lb.keys()
        assert all(torch.equal(la[k], lb[k]) for k in la if la[k] is not None)
    m = open_model(pair.target)
    try:
        a.check_target(m)
        b.check_target(m)
    finally:
        m.close()


def test_safetensors_match_the_reference_package(tmp_path, pair):
    st = pytest.importorskip("safetensors.torch")
    ours = read_safetensors(pair.dir / "model.safetensors")
    theirs = st.load_file(str(pair.dir / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    t = {"w": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16)}
    st.save_file(t, str(tmp_path / "x.safetensors"))
    back = read_safetensors(tmp_path / "x.safetensors")
    assert torch.equal(back["w"], t["w"]) and torch.equal(back["b"], t["b"].float())
    write_safetensors(tmp_path / "y.safetensors", t, torch.bfloat16)
    assert torch.equal(st.load_file(str(tmp_path / "y.safetensors"))["w"], t["w"].to(torch.bfloat16))


def test_gguf_names_round_trip(pair):
    for name in pair.tensors:
        assert gguf_to_hf_name(hf_to_gguf_name(name)) == name
    assert hf_to_gguf_name("fc.weight") == "dflash_fc.weight"
    assert hf_to_gguf_name("layers.1.self_attn.k_norm.weight") == "blk.1.attn_k_norm.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "layers.0.post_attention_layernorm.weight"


def _target(n_embd=128, n_layer=4, vocab=512):
    return types.SimpleNamespace(spec=types.SimpleNamespace(n_embd=n_embd, n_layer=n_layer, vocab_size=vocab))


def test_mismatched_targets_are_refused(pair, tmp_path):
    dr = load_drafter(pair.dir)
    dr.check_target(_target())
    with pytest.raises(DFlashError, match="hidden size"):
        dr.check_target(_target(n_embd=256))
    with pytest.raises(DFlashError, match="vocabulary"):
        dr.check_target(_target(vocab=600))
    with pytest.raises(DFlashError, match=r"target_layer_ids \[2, 3\] are out of range"):
        dr.check_target(_target(n_layer=2))
    # the engine says so before serving anything: tiny llama has 2 layers
    llama = tmp_path / "llama.gguf"
    write_synthetic(llama, "llama", "tiny", seed=1)
    with pytest.raises(EngineError, match="DFlash drafter: .*out of range"):
        Engine(EngineConfig(model=str(llama), spec="dflash", spec_drafter=str(pair.dir)))
    with pytest.raises(EngineError, match="needs a DFlash drafter"):
        Engine(EngineConfig(model=str(pair.target), spec="dflash"))


def test_broken_drafter_files(pair, tmp_path):
    t = dict(pair.tensors)
    t["layers.0.self_attn.q_proj.weight"] = t["layers.0.self_attn.q_proj.weight"][:, :64]
    with pytest.raises(DFlashError, match="q_proj.weight' has shape"):
        load_drafter(write_dir(tmp_path / "bad_shape", pair.config, t))
    t = dict(pair.tensors, **{"lm_head.weight": torch.zeros(2, 2)})
    with pytest.raises(DFlashError, match="does not know: \\['lm_head.weight'\\]"):
        load_drafter(write_dir(tmp_path / "extra", pair.config, t))
    cfg = json.loads(json.dumps(pair.config))
    del cfg["dflash_config"]["target_layer_ids"]
    with pytest.raises(DFlashError, match="target_layer_ids"):
        load_drafter(write_dir(tmp_path / "no_ids", cfg, pair.tensors))
    with pytest.raises(DFlashError, match="no such drafter"):
        load_drafter(tmp_path / "missing")


# ----- the forward ------------------------------------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def reference_block(dr, target, feats: torch.Tensor, token: int) -> torch.Tensor:
    """z-lab's DFlashDraftModel.forward written out for one block, from scratch: the whole context
    (target features of positions 0..n-1) projected and concatenated with the block's rows as K/V."""
    c = dr.cfg
    n, B, D = feats.shape[0], c.block_size, c.head_dim
    ctx = _rms(feats @ dr.fc.T, dr.hidden_norm, c.rms_eps)
    x = target.tok_embd.rows(torch.tensor([token] + [c.mask_token_id] * (B - 1))).float()
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(n + B, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]
    qpos, kpos = torch.arange(n, n + B)[:, None], torch.arange(n + B)[None, :]
    for il, L in enumerate(dr.layers):
        h = _rms(x, L["input_norm"], c.rms_eps)
        q = _rms((h @ L["q"].T).view(B, c.n_head, D), L["q_norm"], c.rms_eps)
        k = _rms((torch.cat([ctx, h]) @ L["k"].T).view(n + B, c.n_head_kv, D), L["k_norm"], c.rms_eps)
        v = (torch.cat([ctx, h]) @ L["v"].T).view(n + B, c.n_head_kv, D)
        q = q * cos[n:] + _rotate_half(q) * sin[n:]
        k = k * cos + _rotate_half(k) * sin
        rep = c.n_head // c.n_head_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        visible = torch.ones(B, n + B, dtype=torch.bool)
        if c.causal[il]:
            visible &= kpos <= qpos
        if c.sliding[il]:
            visible &= (qpos - kpos).abs() < c.sliding_window if not c.causal[il] else (qpos - kpos) < c.sliding_window
        a = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
        x = x + a.reshape(B, -1) @ L["o"].T
        h = _rms(x, L["post_norm"], c.rms_eps)
        x = x + (torch.nn.functional.silu(h @ L["gate"].T) * (h @ L["up"].T)) @ L["down"].T
    return _rms(x, dr.norm, c.rms_eps)


@pytest.mark.parametrize("causal", [False, True])
def test_incremental_context_matches_a_full_recompute(pair, tmp_path, causal):
    """Context appended in three pieces (as the engine does after prompt chunks and verify steps)
    drafts from the same numbers as z-lab's forward over the whole context at once; random weights,
    layer 0 sliding (window 16 < 40 context rows), layer 1 full."""
    config, tensors = synthetic_drafter(pair.target, seed=5, derived=False)
    dr = load_drafter(write_dir(tmp_path / f"random{causal}", config, tensors))
    dr.cfg = dataclasses.replace(dr.cfg, causal=(causal, False))
    m = open_model(pair.target)
    try:
        m.capture_layers = dr.cfg.target_layer_ids
        kv, st = m.new_kv(torch.float32), dr.new_state()
        toks = PROMPTS[0]
        feats = []
        for lo, hi in ((0, 17), (17, 30), (30, 40)):
            c = SeqChunk(torch.tensor(toks[lo:hi]), lo, kv, "last")
            m.forward([c])
            dr.extend([(st, c.features)])
            feats.append(c.features)
        (got,) = dr.block_hidden(m, [st], [toks[-1] + 1])
        want = reference_block(dr, m, torch.cat(feats), toks[-1] + 1)
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
        # drafts come from rows 1..: greedy drafts are the LM head's argmax of those rows
        r = DraftRequest(st, toks[-1] + 1, 5, Sampler(SamplingParams(temperature=0.0), m.spec.vocab_size), toks)
        propose(dr, m, [r])
        assert st.drafts == m.output.matmul(want[1:6]).argmax(-1).tolist() and st.q is None
    finally:
        m.close()


def test_last_target_layer_is_output_normed(pair):
    """hidden_states[n_layer] in HF is the output-normed final state: what forward_with_hidden returns."""
    m = open_model(pair.target)
    try:
        m.capture_layers = (m.spec.n_layer - 1,)
        c = SeqChunk(torch.tensor(PROMPTS[1][:20]), 0, m.new_kv(torch.float32), "last")
        _, (h,) = m.forward_with_hidden([c])
        assert torch.allclose(c.features, h)
    finally:
        m.close()


# ----- the engine -------------------------------------------------------------------------------

def _run(pair, spec, prompts, **kw):
    eng = Engine(EngineConfig(model=str(pair.target), spec=spec, spec_drafter=str(pair.gguf), ctx_size=256,
                              prefill_chunk=16, resident_tokens=0, **kw))
    try:
        hs = [eng.submit(Request(prompt_ids=p, sampling=SamplingParams(max_tokens=24, temperature=0.0,
                                                                         ignore_eos=True))) for p in prompts]
        return [h.result()[1] for h in hs], eng.stats()
    finally:
        eng.shutdown()


def test_greedy_identical_with_dflash_and_chains(pair):
    # a prompt whose greedy continuation repeats a span of it: there the chains draft by n-gram lookup
    # (this one, from PROMPTS[0][:20], is continued with the rest of the span: greedy, deterministic)
    (cont,), _ = _run(pair, "off", [PROMPTS[0][:20]])
    prompts = PROMPTS + [PROMPTS[0][:20] + cont + PROMPTS[0][:20] + cont[:4]]
    base, _ = _run(pair, "off", prompts)
    for spec in ("dflash", "dflash+ngram", "mtp+ngram"):
        out, stats = _run(pair, spec, prompts)
        assert out == base, spec
        by = stats["spec"]["drafters"]
        model = spec.split("+")[0]
        assert by[model]["drafted"] > 20, (spec, by)
        if spec == "dflash":   # the derived drafter's first draft is often the target's choice
            assert 0 < by["dflash"]["accepted"] < by["dflash"]["drafted"]
            assert stats["totals"]["accepted_tokens"] == by["dflash"]["accepted"]
        else:                  # the echoing prompt drafts by n-gram lookup, the others by the model
            assert by["ngram"]["accepted"] > 10, (spec, by)


def test_stats_per_sequence(pair):
    eng = Engine(EngineConfig(model=str(pair.target), spec="dflash", spec_drafter=str(pair.dir), ctx_size=512,
                              resident_tokens=0))
    try:
        h = eng.submit(Request(prompt_ids=PROMPTS[2], sampling=SamplingParams(max_tokens=400, temperature=0.0,
                                                                                ignore_eos=True)))
        seen = None
        for n, _ in enumerate(h):
            if n >= 12:
                seen = [s for s in eng.stats()["sequences"] if s["id"] == h.id]
                h.cancel()
                break
        for _ in h:
            pass
    finally:
        eng.shutdown()
    (s,) = seen
    assert s["drafted"] > 0 and s["drafters"]["dflash"]["drafted"] == s["drafted"]
    assert s["drafters"]["dflash"]["acceptance"] == round(s["accepted"] / s["drafted"], 3)


@pytest.mark.parametrize("slots", [False, True], ids=["cpu_path", "gpu_path"])
def test_sampled_distribution_with_dflash(pair, slots):
    """At temperature 0.8 drafts are sampled from the drafter's q, accepted with min(1, p/q), the first
    rejection resampled from normalize(max(p - q, 0)). Seeds 0..599 per arm: p = 0.86 (when the
    residual is wrongly taken as p without the draft, the same test gives p = 0.0003)."""
    n = 600
    samples = {}
    for spec in ("off", "dflash"):
        eng = Engine(EngineConfig(model=str(pair.target), spec=spec, spec_drafter=str(pair.dir), ctx_size=256,
                                  max_seqs=16, resident_tokens=0, spec_max_drafts=3, max_queue=n + 16,
                                  static_slots=slots, prefill_chunk=64 if slots else 512,
                                  spec_adaptive=not slots))   # (GPU path: fixed lengths, no timing)
        try:
            hs = [eng.submit(Request(prompt_ids=PROMPTS[0], sampling=SamplingParams(
                max_tokens=4, temperature=0.8, top_k=4, top_p=1.0, min_p=0.0, seed=seed, ignore_eos=True)))
                for seed in range(n)]
            samples[spec] = collections.Counter(tuple(h.result()[1][:3]) for h in hs)
            if spec == "dflash":   # both branches ran: drafts accepted and rejected
                t = eng.stats()["totals"]
                assert t["drafted_tokens"] > n // 2 and 0 < t["accepted_tokens"] < t["drafted_tokens"] / 2
        finally:
            eng.shutdown()
    p = _chi2_p(samples["off"], samples["dflash"])
    print(f"DFlash ({'GPU' if slots else 'CPU'} path): chi-square homogeneity of the first 3 tokens, {n} seeds per arm: p = {p:.3f}")
    assert p > 0.01, p


def test_command_line_and_bench(pair, capsys):
    from app.cli import main
    from engine.tools.bench_spec import measure
    assert main(["generate", "-m", str(pair.target), "--spec", "dflash", "--spec-drafter", str(pair.dir), "-p",
                 "hello", "--temp", "0", "-n", "6", "--no-echo", "--ignore-eos", "--device", "cpu"]) == 0
    assert "generated 6 tokens" in capsys.readouterr().err
    rows = {r["spec"]: r for r in measure(str(pair.target), n_tokens=12, modes=("off",), drafter=str(pair.gguf))}
    assert set(rows) == {"off", "dflash", "dflash+ngram"}
    assert all(r["same_as_off"] for r in rows.values()) and rows["dflash"]["drafted"] > 0


def test_gpu_path_follow_up_keeps_the_dflash_context(pair):
    """The GPU path (static slots on the CPU): a finished conversation's DFlash context stays with its
    parked slot, and the follow-up request that continues it drafts from it at once (resume_at: rows of
    the cached positions kept); the tokens are those of spec off."""
    follow = [5, 6, 7, 8]

    def serve(spec):
        eng = Engine(EngineConfig(model=str(pair.target), spec=spec, spec_drafter=str(pair.gguf), ctx_size=256,
                                  prefill_chunk=16, static_slots=True, max_seqs=2, state_checkpoints=4,
                                  spec_adaptive=False, spec_max_drafts=4))
        try:
            greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            first = eng.submit(Request(prompt_ids=PROMPTS[1], sampling=greedy)).result()[1]
            second = eng.submit(Request(prompt_ids=PROMPTS[1] + first + follow, sampling=greedy)).result()[1]
            return [first, second], eng.stats()["totals"]
        finally:
            eng.shutdown()

    off, _ = serve("off")
    on, totals = serve("dflash")
    assert on == off
    assert totals["dflash_resumed"] == 1 and totals["cached_tokens"] > len(PROMPTS[1]), totals
    assert totals["dflash_accepted"] > 0


def test_gpu_path_shared_prefix_forks_the_dflash_context(pair, monkeypatch):
    """The GPU path (static slots on the CPU): a request that shares the first 32 tokens of a parked
    conversation gets a copy of that conversation's DFlash context rows (DFlashState.fork) and drafts exactly
    what it drafts when it computes its whole prompt itself; the tokens are the same too."""
    import engine.spec.speculator as es
    seen = []
    real = es.propose

    def propose(d, model, reqs):
        real(d, model, reqs)
        seen.extend((len(r.history), tuple(r.state.drafts)) for r in reqs)
    monkeypatch.setattr(es, "propose", propose)
    other = PROMPTS[1][:32] + [9, 10, 11, 12, 13]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def serve(donor_first):
        eng = Engine(EngineConfig(model=str(pair.target), spec="dflash", spec_drafter=str(pair.gguf), ctx_size=256,
                                  prefill_chunk=16, static_slots=True, max_seqs=2, state_checkpoints=4,
                                  spec_adaptive=False, spec_max_drafts=4))
        try:
            if donor_first:
                eng.submit(Request(prompt_ids=PROMPTS[1], sampling=greedy)).result()
            seen.clear()
            out = eng.submit(Request(prompt_ids=other, sampling=greedy)).result()[1]
            return out, list(seen), eng.stats()["totals"]
        finally:
            eng.shutdown()

    shared, drafts_shared, totals = serve(True)
    fresh, drafts_fresh, _ = serve(False)
    assert totals["shared_tokens"] == 32 and totals["dflash_resumed"] == 1, totals
    assert shared == fresh and drafts_shared == drafts_fresh and drafts_shared


def test_dflash_state_resume():
    """DFlashState.resume_at keeps the context rows before n (truncating, or taking held-back rows)."""
    from engine.spec.dflash import DFlashState
    st = DFlashState(2)
    for rows in st.keys + st.values:
        rows.append(torch.arange(10.0)[:, None])
    st.length = 10
    assert st.resume_at(6) and st.length == 6 and all(r.n == 6 for r in st.keys + st.values)
    st.deferred = torch.zeros(3, 4)                      # positions 6, 7, 8 held back
    assert not st.resume_at(10)
    assert st.resume_at(8) and st.length == 6 and st.deferred.shape[0] == 2


def test_dflash_state_fork():
    """DFlashState.fork copies the context rows before n (and held-back rows), leaving the donor as it was."""
    from engine.spec.dflash import DFlashState
    st = DFlashState(2)
    for rows in st.keys + st.values:
        rows.append(torch.arange(10.0)[:, None])
    st.length = 10
    st.deferred = torch.ones(2, 4)                       # positions 10, 11 held back
    a, b = st.fork(6), st.fork(11)
    assert a.length == 6 and a.deferred is None and all(torch.equal(r.rows(0, r.n), torch.arange(6.0)[:, None])
                                                        for r in a.keys + a.values)
    assert b.length == 10 and b.deferred.shape[0] == 1 and st.fork(13) is None
    a.keys[0].buf[0] = 99.0
    assert st.keys[0].buf[0] == 0.0 and st.length == 10 and st.deferred.shape[0] == 2
