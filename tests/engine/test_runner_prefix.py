"""Prefix sharing on the GPU path (engine/runner/runner.py: find_prefix, copy_prefix, share_prefix, state
checkpoints; engine/engine.py: _take_slot), on the CPU through static slots and tiny synthetic models.

A request whose prompt starts like another slot's (running or parked) gets that prefix copied into its own
slot and computes only the rest; qwen35 restores its recurrent states from a checkpoint. Reuse never changes
the numbers: tokens and logprobs (runner: logits) are bit for bit those of a cold run."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.hostmem import physical_memory
from engine.kv.sequence import SequenceKV
from engine.models import open_model
from engine.runner import Runner, state_checkpoint_bytes
from engine.runner_fit import RunnerFit
from engine.sampling import SamplingParams
from engine.planner import HOST_CHECKPOINTS, MIN_DEVICE_CHECKPOINTS, host_checkpoint_count
from engine.types import EngineError, FinishEvent, Request

PC = 16                                                  # prefill chunk (= the runner's block size)
TINY_SEED = 21                                           # the synthetic models' weights (conftest.py: tiny)
SYSTEM = [1 + (7 * j + j * j) % 397 for j in range(70)]  # a shared "system prompt": 70 tokens, 64 shareable
A = SYSTEM + [2 + (5 * j) % 311 for j in range(20)]
B = SYSTEM + [3 + (11 * j) % 293 for j in range(25)]


@pytest.fixture
def short_segments(monkeypatch):
    """Key-center segments of 40 positions (256 in use), so a 95-token prompt spans three: the copied
    prefix (64) ends inside segment 1, whose center its chunks made; segment 2 is the new slot's own."""
    monkeypatch.setattr(SequenceKV, "SEGMENT", 40)
    monkeypatch.setattr(SequenceKV, "SEG_MIN_KEYS", 12)


# ------------------------------------------------------------------------------------------------
# the runner

def _greedy_steps(r: Runner, slot: int, logits: torch.Tensor, pos: int, n: int) -> list[torch.Tensor]:
    out = [logits[-1].clone()]
    for _ in range(n):
        out.append(r.decode([slot], [int(out[-1].argmax())], [pos])[0].clone())
        pos += 1
    return out


CASES = [("llama", "f16", "f16", "checkpoint"), ("llama", "turbo3", "turbo3", "checkpoint"),
         ("qwen35", "f16", "f16", "checkpoint"), ("qwen35", "turbo4", "q8_0", "checkpoint"),
         ("qwen35", "turbo4", "q8_0", "live")]


@pytest.mark.parametrize("arch,kt,vt,state", CASES, ids=["-".join(c) for c in CASES])
def test_copied_prefix_gives_the_cold_numbers(tiny, short_segments, arch, kt, vt, state):
    """Slot 0 holds A (prefilled, then 3 decoded tokens); B shares A's first 70 tokens. Copied into slot 2
    (64 positions: a multiple of the chunk) and continued, B's logits equal B's cold run in slot 1 exactly,
    and so do the key centers; qwen35 takes the states at 64 from a checkpoint, or ("live") from a donor
    whose states are at 64."""
    model = open_model(tiny(arch))
    try:
        r = Runner(model, device="cpu", n_slots=3, max_ctx=128, cache_type_k=kt, cache_type_v=vt)
        r.enable_checkpoints(0 if state == "live" else 8)
        donor = A if state == "checkpoint" else A[:64]
        lg = r.prefill(0, donor, chunk=PC)
        if state == "checkpoint":
            _greedy_steps(r, 0, lg, len(donor), 3)
            assert r.exact_length(0) == 80 and r.exact_length(0, 32) == 0
        cold = _greedy_steps(r, 1, r.prefill(1, B, chunk=PC), len(B), 6)
        m = r.find_prefix(B, {0: donor}, PC)
        assert (m.src, m.n) == (0, 64)
        if arch == "qwen35":
            assert m.state == 0 if state == "live" else m.state[1:] == (64, PC)
            # A's prefill left 16..80, B's cold run refreshed 16..64 (the same prefix) and added its own 80
            assert r.checkpoint_lengths() == ([] if state == "live" else [80, 16, 32, 48, 64, 80])
        r.share_prefix(m, 2)
        for kp in r.kprep.values():                   # segments 0 and 1 reach into the prefix; 2 is left to B
            assert int(kp.ncent[2]) == 2 and not kp.centers[2, 2:].any()
        warm = _greedy_steps(r, 2, r.prefill(2, B[64:], start=64, chunk=PC), len(B), 6)
        for a, b in zip(warm, cold):
            assert torch.equal(a, b)
        for kp in r.kprep.values():
            assert torch.equal(kp.centers[2], kp.centers[1]) and torch.equal(kp.w[2], kp.w[1])
    finally:
        model.close()


