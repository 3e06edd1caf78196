"""Where a decode step's wall time goes inside its CUDA graph: one replay of the 1-row (and 16-row) graph
under torch.profiler, every kernel's start and duration from the trace. Prints the step's span, the
kernels' busy time per kernel name, and the idle time between kernels (gaps) by the kind of kernel that
follows, so launch latency and small-kernel costs show beside the matmuls.

    python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf [--rows 1 16] [--json OUT] [--sequence N]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from engine.tools.bench_decode import ready_rows
from engine.models import open_model
from engine.runner import Runner


def _short(name: str) -> str:
    if name.startswith("void at::native::"):
        return "torch:" + name[len("void at::native::"):].split("<")[0]
    return name.split("(")[0][:60]


def replay_trace(runner, B: int, pos: int = 256) -> list[dict]:
    """Kernel events (name, ts, dur in us) of one replay of the B-row graph."""
    from torch.profiler import ProfilerActivity, profile
    graph = ready_rows(runner, B, pos)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    os.unlink(path)
    ks = [dict(name=_short(e["name"]), full=e["name"][:240], ts=float(e["ts"]), dur=float(e["dur"]))
          for e in ev if e.get("cat") == "kernel"]
    return sorted(ks, key=lambda k: k["ts"])


def summarize(ks: list[dict]) -> dict:
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    busy, gaps, count = {}, {}, {}
    for i, k in enumerate(ks):
        busy[k["name"]] = busy.get(k["name"], 0.0) + k["dur"]
        count[k["name"]] = count.get(k["name"], 0) + 1
        if i:
            prev_end = ks[i - 1]["ts"] + ks[i - 1]["dur"]
            gaps[k["name"]] = gaps.get(k["name"], 0.0) + max(0.0, k["ts"] - prev_end)
    names = sorted(busy, key=lambda n: -busy[n])
    return dict(kernels=len(ks), span_us=span, busy_us=sum(busy.values()), gap_us=sum(gaps.values()),
                per_name=[dict(name=n, calls=count[n], busy_us=busy[n], gap_before_us=gaps.get(n, 0.0))
                          for n in names])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--json")
    ap.add_argument("--sequence", type=int, default=0,
                    help="also keep the first N kernels of each replay in order (full names, durations)")
    a = ap.parse_args()
    model = open_model(a.model)
    runner = Runner(model, device="cuda", n_slots=max(a.rows), max_ctx=512)
    runner.capture(a.rows)
    out = {}
    for B in a.rows:
        ks = replay_trace(runner, B)
        s = summarize(ks)
        if a.sequence:
            s["sequence"] = [dict(name=k["full"], dur_us=k["dur"]) for k in ks[:a.sequence]]
        out[str(B)] = s
        print(f"{B} rows: {s['kernels']} kernels, span {s['span_us']:.0f} us, busy {s['busy_us']:.0f} us, "
              f"gaps {s['gap_us']:.0f} us")
        for r in s["per_name"][:14]:
            print(f"  {r['busy_us']:8.1f} us busy {r['gap_before_us']:7.1f} us gaps {r['calls']:4d}x  {r['name']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
