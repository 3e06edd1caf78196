"""`hivejet bench spec`: speculative decoding on a code-edit workload, and the modelled speedup.

Measured: the prompt holds a source file and asks for it back with one small change (what an agent's
edit looks like); greedy decoding of n tokens with each drafting mode (off, ngram, and mtp when the model
has the block; dflash and dflash+ngram when given a DFlash drafter): steps, accepted tokens per step,
tok/s, and whether the output equals spec=off.

Verify cost (--verify-rows, for the GPU machine): the time of one decode step that verifies k drafts for
each of 1, 4 and 16 sequences (1 + k rows per sequence, up to 64 rows, as the GPU path runs them:
Runner.decode with rows of one slot, then Runner.cut_back), against a step of one row per sequence, at
position 256.

MTP drafting cost (--verify-rows, a model with the MTP block): the time the block takes after a step
whose k drafts were all accepted (its rows of the fed token and the k drafts in one pass, then k - 1
chained passes of one row per sequence, each with the LM head), for 1, 4 and 16 sequences at once, as the
GPU path runs it (engine/runner/mtp.py over the runner's slots, on Runner.hidden), and the speedup at the
published MTP acceptance with that cost and the measured (k+1)-row step: tokens per step / ((step of k+1
rows + MTP) / step of one row).

Modelled (with --rows-json, a `hivejet bench decode` result): a step verifying k drafts costs what a
(k+1)-row step costs in that table, so speedup = tokens per step / (cost of k+1 rows / cost of 1 row),
at the acceptance rates published for DFlash (Qwen3-8B, code, temperature 0: about 6.5 tokens per step
with blocks of 16) and MTP (about 73 % per draft with 3 drafts); drafting time not counted.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

EDIT_FILE = Path(__file__).resolve().parents[1] / "prefix.py"


WARMUP_FILE = Path(__file__).resolve().parents[1] / "pacing.py"   # (another file: the n-gram pool learns nothing)


def _prompt(path: Path = EDIT_FILE, old: str = "common_prefix", new: str = "shared_prefix") -> list[dict]:
    code = path.read_text()[:1500]
    return [{"role": "user", "content": "Here is a file:\n```python\n" + code + "\n```\nRewrite it exactly, but "
             f"rename `{old}` to `{new}`. Output only the code."}]


def measure(model: str, n_tokens: int = 120, device: str = "cpu", modes=("off", "ngram", "mtp"),
            drafter: str | None = None) -> list[dict]:
    from engine.engine import Engine, EngineConfig
    from engine.sampling import SamplingParams
    from engine.types import EngineError, Request
    rows, base = [], None
    if drafter:
        modes = tuple(modes) + tuple(m for m in ("dflash", "dflash+ngram") if m not in modes)
    for mode in modes:
        try:   # a DFlash block drafts 15 tokens: let the adaptive draft length reach them
            eng = Engine(EngineConfig(model=model, device=device, spec=mode, ctx_size=4096, resident_tokens=0,
                                      spec_drafter=drafter, spec_max_drafts=15 if "dflash" in mode else 8))
        except EngineError as e:
            rows.append(dict(spec=mode, error=str(e)))
            continue
        try:   # a short untimed request first: kernels compiled for the drafter's shapes are not timed
            # (resident_tokens=0: the timed request computes its whole prompt again)
            eng.submit(Request(messages=_prompt(WARMUP_FILE, "PrefillPacer", "ChunkPacer"),
                               sampling=SamplingParams(max_tokens=16, temperature=0.0))).result()
            before = dict(eng.stats()["totals"])
            t0 = time.perf_counter()
            _, ids, _ = eng.submit(Request(messages=_prompt(), sampling=SamplingParams(max_tokens=n_tokens,
                                                                                        temperature=0.0))).result()
            secs = time.perf_counter() - t0
            tot = {k: v - before.get(k, 0) for k, v in eng.stats()["totals"].items()}
        finally:
            eng.shutdown()   # (frees its device memory: the next mode's engine sizes its KV pool to what is free)
        if base is None:
            base = ids
        steps = tot["steps"]
        rows.append(dict(spec=mode, tokens=len(ids), steps=steps, seconds=secs, tok_s=len(ids) / secs,
                         tokens_per_step=len(ids) / steps, drafted=tot.get("drafted_tokens", 0),
                         accepted=tot.get("accepted_tokens", 0), same_as_off=ids == base))
    return rows


MTP_ACCEPTANCE = 0.73   # published per-draft acceptance of Qwen3.5's MTP block with 3 drafts


def verify_costs(model: str, device: str = "cuda", drafts=(0, 3, 4, 8, 15), seqs=(1, 4, 16), pos: int = 256,
                 reps: int = 10, max_rows: int = 64) -> list[dict]:
    """ms of a decode step with 1 + k rows for each of `seqs` sequences at position `pos`, up to max_rows rows
    (the largest decode graph; a step of more runs eagerly) (all drafts
    rejected and cut back after every step, so each step starts from the same state), and its cost
    against the k = 0 step of as many sequences. Each step keeps its fed tokens and rejects every draft
    (cut back, a recurrent model's commit of one row included); positions stay the same step after step."""
    import torch

    from engine.models import open_model
    from engine.runner import Runner
    m = open_model(model)
    try:
        r = Runner(m, device=device, n_slots=max(seqs), max_ctx=pos + max(drafts) + 16)
        for sl in range(max(seqs)):
            r.prefill(sl, [1 + (7 * j) % 100 for j in range(pos)])
        out = []
        for n in seqs:
            base = None
            for k in drafts:
                if n * (1 + k) > max_rows:
                    continue
                slots = [sl for sl in range(n) for _ in range(1 + k)]
                positions = [pos + i for _ in range(n) for i in range(1 + k)]
                toks = [2] * len(slots)

                def step():
                    r.decode(slots, toks, positions)
                    for sl in range(n):
                        r.cut_back(sl, pos + 1)
                step()
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    step()
                if device != "cpu":
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) / reps * 1e3
                base = base or ms
                out.append(dict(seqs=n, drafts=k, rows=len(slots), ms=ms, vs_no_drafts=ms / base))
        return out
    finally:
        m.close()