def test_checkpoint_lru_and_exact_prefix_rules(tiny):
    """Two checkpoints: the oldest goes first, a restored one counts as used; a prefix whose states are
    neither checkpointed nor live is not shared; a rewritten slot offers only what is still exact."""
    model = open_model(tiny("qwen35"))
    try:
        r = Runner(model, device="cpu", n_slots=3, max_ctx=128)
        r.enable_checkpoints(2)
        assert r.checkpoint_bytes() == 2 * (r.state_bytes() // 3)
        r.prefill(0, A[:48], chunk=PC)                 # checkpoints at 16, 32, 48: 16 is evicted
        assert r.checkpoint_lengths() == [32, 48] and r.checkpoints.evicted == 1
        r.decode([0], [5], [48])                       # slot 0's states move on: only checkpoints serve now
        q = A[:40] + [9] * 30
        m = r.find_prefix(q, {0: A[:49]}, PC)
        assert m.n == 32 and m.state[1] == 32
        r.share_prefix(m, 1)                           # 32 becomes the most recently used
        assert r.checkpoint_lengths() == [48, 32]
        r.prefill(1, q[32:48], start=32, chunk=PC)     # slot 1 continues on the grid: a checkpoint at 48 of q
        assert r.checkpoint_lengths() == [32, 48] and r.checkpoints.evicted == 2
        assert r.find_prefix(A[:20] + [9] * 30, {0: A[:49]}, PC) is None       # 16 was evicted
        assert r.find_prefix(A[:15] + [9] * 30, {0: A[:49]}, PC) is None       # less than a block
        # slot 1 rewritten from 40 (off the grid): its exact prefix is back to 32
        r.prefill(1, [7] * 8, start=40, chunk=PC)
        assert r.exact_length(1) == 32
    finally:
        model.close()


# ------------------------------------------------------------------------------------------------
# the engine

def test_each_prompts_last_checkpoint_outlives_intermediate_ones(tiny):
    """Two 48-token prompts and three checkpoint buffers: a prompt's intermediate checkpoints (superseded by
    its later ones) are evicted before the other prompt's last one, so a follow-up of either (the prompt
    plus new tokens) restores the states at 48; under plain LRU the first prompt's would be gone."""
    model = open_model(tiny("qwen35"))
    try:
        r = Runner(model, device="cpu", n_slots=3, max_ctx=128)
        r.enable_checkpoints(3)
        p0, p1 = A[:48], [4 + (7 * j) % 301 for j in range(48)]
        r.prefill(0, p0, chunk=PC)
        r.prefill(1, p1, chunk=PC)
        assert r.checkpoint_lengths() == [48, 32, 48]
        r.decode([0, 1], [5, 5], [48, 48])            # the live states move on: only checkpoints serve now
        for prompt, slot in ((p0, 0), (p1, 1)):
            m = r.find_prefix(prompt + [9] * 10, {0: p0, 1: p1}, PC)
            assert (m.src, m.n) == (slot, 48) and m.state[1] == 48
    finally:
        model.close()


def test_host_checkpoints_of_a_long_prompt_do_not_evict_others(tiny):
    """Host checkpoints are saved at every fourth chunk end and where a prompt is resumed when it is sent
    again or followed up (prompt_end): a long prompt's earlier ones are still superseded by its later ones
    (not adjacent any more), so with three buffers a short prompt's last checkpoint outlives them and both
    prompts' follow-ups find theirs."""
    model = open_model(tiny("qwen35"))
    try:
        r = Runner(model, device="cpu", n_slots=3, max_ctx=256)
        r.enable_checkpoints(3, host=True)
        short, long = A[:48], [4 + (7 * j) % 301 for j in range(200)]
        r.prefill(0, short, chunk=PC, prompt_end=len(short))
        assert r.checkpoint_lengths() == [32, 48]      # sent again / followed up (16: neither, nor 4k chunks)
        r.prefill(1, long, chunk=PC, prompt_end=len(long))
        assert r.checkpoint_lengths() == [48, 128, 192]   # 64, 128, 192; superseded first: 32, then 64
        r.decode([0, 1], [5, 5], [48, 200])
        for prompt, slot, n in ((short, 0, 48), (long, 1, 192)):
            m = r.find_prefix(prompt + [9] * 10, {0: short, 1: long}, PC)
            assert (m.src, m.n) == (slot, n) and m.state[1] == n
    finally:
        model.close()


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)


