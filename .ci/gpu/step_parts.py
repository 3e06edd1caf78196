"""Where a drafting step's time goes: the controlled-acceptance run (hivejet bench spec --accept 0.92,0.80,0.65,
no-adaptive lengths) with wall-clock timers around the runner step's parts, for 1 and 4 agents, each run twice on
one engine (the second under cProfile). usage: python3 .ci/gpu/step_parts.py MODEL [--adaptive] [AGENTS...]"""
import collections
import cProfile
import io
import pstats
import sys
import time
import random


import engine.step_runner as SR
import engine.spec.speculator as SP
import engine.scheduler as SC
import engine.engine as E
import engine.runner.runner as RR
import engine.runner.mtp as RM
import engine.spec.mtp as SM
from engine.tools import bench_spec_accept as B
from engine.spec.controlled import ControlledAcceptance

acc = collections.defaultdict(float)
cnt = collections.Counter()


def wrap(owner, name, label=None):
    f = getattr(owner, name)
    label = label or f"{owner.__name__}.{name}"

    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0
            cnt[label] += 1
    setattr(owner, name, g)


for owner, name in [(SR.RunnerExecutor, "_step"), (SR.RunnerExecutor, "_launch_decode"),
                    (SR.RunnerExecutor, "complete"), (SR.RunnerStep, "read"), (SR.RunnerStep, "send"),
                    (SR.RunnerExecutor, "_verify_on_device"), (SR.RunnerExecutor, "_decode_inputs"),
                    (SC.Scheduler, "schedule"), (SP.Speculator, "verify_chosen"), (SP.Speculator, "_accepted"),
                    (SP.Speculator, "adapt_draft_lengths"), (SP.Speculator, "mtp_rows_catch_up"),
                    (SP.Speculator, "take_drafts"), (SP.Speculator, "drafts_next"),
                    (RR.Runner, "cut_back"), (RR.Runner, "decode"), (RR.Runner, "truncate"),
                    (RM.MtpSlots, "run_slots"), (RM.MtpSlots, "room"), (RM.MtpSlots, "done"),
                    (E.Engine, "_append_token"), (ControlledAcceptance, "replace")]:
    wrap(owner, name)
_orig_catch = SM.catch_up


def catch_up(*a, **k):
    t0 = time.perf_counter()
    try:
        return _orig_catch(*a, **k)
    finally:
        acc["spec.mtp.catch_up"] += time.perf_counter() - t0
        cnt["spec.mtp.catch_up"] += 1


SP.catch_up = catch_up


def report(title, steps):
    print(f"--- {title}: {steps} steps")
    for k in sorted(acc, key=lambda k: -acc[k]):
        print(f"  {k:40s} {1000 * acc[k] / max(1, steps):8.3f} ms/step  {cnt[k] / max(1, steps):6.2f} calls/step")


def main():
    model = sys.argv[1]
    adaptive = "--adaptive" in sys.argv
    agents = [int(a) for a in sys.argv[2:] if a.isdigit()] or [1, 4]
    rates = [0.92, 0.80, 0.65]
    prompt_len, n_gen = 32, 128
    ctx = prompt_len + n_gen + 64
    rng = random.Random(0)
    eng = B._engine(model, "cuda", "off", None, max(agents), ctx, 0, prompt_len)
    vocab = eng.spec.vocab_size
    prompts = {n: B._prompts(n, prompt_len, vocab, rng) for n in agents}
    off = {}
    for n in agents:
        acc.clear(); cnt.clear()
        off[n] = B._run(eng, prompts[n], n_gen)
        print(f"off {n} agents: {off[n]['tok_s']:.1f} tok/s, {off[n]['steps']} steps")
        report(f"off {n}", off[n]["steps"])
    eng.shutdown()
    eng = B._engine(model, "cuda", "mtp", None, max(agents), ctx, len(rates), prompt_len, adaptive)
    for n in agents:
        truth = [p + o for p, o in zip(prompts[n], off[n]["outs"])]
        for prof in (False, True):
            eng.speculator.control = ControlledAcceptance(rates, truth, vocab, seed=n)
            acc.clear(); cnt.clear()
            p = cProfile.Profile() if prof else None
            if p:
                # (the steps run on the engine thread: profiled there)
                f = SR.RunnerExecutor.step
                def step(self, f=f):
                    p.enable()
                    try:
                        return f(self)
                    finally:
                        p.disable()
                SR.RunnerExecutor.step = step
            r = B._run(eng, prompts[n], n_gen)
            if p:
                SR.RunnerExecutor.step = f
            print(f"controlled {n} agents{' (cProfile)' if prof else ''}: {r['tok_s']:.1f} tok/s, "
                  f"{r['tokens_per_step']:.2f} tokens/step, {r['steps']} steps, same={r['outs'] == off[n]['outs']}")
            report(f"controlled {n}", r["steps"])
            if p and r["steps"]:
                for key in ("tottime", "cumtime"):
                    s = io.StringIO()
                    pstats.Stats(p, stream=s).sort_stats(key).print_stats(45)
                    print(s.getvalue()[-12000:])
    eng.shutdown()


main()