def mtp_costs(model: str, device: str = "cuda", drafts=(1, 2, 3, 4), seqs=(1, 4, 16), pos: int = 256,
              reps: int = 10) -> list[dict]:
    """ms the MTP block takes after a step whose k drafts were all accepted (k + 1 rows written, k - 1 chained
    drafts), for n sequences at once (slots of one runner, engine/runner/mtp.py as the GPU path runs it), on the
    runner's output-normed hidden rows, for each k and n; [] without the block."""
    import torch

    from engine.models import open_model
    from engine.planner import mtp_cache_type
    from engine.runner import Runner
    from engine.runner.mtp import MtpSlots
    from engine.spec.mtp import CatchUp, MtpState, catch_up
    m = open_model(model)
    try:
        if getattr(m, "mtp", None) is None:
            return []
        dev = torch.device(device)
        r = Runner(m, device=dev, n_slots=max(seqs), max_ctx=pos + 2 * max(drafts) + 16)
        block = MtpSlots(r, mtp_cache_type(r.cache_type_k, r.cache_type_v))
        block.warm_up()
        toks = [1 + (7 * j) % 100 for j in range(pos + max(drafts) + 2)]
        for slot in range(max(seqs)):
            r.prefill(slot, toks[:pos + max(drafts) + 1], hidden=True)
        hid = r.hidden.clone()
        states = [MtpState(None, slot=i) for i in range(max(seqs))]
        catch_up(block, [CatchUp(st, toks[:pos + 1], 0, hid[:pos], pos, 0) for st in states])   # rows 0..pos
        out = []
        for n in seqs:
            for k in drafts:
                def step():
                    for st in states[:n]:
                        st.valid = pos + 1                     # (the same rows again each time)
                    catch_up(block, [CatchUp(st, toks[:pos + k + 2], pos, hid[pos:pos + k + 1], k + 1, k)
                                     for st in states[:n]])
                ms = _time_ms(step, dev, reps)
                out.append(dict(seqs=n, drafts=k, rows=n * (k + 1), ms=ms, ms_per_draft=ms / k))
        block.close()
        r.close()
        return out
    finally:
        m.close()