def _run(eng, prompt, n=8):
    """(tokens, logprobs, finish event)."""
    ids, lps, fin = [], [], None
    for ev in eng.submit(Request(prompt_ids=prompt, sampling=_greedy(n))):
        if isinstance(ev, FinishEvent):
            fin = ev
        else:
            ids += ev.ids
            lps += ev.logprobs or []
    return ids, lps, fin


def _engine(path, **kw):
    cfg = dict(model=str(path), ctx_size=256, max_seqs=2, prefill_chunk=PC, static_slots=True, state_checkpoints=8)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


def _log_prefill(eng) -> list:
    """Record the engine's runner.prefill calls as (slot, start, tokens)."""
    calls, orig = [], eng.runner.prefill

    def prefill(slot, tokens, start=0, **kw):
        calls.append((slot, start, len(tokens)))
        return orig(slot, tokens, start=start, **kw)
    eng.runner.prefill = prefill
    return calls


ENGINE_CASES = [("llama", "f16"), ("llama", "turbo3"), ("qwen35", "turbo4")]


@pytest.mark.parametrize("arch,kt", ENGINE_CASES, ids=["-".join(c) for c in ENGINE_CASES])
def test_agents_share_a_system_prefix(tiny, short_segments, arch, kt):
    """Agent A finishes (parked); agent B with the same 70-token system prompt gets its first 64 positions
    copied into a free slot (A stays parked for its follow-up) and computes only its last 31 tokens: the
    tokens and logprobs of an engine that shares nothing."""
    warm, cold = _engine(tiny(arch), cache_type_k=kt), _engine(tiny(arch), cache_type_k=kt, resident_tokens=0)
    try:
        answer = _run(warm, A)[0]
        calls = _log_prefill(warm)
        got = _run(warm, B)
        want = _run(cold, B)
        assert got[:2] == want[:2]
        assert got[2].usage.cached_tokens == 64 and want[2].usage.cached_tokens == 0
        assert [c[1:] for c in calls] == [(64, 16), (80, 15)]
        t = warm.stats()["totals"]
        assert t["cached_tokens"] == t["shared_tokens"] == 64 and t["prompt_tokens"] == len(A) + len(B)
        assert len(warm.slots.parked) == 2                          # A still parked beside B
        assert cold.stats()["totals"].get("cached_tokens", 0) == 0
        # A's follow-up still takes its parked slot over
        follow = A + answer + [4, 5, 6]
        assert _run(warm, follow)[2].usage.cached_tokens == len(A) + len(answer) - 1
    finally:
        warm.shutdown()
        cold.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_running_donor_is_not_disturbed(tiny, arch):
    """B is admitted while A is still generating and copies A's prefix (qwen35: states from the checkpoint
    A's prefill left at 64); both give what each gives alone."""
    warm, cold = _engine(tiny(arch)), _engine(tiny(arch), resident_tokens=0)
    try:
        shared, orig = [], warm.runner.share_prefix

        def share_prefix(m, dst):
            shared.append((m.n, any(q.slot == m.src for q in warm._running)))
            return orig(m, dst)
        warm.runner.share_prefix = share_prefix
        ha = warm.submit(Request(prompt_ids=A, sampling=_greedy(120)))
        it = iter(ha)
        first = next(it)                                      # A's prompt is in: it is generating now
        got_b = _run(warm, B)
        rest = list(it)
        got_a = first.ids + [i for ev in rest if not isinstance(ev, FinishEvent) for i in ev.ids]
        assert shared == [(64, True)]
        assert got_b[2].usage.cached_tokens == 64
        assert got_a == _run(cold, A, 120)[0]
        assert got_b[:2] == _run(cold, B)[:2]
    finally:
        warm.shutdown()
        cold.shutdown()


