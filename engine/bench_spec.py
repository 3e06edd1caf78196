"""`hivejet bench spec`: speculative decoding on a code-edit workload, and the modelled speedup.

Measured: the prompt holds a source file and asks for it back with one small change (what an agent's
edit looks like); greedy decoding of n tokens with each drafting mode (off, ngram, and mtp when the model
has the block; dflash and dflash+ngram when given a DFlash drafter): steps, accepted tokens per step,
tok/s, and whether the output equals spec=off.

Verify cost (--verify-rows, for the GPU machine): the time of one decode step that verifies k drafts for
each of 1 and 4 sequences (1 + k rows per sequence, as the GPU path runs them: Runner.decode with rows of
one slot, then Runner.cut_back), against a step of one row per sequence, at position 256.

Modelled (with --rows-json, a `hivejet bench decode` result): a step verifying k drafts costs what a
(k+1)-row step costs in that table, so speedup = tokens per step / (cost of k+1 rows / cost of 1 row),
at the acceptance rates published for DFlash (Qwen3-8B, code, temperature 0: about 6.5 tokens per step
with blocks of 16) and MTP (about 73 % per draft with 3 drafts).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

EDIT_FILE = Path(__file__).resolve().parent / "prefix.py"


def _prompt() -> list[dict]:
    code = EDIT_FILE.read_text()[:1500]
    return [{"role": "user", "content": "Here is a file:\n```python\n" + code + "\n```\nRewrite it exactly, but "
             "rename `common_prefix` to `shared_prefix`. Output only the code."}]


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
        try:
            t0 = time.perf_counter()
            _, ids, _ = eng.submit(Request(messages=_prompt(), sampling=SamplingParams(max_tokens=n_tokens,
                                                                                        temperature=0.0))).result()
            secs = time.perf_counter() - t0
            tot = eng.stats()["totals"]
        finally:
            eng.shutdown()   # (frees its device memory: the next mode's engine sizes its KV pool to what is free)
        if base is None:
            base = ids
        steps = tot["steps"]
        rows.append(dict(spec=mode, tokens=len(ids), steps=steps, seconds=secs, tok_s=len(ids) / secs,
                         tokens_per_step=len(ids) / steps, drafted=tot.get("drafted_tokens", 0),
                         accepted=tot.get("accepted_tokens", 0), same_as_off=ids == base))
    return rows


def verify_costs(model: str, device: str = "cuda", drafts=(0, 4, 8, 16), seqs=(1, 4), pos: int = 256,
                 reps: int = 10) -> list[dict]:
    """ms of a decode step with 1 + k rows for each of `seqs` sequences at position `pos` (all drafts
    rejected and cut back after every step, so each step starts from the same state), and its cost
    against the k = 0 step of as many sequences. Recurrent models run the delta-rule step in waves."""
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
                slots = [sl for sl in range(n) for _ in range(1 + k)]
                positions = [pos + i for _ in range(n) for i in range(1 + k)]
                toks = [2] * len(slots)

                def step():
                    r.decode(slots, toks, positions)
                    for sl in range(n):
                        r.cut_back(sl, pos)
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


def run(args) -> dict:
    res = dict(date=time.strftime("%Y-%m-%d %H:%M"), model=args.model, measured=[], modelled=[])
    if args.model:
        res["measured"] = measure(args.model, args.n_gen, args.device, drafter=getattr(args, "spec_drafter", None))
    if args.rows_json:
        res["modelled"] = modelled(json.loads(Path(args.rows_json).read_text())["rows"])
    if getattr(args, "verify_rows", False):
        res["verify"] = verify_costs(args.model, args.device if args.device != "auto" else "cuda")
        for r in res["verify"]:
            print(f"verify: {r['seqs']} sequence(s) x {r['drafts']:2d} drafts = {r['rows']:3d} rows: "
                  f"{r['ms']:8.2f} ms/step, {r['vs_no_drafts']:.2f}x the step without drafts")
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