DFLASH_TOKENS_PER_STEP = 6.5   # published for DFlash on Qwen3-8B, code, temperature 0, blocks of 16


def dflash_costs(model: str, device: str = "cuda", drafter: str | None = None, pos: int = 256, reps: int = 10,
                 drafts=(15,)) -> list[dict]:
    """ms a DFlash drafter takes after a step whose k drafts were all accepted: k + 1 rows into its context,
    then one block of block_size rows and the LM head on its k drafts (`drafter`: a real one; default a
    random drafter of 5 Qwen3-style layers, 32 heads of 128, n_ff 3 x n_embd, on the target's layers)."""
    import torch

    from engine.models import open_model
    from engine.runner import Runner
    from engine.sampling import Sampler, SamplingParams
    from engine.spec.dflash import DFlashConfig, DFlashDrafter, DraftRequest, load_drafter, propose
    from engine.tools.synth_dflash import synthetic_drafter
    m = open_model(model)
    try:
        if drafter:
            d = load_drafter(drafter)
        else:
            config, tensors = synthetic_drafter(model, n_layer=5, derived=False, n_head=32, head_dim=128,
                                                n_ff=3 * m.spec.n_embd)
            d = DFlashDrafter(DFlashConfig.from_hf(config, "synthetic"), tensors, "synthetic")
            del tensors
        d.check_target(m)
        m.capture_layers = d.cfg.target_layer_ids
        dev = torch.device(device)
        r = Runner(m, device=dev, n_slots=1, max_ctx=pos + max(drafts) + 16)
        d.to_device(dev)
        toks = [1 + (7 * j) % 100 for j in range(pos + max(drafts) + 2)]
        r.prefill(0, toks[:pos + max(drafts) + 1], hidden=True)
        feats = r.features.clone()
        st = d.new_state()
        d.extend([(st, feats[:pos])])
        sampler = Sampler(SamplingParams(temperature=0.0), m.spec.vocab_size)
        out = []
        for k in drafts:
            def step():
                st.length = pos
                for rows in st.keys + st.values:
                    rows.n = pos
                d.extend([(st, feats[pos:pos + k + 1])])
                propose(d, m, [DraftRequest(st, toks[pos + k + 1], k, sampler, toks[:pos + k + 2])])
            out.append(dict(drafts=k, ms=_time_ms(step, dev, reps), weight_gb=d.weight_bytes() / 1e9,
                            layers=d.cfg.n_layer))
        return out
    finally:
        m.close()


def _time_ms(step, dev, reps: int) -> float:
    """ms per call of step() (after one untimed call), the device's work included."""
    import torch

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()
    step()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def _speedup(verify: list[dict], costs: list[dict], k: int, tokens: float) -> dict | None:
    """One sequence's speedup with k drafts giving `tokens` per step: tokens x the one-row step over the
    (k+1)-row step plus the drafter's measured work (costs: {drafts, ms})."""
    base = next((v["ms"] for v in verify if v["seqs"] == 1 and v["drafts"] == 0), None)
    step = next((v["ms"] for v in verify if v["seqs"] == 1 and v["drafts"] == k), None)
    draft = next((c["ms"] for c in costs if c["drafts"] == k), None)
    if None in (base, step, draft):
        return None
    return dict(drafts=k, tokens_per_step=tokens, step_ms=step, drafter_ms=draft, one_row_ms=base,
                speedup=tokens * base / (step + draft))


def dflash_speedup(verify: list[dict], costs: list[dict], k: int = 15,
                   tokens: float = DFLASH_TOKENS_PER_STEP) -> dict | None:
    """The single-sequence speedup of DFlash at the published tokens per step, from measured costs."""
    return _speedup(verify, costs, k, tokens)


def mtp_speedup(verify: list[dict], mtp: list[dict], k: int = 3, alpha: float = MTP_ACCEPTANCE) -> dict | None:
    """The single-sequence speedup of MTP drafting at acceptance alpha with k drafts, from measured costs:
    a step of k + 1 rows plus the MTP block's work, against a one-row step."""
    u = _speedup(verify, mtp, k, sum(alpha ** i for i in range(k + 1)))
    return None if u is None else dict(u, acceptance=alpha)