def test_short_prefix_is_not_shared(tiny):
    """A common prefix shorter than a block is neither copied nor a reason to take a parked slot over;
    one block is shared."""
    eng = _engine(tiny("llama"), max_seqs=3)
    try:
        _run(eng, SYSTEM[:15] + [5] * 40)
        calls = _log_prefill(eng)
        assert _run(eng, SYSTEM[:15] + [6] * 40)[2].usage.cached_tokens == 0
        assert calls[0][1] == 0 and len(eng.slots.parked) == 2     # a fresh slot; the first conversation stays parked
        _run(eng, SYSTEM[:16] + [7] * 40)
        assert _run(eng, SYSTEM[:16] + [8] * 40)[2].usage.cached_tokens == 16
    finally:
        eng.shutdown()


def test_cancel_mid_prefill_frees_the_slot(tiny):
    """B shares the prefix and is cancelled after its first own chunk: it finishes "cancelled", every slot
    is free or parked, and the next request runs as on a cold engine."""
    warm, cold = _engine(tiny("qwen35"), step_tokens=PC), _engine(tiny("qwen35"), resident_tokens=0)
    try:
        _run(warm, A)
        calls, orig = [], warm.runner.prefill

        def prefill(slot, tokens, start=0, **kw):
            calls.append(start)
            out = orig(slot, tokens, start=start, **kw)
            for q in warm._running:
                if q.slot == slot:
                    q.handle.cancel()                        # seen before the next step
            return out
        warm.runner.prefill = prefill
        long_b = B + [8 + j % 50 for j in range(60)]
        _, _, fin = _run(warm, long_b)
        warm.runner.prefill = orig
        assert fin.reason == "cancelled" and fin.usage.cached_tokens == 64 and calls == [64]
        assert warm.stats()["running"] == 0 and sorted(warm.slots.free + list(warm.slots.parked)) == [0, 1]
        c = long_b[:90] + [9] * 10                           # continues the cancelled one's 80 positions
        got = _run(warm, c)
        assert got[:2] == _run(cold, c)[:2] and got[2].usage.cached_tokens == 80
    finally:
        warm.shutdown()
        cold.shutdown()


def test_checkpoint_budget(tiny):
    """state_checkpoints: -1 (default) takes at most 2 % of the KV cache, 0 none (then a qwen35 prompt that
    diverges from a parked one within its prompt shares nothing); models without recurrent layers get none."""
    auto = _engine(tiny("qwen35"), state_checkpoints=-1, ctx_size=4096, max_seqs=4)
    try:
        r = auto.runner
        assert 1 <= r.n_checkpoints == int(0.02 * r.kv_bytes()) // state_checkpoint_bytes(auto.model)
        assert r.checkpoint_bytes() <= 0.02 * r.kv_bytes()
    finally:
        auto.shutdown()
    off = _engine(tiny("qwen35"), state_checkpoints=0)
    try:
        _run(off, A, 2)
        assert off.runner.n_checkpoints == 0 and _run(off, B, 2)[2].usage.cached_tokens == 0
    finally:
        off.shutdown()
    llama = _engine(tiny("llama"))
    try:
        assert llama.runner.n_checkpoints == 0 and llama.runner.checkpoint_bytes() == 0
        assert llama.stats()["kv_pool"]["state_checkpoints"] is None
    finally:
        llama.shutdown()


@pytest.mark.parametrize("memory", ["host", "device"])
def test_regenerated_and_reasoning_stripped_turns_resume_from_a_checkpoint(tiny, memory):
    """A chat app's Regenerate sends the same prompt again; Qwen3.5's chat template drops the last reply's
    reasoning from the history of a follow-up. Neither continues the parked conversation's tokens, so a
    recurrent model can only resume at the prompt's last checkpoint (its last chunk end): 80 of A's 90
    tokens, with a cold engine's tokens and logprobs. The checkpoints live where checkpoint_memory says
    ("host": allocated as first used, none on the device, at fewer chunk ends; -1 then means the host's
    default count)."""
    warm = _engine(tiny("qwen35"), state_checkpoints=-1 if memory == "host" else 8, checkpoint_memory=memory)
    cold = _engine(tiny("qwen35"), resident_tokens=0)
    none = _engine(tiny("qwen35"), state_checkpoints=0)
    try:
        r = warm.runner
        assert r.checkpoints_on_host == (memory == "host")
        if memory == "host":
            one = state_checkpoint_bytes(warm.model)
            assert r.n_checkpoints == host_checkpoint_count(one) and r.checkpoint_bytes() == 0
            assert r.checkpoint_bytes(host=True) == 0                 # nothing saved yet, nothing allocated
        answer = _run(warm, A)[0]
        _run(none, A)
        if memory == "host":   # every 4th chunk end and the prompt's last two, each in a buffer made then
            assert r.checkpoint_lengths() == [64, 80]
            assert r.checkpoint_bytes(host=True) == 2 * one
            assert warm.stats()["kv_pool"]["state_checkpoints"] == dict(kept=2, max=r.n_checkpoints, memory="host",
                                                                       bytes=2 * one, evicted=0)
        else:
            assert r.checkpoint_lengths() == [16, 32, 48, 64, 80]
        again = _run(warm, A)
        assert again[:2] == _run(cold, A)[:2] and again[2].usage.cached_tokens == 80
        assert _run(none, A)[2].usage.cached_tokens == 0
        stripped = A + answer[3:] + [4, 5, 6]                          # the reply without its first tokens
        got = _run(warm, stripped)
        assert got[:2] == _run(cold, stripped)[:2] and got[2].usage.cached_tokens == 80
        assert _run(none, stripped)[2].usage.cached_tokens == 0
    finally:
        warm.shutdown()
        cold.shutdown()
        none.shutdown()


