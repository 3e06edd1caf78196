"""`hivejet bench spec --accept RATES`: speculative decoding's speed at a controlled acceptance, for 1, 4, 8
and 16 agents decoding together.

Synthetic weights give drafters whose drafts the target never accepts, so speed at a realistic acceptance
cannot be measured with them directly. Here the drafter (the model's MTP block, or a DFlash drafter with
--spec-drafter) runs in full, its cost real, and each of its proposals is then replaced, position by
position, by the target's own next token with the given probability and by a token the target rejects
otherwise (engine/spec/controlled.py). The target's continuation comes from a plain run of the same
prompts first (greedy). For each number of agents:
  off            drafts off: total and per-agent tok/s (the baseline);
  controlled     drafts at the given acceptance: tokens per step, tok/s, speed-up against off, and whether
                 the output equals off's (verification stays exact whatever the drafts are);
  uncontrolled   the drafter's own drafts (random weights: almost none accepted): its cost against off.
Draft lengths are the engine's own, at most one per rate (spec_max_drafts = len(rates)): adaptive as a user's
requests get them (the drafter backs off where its measured cost does not pay), or with --no-adaptive from
acceptance alone (EngineConfig.spec_adaptive=False). Prompts are random token ids (speed does not depend on them).
"""
from __future__ import annotations

import random
import time

from engine.spec.controlled import ControlledAcceptance


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, min(vocab, 32000)) for _ in range(length)] for _ in range(n)]


def _run(eng, prompts: list[list[int]], n_gen: int) -> dict:
    """The prompts submitted together, greedy, n_gen tokens each (no early end): outputs and speed."""
    from engine.sampling import SamplingParams
    from engine.types import Request
    before = dict(eng.stats()["totals"])
    greedy = SamplingParams(max_tokens=n_gen, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    handles = [eng.submit(Request(prompt_ids=p, sampling=greedy)) for p in prompts]
    outs = [h.result()[1] for h in handles]
    secs = time.perf_counter() - t0
    tot = {k: v - before.get(k, 0) for k, v in eng.stats()["totals"].items()}
    tokens = sum(len(o) for o in outs)
    steps = max(1, tot.get("steps", 0))
    return dict(outs=outs, seconds=secs, tokens=tokens, tok_s=tokens / secs, per_agent=tokens / secs / len(prompts),
                steps=steps, tokens_per_step=tokens / (steps * len(prompts)),
                drafted=tot.get("drafted_tokens", 0), accepted=tot.get("accepted_tokens", 0))


def _engine(model: str, device: str, spec: str, drafter: str | None, max_seqs: int, ctx: int, k: int,
            prompt_len: int, adaptive: bool = True):
    from engine.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=model, device=device, spec=spec, spec_drafter=drafter, spec_max_drafts=max(1, k),
                              max_seqs=max_seqs, ctx_size=ctx, resident_tokens=0, spec_adaptive=adaptive))
    # (kernels compiled for this engine's shapes, first drafts made: not timed)
    _run(eng, [[5 + i % 50 for i in range(prompt_len)] for _ in range(2)], 16)
    return eng


def bench_accept(model: str, rates: list[float], agents=(1, 4, 8, 16), n_gen: int = 128, device: str = "auto",
                 drafter: str | None = None, prompt_len: int = 32, seed: int = 0, adaptive: bool = True,
                 log=print) -> dict:
    """The three runs (module docstring) for each number of agents; returns the results (no token lists)."""
    spec = "dflash" if drafter else "mtp"
    ctx = prompt_len + n_gen + 64
    rng = random.Random(seed)
    eng = _engine(model, device, "off", None, max(agents), ctx, 0, prompt_len)
    vocab = eng.spec.vocab_size
    prompts = {n: _prompts(n, prompt_len, vocab, rng) for n in agents}
    try:
        off = {n: _run(eng, prompts[n], n_gen) for n in agents}
        dev = eng.stats()["device"]
    finally:
        eng.shutdown()
    res = dict(model=model, device=dev, drafter=spec, rates=list(rates), adaptive=adaptive, n_gen=n_gen,
               prompt_len=prompt_len,
               acceptance="controlled: each draft replaced by the target's own next token with the given "
                          "probability per position, else by a token the target rejects; the drafter runs in full",
               runs=[])
    log(header(res))
    eng = _engine(model, device, spec, drafter, max(agents), ctx, len(rates), prompt_len, adaptive)
    try:
        for n in agents:
            truth = [p + o for p, o in zip(prompts[n], off[n]["outs"])]
            eng.speculator.control = control = ControlledAcceptance(rates, truth, vocab, seed=seed + n)
            ctl = _run(eng, prompts[n], n_gen)
            eng.speculator.control = None
            raw = _run(eng, prompts[n], n_gen)
            row = dict(agents=n, off=_public(off[n]), controlled=_public(ctl), uncontrolled=_public(raw),
                       same_as_off=ctl["outs"] == off[n]["outs"] and raw["outs"] == off[n]["outs"],
                       replaced=control.replaced, replaced_by_target=control.by_truth,
                       speedup=ctl["tok_s"] / off[n]["tok_s"], uncontrolled_cost=1 - raw["tok_s"] / off[n]["tok_s"])
            res["runs"].append(row)
            log(format_row(row))
    finally:
        eng.shutdown()
    return res


def _public(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "outs"}


def format_row(r: dict) -> str:
    c, o, u = r["controlled"], r["off"], r["uncontrolled"]
    return (f"{r['agents']:2d} agents: off {o['tok_s']:8.1f} tok/s ({o['per_agent']:.1f} each) | controlled "
            f"{c['tok_s']:8.1f} tok/s ({c['per_agent']:.1f} each, {c['tokens_per_step']:.2f} tokens/step, "
            f"{c['accepted']}/{c['drafted']} accepted) {r['speedup']:.2f}x | uncontrolled {u['tok_s']:8.1f} tok/s "
            f"({100 * r['uncontrolled_cost']:+.1f} % cost) | same output as off: {r['same_as_off']}")


def header(res: dict) -> str:
    return (f"hivejet bench spec --accept {','.join(f'{r:g}' for r in res['rates'])}: {res['drafter']} drafts on "
            f"{res['device']}, {res['n_gen']} tokens per agent after {res['prompt_len']}-token prompts, "
            f"{'adaptive' if res['adaptive'] else 'acceptance-driven'} draft lengths\n"
            f"acceptance was {res['acceptance']}")