def modelled(rows_table: list[dict]) -> list[dict]:
    cost = {r["rows"]: r["ms"] / rows_table[0]["ms"] for r in rows_table}

    def step_cost(n_rows):
        k = min((r for r in cost if r >= n_rows), default=max(cost))
        return cost[k]
    out = []
    for name, drafts, tokens_per_step in (("DFlash (published: ~6.5 tokens/step, blocks of 16)", 15, 6.5),
                                          ("MTP (published: ~73 % per draft, 3 drafts)", 3,
                                           sum(0.73 ** i for i in range(4)))):
        c = step_cost(drafts + 1)
        out.append(dict(drafter=name, rows=drafts + 1, step_cost=c, tokens_per_step=tokens_per_step,
                        speedup=tokens_per_step / c))
    return out


def _device(device: str) -> str:
    """auto: the GPU when torch sees one, else the CPU (the step-cost measurements take a concrete device)."""
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args) -> dict:
    res = dict(date=time.strftime("%Y-%m-%d %H:%M"), model=args.model, measured=[], modelled=[])
    if args.model:
        res["measured"] = measure(args.model, args.n_gen, args.device, drafter=getattr(args, "spec_drafter", None))
    if args.rows_json:
        res["modelled"] = modelled(json.loads(Path(args.rows_json).read_text())["rows"])
    if getattr(args, "verify_rows", False):
        dev = _device(args.device)
        res["verify"] = verify_costs(args.model, dev)
        for r in res["verify"]:
            print(f"verify: {r['seqs']} sequence(s) x {r['drafts']:2d} drafts = {r['rows']:3d} rows: "
                  f"{r['ms']:8.2f} ms/step, {r['vs_no_drafts']:.2f}x the step without drafts")
        res["mtp_costs"] = mtp_costs(args.model, dev)
        for c in res["mtp_costs"]:
            print(f"MTP block, {c['seqs']:2d} sequence(s) after {c['drafts']} accepted drafts ({c['rows']} rows, "
                  f"{c['drafts'] - 1} chained): {c['ms']:.2f} ms, {c['ms_per_draft']:.2f} ms per draft")
        res["dflash_costs"] = dflash_costs(args.model, dev, getattr(args, "spec_drafter", None))
        for c in res["dflash_costs"]:
            print(f"DFlash drafter ({c['layers']} layers, {c['weight_gb']:.2f} GB) after {c['drafts']} accepted "
                  f"drafts: {c['ms']:.2f} ms")
        res["dflash_speedup"] = u = dflash_speedup(res["verify"], res["dflash_costs"])
        if u:
            print(f"DFlash at {u['tokens_per_step']} tokens per step: {u['step_ms']:.2f} + {u['drafter_ms']:.2f} ms "
                  f"against {u['one_row_ms']:.2f} ms per token: {u['speedup']:.2f}x")
        res["mtp_speedup"] = mtp_speedup(res["verify"], res["mtp_costs"])
        if res["mtp_speedup"]:
            u = res["mtp_speedup"]
            print(f"MTP at {u['acceptance']:.0%} per draft, {u['drafts']} drafts: {u['tokens_per_step']:.2f} tokens "
                  f"per {u['step_ms']:.2f} + {u['drafter_ms']:.2f} ms against {u['one_row_ms']:.2f} ms per token: "
                  f"{u['speedup']:.2f}x")
    for r in res["measured"]:
        if "error" in r:
            print(f"{r['spec']:12s} not run: {r['error']}")
        else:
            print(f"{r['spec']:12s} {r['tokens']:4d} tokens in {r['steps']:4d} steps ({r['tokens_per_step']:.2f}/step), "
                  f"{r['tok_s']:6.2f} tok/s, drafts {r['accepted']}/{r['drafted']} accepted, "
                  f"same output as off: {r['same_as_off']}")
    for r in res["modelled"]:
        print(f"{r['drafter']}: a {r['rows']}-row step costs {r['step_cost']:.2f}x a 1-row step -> "
              f"{r['tokens_per_step']:.2f} tokens/step = {r['speedup']:.2f}x")
    return res