def test_checkpoints_go_to_host_memory_when_few_fit_on_the_device(tiny):
    """checkpoint_memory "auto" on a GPU: the default checkpoints stay on the device when the 2 % of the
    KV cache holds at least MIN_DEVICE_CHECKPOINTS of them, else they go to host memory (a 24 GiB card
    with the 27B: none fit); "device", an explicit count, the CPU and models without recurrent layers keep
    them on the device."""
    from engine.runner import slot_bytes_per_token
    eng = _engine(tiny("qwen35"))
    try:
        one = state_checkpoint_bytes(eng.model)
        per_token = slot_bytes_per_token(eng.model)
        enough = -(-MIN_DEVICE_CHECKPOINTS * one // per_token * 50)   # tokens whose 2 % holds MIN of them
        cuda, cpu = torch.device("cuda"), torch.device("cpu")
        fit = RunnerFit(eng.config, eng.model, eng.speculator)
        assert fit.checkpoints_to_host(cuda, enough // 2, one, 0.02)
        assert not fit.checkpoints_to_host(cuda, enough + PC, one, 0.02)
        assert not fit.checkpoints_to_host(cpu, enough // 2, one, 0.02)
        assert not fit.checkpoints_to_host(cuda, enough // 2, one, 0.0)     # (an explicit count)
        fit.config = dataclasses.replace(eng.config, checkpoint_memory="device")
        assert not fit.checkpoints_to_host(cuda, enough // 2, one, 0.02)
    finally:
        eng.shutdown()
    with pytest.raises(EngineError, match="checkpoint_memory"):
        _engine(tiny("qwen35"), checkpoint_memory="disk")
    assert host_checkpoint_count(150 << 20) == min(HOST_CHECKPOINTS, min(4 << 30, physical_memory() // 8)
                                                   // (150 << 20))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_checkpoints_on_the_gpu(tiny):
    """On a GPU, host checkpoints are pinned RAM copied over PCIe: B's shared prefix and A's regenerated
    prompt give the tokens and logprobs of a cold engine, as device checkpoints do."""
    kw = dict(device="cuda", static_slots=False, ctx_pool_tokens=2048, state_checkpoints=8)
    warm = _engine(tiny("qwen35"), checkpoint_memory="host", **kw)
    dev = _engine(tiny("qwen35"), checkpoint_memory="device", **kw)
    cold = _engine(tiny("qwen35"), resident_tokens=0, **kw)
    try:
        assert warm.runner.checkpoints_on_host and not dev.runner.checkpoints_on_host
        for eng in (warm, dev):
            _run(eng, A)
            got_b, again = _run(eng, B), _run(eng, A)
            assert got_b[:2] == _run(cold, B)[:2] and got_b[2].usage.cached_tokens == 64
            assert again[:2] == _run(cold, A)[:2] and again[2].usage.cached_tokens == 80
        bufs = warm.runner.checkpoints.buffers
        assert bufs and all(t.is_pinned() for conv, ssm in bufs for d in (conv, ssm) for t in d.values())
        held = warm.runner.checkpoint_bytes(host=True)
        stats = getattr(torch.cuda, "host_memory_stats", None)    # (the closed runner's pinned memory: given back)
        before = stats().get("allocated_bytes.current") if stats is not None else None
        del bufs
        warm.shutdown()
        if before is not None:
            assert stats()["allocated_bytes.current"] <= before - held
    finally:
        for eng in (warm, dev, cold):
            eng.shutdown()
