"""On the GPU machine: where a drafting mode's time goes on the GPU path, for a drafter that is never
accepted (the synthetic 27B's random MTP block): the code-edit request of `bench spec` (after an untimed
one), spec off and mtp twice each; prints per run the first token's time, tok/s after it, the scheduler's
host milliseconds per method, the step totals (overlapped steps) and the measured step costs by rows.
    python3 -u .ci/gpu/spec_host.py /tmp/m27mtp.gguf [device]"""
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import engine.engine as ee  # noqa: E402
from engine.bench_spec import WARMUP_FILE, _prompt  # noqa: E402
from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.types import Request, TokenEvent  # noqa: E402

host = collections.Counter()
for name in ("_runner_step", "_launch_decode", "_complete_runner", "_mtp_rows_catch_up", "_adapt_draft_lengths",
             "_plan_runner", "_make_room", "_verify_drafts"):
    def timed(self, *a, _f=getattr(ee.Engine, name), _n=name, **k):
        t = time.perf_counter()
        try:
            return _f(self, *a, **k)
        finally:
            host[_n] += time.perf_counter() - t
    setattr(ee.Engine, name, timed)

model, device = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda"
for mode in ("off", "mtp", "off", "mtp"):
    eng = Engine(EngineConfig(model=model, device=device, spec=mode, ctx_size=4096, resident_tokens=0,
                              static_slots=True))
    eng.submit(Request(messages=_prompt(WARMUP_FILE, "PrefillPacer", "ChunkPacer"),
                       sampling=SamplingParams(max_tokens=16, temperature=0.0))).result()
    before = dict(eng.stats()["totals"])
    host.clear()
    t0 = time.perf_counter()
    h = eng.submit(Request(messages=_prompt(), sampling=SamplingParams(max_tokens=128, temperature=0.0)))
    t1, n = None, 0
    for ev in h:
        if isinstance(ev, TokenEvent):
            n += len(ev.ids)
            t1 = t1 or time.perf_counter()
    t2 = time.perf_counter()
    totals = {k: v - before.get(k, 0) for k, v in eng.stats()["totals"].items()}
    costs = eng.stats()["spec"].get("costs")
    eng.shutdown()
    print(json.dumps(dict(mode=mode, first_token_s=round(t1 - t0, 3), decode_tok_s=round((n - 1) / (t2 - t1), 2),
                          host_ms={k: round(v * 1e3, 1) for k, v in host.items()}, totals=totals, costs=costs)),
          flush=True)
