"""`hivejet bench decode`: a model on the GPU through engine/runner/runner.py, llama.cpp beside it.

- pp{n_prompt} at each depth: time to prefill n_prompt tokens after `depth` tokens already in the cache
  (the median of PP_REPS runs, each run's figure kept too);
- tg{n_gen} at each depth: n_gen single-sequence decode steps (CUDA graph replays; the next token is
  the argmax, fed back on the device, so no step waits for the host);
- rows: one decode step with B rows (B sequences, one token each) for B in `rows`: ms per step,
  tokens/s, and the cost relative to a 1-row step (the thesis: extra rows are nearly free);
- with llamacpp=DIR: `DIR/llama-bench -m MODEL -ngl 99 -fa 1 -p P -n N -d DEPTHS -o json` in the same run.
Tokens are random ids (speed does not depend on them).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

ROWS = [1, 2, 4, 8, 16, 32, 64]
PP_REPS = 5


def _sync():
    import torch
    torch.cuda.synchronize()


def _tokens(n: int, vocab: int, seed: int):
    import torch
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _decode_loop(runner, slot: int, token: int, pos: int, n: int) -> float:
    """n greedy decode steps of one slot, fed back on the device; returns seconds."""
    g = runner.decode_graphs.get(1)
    graph, tok, posb, out = g.graph, g.tokens, g.positions, g.logits
    runner.reserve(slot, pos + n)        # the replays below write positions pos.. without asking the runner
    runner.sync_tables()
    runner.decode_graphs.fill(1, [slot], [token], [pos])
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
        tok.copy_(out.argmax(-1))
        posb.add_(1)
    _sync()
    return time.perf_counter() - t0


def ready_rows(runner, B: int, pos: int):
    """The B-row decode graph, its inputs set to slots 0..B-1 at position pos: replayable."""
    graph = runner.decode_graphs.get(B).graph
    for s in range(B):                   # blocks up to pos for each row's slot (never prefilled: any bytes)
        runner.reserve(s, pos + 1)
    runner.sync_tables()
    runner.decode_graphs.fill(B, list(range(B)), [1] * B, [pos] * B)
    return graph


def _row_step_ms(runner, B: int, pos: int, reps: int = 20) -> float:
    graph = ready_rows(runner, B, pos)
    graph.replay()
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    _sync()
    return (time.perf_counter() - t0) / reps * 1e3


def _profile_step(runner, B: int, pos: int) -> list[dict]:
    """CUDA time per kernel name of one eager decode step of B rows (not graph-replayed, so launch
    gaps are not in these numbers: they show where the device time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    dev = runner.device
    args = (torch.ones(B, dtype=torch.long, device=dev), torch.full((B,), pos, dtype=torch.long, device=dev),
            torch.arange(B, dtype=torch.long, device=dev))
    # without key centers, as 255 of 256 steps (a row at a new key segment makes its center)
    runner._decode_eager(*args, centers=False)
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner._decode_eager(*args, centers=False)
        _sync()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append(dict(kernel=e.key[:90], calls=e.count, us=t))
    rows.sort(key=lambda r: -r["us"])
    return rows[:25]


def copy_bandwidth(torch, nbytes: int) -> float:
    """Bytes per second a device-to-device copy of `nbytes` moves (read + write): the card's streaming rate."""
    from triton.testing import do_bench
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200)
    return 2 * nbytes / (ms * 1e-3)  # read + write


def run_llama_bench(llamacpp: str, model: str, depths, n_prompt: int, n_gen: int) -> list[dict]:
    exe = os.path.join(llamacpp, "llama-bench")
    cmd = [exe, "-m", model, "-ngl", "99", "-fa", "1", "-p", str(n_prompt), "-n", str(n_gen),
           "-d", ",".join(str(d) for d in depths), "-r", "2", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    recs = json.loads(out.stdout)
    return [dict(test=("pp" if r["n_prompt"] else "tg") + str(r["n_prompt"] or r["n_gen"]), depth=r.get("n_depth", 0),
                 tok_s=r["avg_ts"], stddev=r["stddev_ts"], build=r.get("build_commit")) for r in recs]


def _log(msg: str) -> None:
    import sys
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_decode(model_path: str, depths=(0, 23000), rows=ROWS, n_prompt: int = 512, n_gen: int = 128,
                 llamacpp: str | None = None, profile: bool = False, json_path: str | None = None,
                 card=None) -> dict:
    """card (engine/cards.Card; default: the GPU in use, when the card table knows it): whose decode ceiling
    the result records beside the measured speed (ceiling_tok_s: bandwidth / the weights a step reads).
    The result also records the GPU family whose kernel settings ran (kernels/family.py).
    The cache before `depth` is not prefilled: attention reads the same bytes whatever they hold,
    so the depth's zeros cost what a real context costs (the recurrent layers do not see depth)."""
    import torch

    from engine.models import open_model
    from engine.runner import Runner
    if not torch.cuda.is_available():
        raise RuntimeError("the decode benchmark needs a CUDA GPU")
    res: dict = dict(device=torch.cuda.get_device_name(), model=os.path.basename(model_path),
                     model_bytes=os.path.getsize(model_path), date=time.strftime("%Y-%m-%d %H:%M"),
                     hivejet=[], rows=[])

    def save():
        if json_path:
            with open(json_path, "w") as f:
                json.dump(res, f, indent=1)
    _record_ceiling(res, torch, model_path, card)
    t0 = time.perf_counter()
    model = open_model(model_path)
    ctx = max(depths) + n_prompt + n_gen + 16          # one slot with room for the deepest test
    runner = Runner(model, device="cuda", n_slots=1, max_ctx=ctx)
    _sync()
    res["load_s"] = time.perf_counter() - t0
    res["weights_gpu_bytes"] = torch.cuda.memory_allocated() - runner.kv_bytes() - runner.state_bytes()
    res["bandwidth_limit_steps_s"] = res["copy_tbps"] * 1e12 / res["weights_gpu_bytes"]
    _log(f"loaded in {res['load_s']:.1f} s, {res['weights_gpu_bytes'] / 1e9:.2f} GB of weights on the GPU")
    _bench_depths(res, runner, model.spec.vocab_size, depths, n_prompt, n_gen, save)
    if profile:
        res["profile_1row"] = _profile_step(runner, 1, n_prompt)
        save()
    del runner
    torch.cuda.empty_cache()
    runner = Runner(model, device="cuda", n_slots=max(rows), max_ctx=512)
    _bench_rows(res, runner, rows, profile)
    save()
    del runner
    torch.cuda.empty_cache()
    if llamacpp:
        _log("llama-bench ...")
        res["llamacpp"] = run_llama_bench(llamacpp, model_path, depths, n_prompt, n_gen)
        save()
    return res


def _record_ceiling(res: dict, torch, model_path: str, card) -> None:
    """The GPU family, the card's decode ceiling for this model and the measured copy bandwidth."""
    from engine.cards import current_card, decode_ceiling
    from engine.planner import model_facts
    from kernels.family import device_family
    res["family"] = device_family(0).name
    c = card or current_card()
    res["decode_read_bytes"] = model_facts(model_path, mmproj=None).decode_read_bytes
    if c is not None:
        res["card"] = dict(key=c.key, name=c.name, bandwidth_gbs=c.bandwidth_gbs, memory_gb=c.memory_gb, sm=c.sm)
        res["ceiling_tok_s"] = decode_ceiling(res["decode_read_bytes"], c)
    res["copy_tbps"] = copy_bandwidth(torch, 1 << 30) / 1e12        # read + write, like a weight stream


def _bench_depths(res: dict, runner, V: int, depths, n_prompt: int, n_gen: int, save) -> None:
    """One sequence: pp{n_prompt} and tg{n_gen} at each depth, into res["hivejet"]."""
    runner.prefill(0, _tokens(n_prompt, V, 0))          # compile and warm up the prefill kernels
    runner.decode_graphs.get(1)
    _log("warm")
    for d in depths:
        runner.prefill(0, _tokens(n_prompt, V, 3), start=d)   # warm: torch's attention picks kernels per shape
        _sync()
        times = []
        for rep in range(PP_REPS):   # one run varied 2060-2880 tok/s on the H200 (host work, allocator)
            t = time.perf_counter()
            runner.prefill(0, _tokens(n_prompt, V, 2 + rep), start=d)
            _sync()
            times.append(time.perf_counter() - t)
        pp = n_prompt / statistics.median(times)
        res["hivejet"].append(dict(test=f"pp{n_prompt}", depth=d, tok_s=pp,
                                   tok_s_runs=[n_prompt / t for t in times]))
        secs = _decode_loop(runner, 0, 1, d + n_prompt, n_gen)
        res["hivejet"].append(dict(test=f"tg{n_gen}", depth=d, tok_s=n_gen / secs))
        _log(f"depth {d}: pp{n_prompt} {pp:.1f} tok/s, tg{n_gen} {n_gen / secs:.1f} tok/s")
        save()


def _bench_rows(res: dict, runner, rows, profile: bool) -> None:
    """B sequences at position 256, one decode step each, into res["rows"]."""
    runner.capture(rows)
    base = None
    for B in rows:
        ms = _row_step_ms(runner, B, 256)
        base = base or ms
        res["rows"].append(dict(rows=B, ms=ms, tok_s=B * 1e3 / ms, vs_1row=ms / base))
        _log(f"{B} rows: {ms:.3f} ms/step")
    if profile:
        res["profile_16rows"] = _profile_step(runner, 16, 256)


def print_decode(res: dict) -> None:
    print(f"device: {res['device']}; model {res['model']} ({res['model_bytes'] / 1e9:.2f} GB, "
          f"{res['weights_gpu_bytes'] / 1e9:.2f} GB on the GPU); loaded in {res['load_s']:.1f} s; "
          f"copy bandwidth {res['copy_tbps']:.2f} TB/s -> at most {res['bandwidth_limit_steps_s']:.0f} steps/s")
    lc = {(r["test"], r["depth"]): r for r in res.get("llamacpp", [])}
    print(f"{'test':8s} {'depth':>6s} {'HiveJet tok/s':>14s} {'llama.cpp tok/s':>16s} {'ratio':>6s}")
    for r in res["hivejet"]:
        o = lc.get((r["test"], r["depth"]))
        ratio = f"{r['tok_s'] / o['tok_s']:6.2f}" if o else "     -"
        print(f"{r['test']:8s} {r['depth']:6d} {r['tok_s']:14.1f} {(o['tok_s'] if o else float('nan')):16.1f} {ratio}")
    print(f"\n{'rows':>4s} {'ms/step':>8s} {'tok/s':>8s} {'vs 1 row':>8s}")
    for r in res["rows"]:
        print(f"{r['rows']:4d} {r['ms']:8.3f} {r['tok_s']:8.1f} {r['vs_1row']:8.2f}")
    print(ceiling_text(res))
    for key in ("profile_1row", "profile_16rows"):
        if res.get(key):
            print(f"\n{key}: CUDA time per kernel (eager step)")
            for r in res[key]:
                print(f"{r['us']:10.1f} us {r['calls']:5d}x  {r['kernel']}")


def ceiling_text(res: dict) -> str:
    """The decode ceiling on the result's card, beside its 1-row speed (tg at the first depth), and the GPU
    family whose kernel settings ran."""
    fam = f"kernel settings of the {res.get('family', '?')} family"
    if not res.get("card"):
        return f"{fam}; decode ceiling: the GPU is not in the card table (name one with --card)"
    from engine.cards import BY_KEY, ceiling_line
    tg = next((r["tok_s"] for r in res.get("hivejet", []) if r["test"].startswith("tg")), None)
    return f"{fam}; " + ceiling_line(res["decode_read_bytes"], BY_KEY[res["card"]["key"]], tg)


def plot_rows(res: dict, out_png: str) -> None:
    """Row-scaling chart (Pillow): tokens/s and step time against rows, log2 x axis."""
    import math

    from PIL import Image, ImageDraw
    rows = res["rows"]
    W, H, L, R, T, B = 760, 440, 70, 70, 40, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    xs = [math.log2(r["rows"]) for r in rows]
    x0, x1 = min(xs), max(xs) or 1

    def px(x):
        return L + (x - x0) / ((x1 - x0) or 1) * (W - L - R)
    series = [("tok/s", [r["tok_s"] for r in rows], (31, 119, 180)),
              ("ms/step", [r["ms"] for r in rows], (214, 39, 40))]
    d.rectangle([L, T, W - R, H - B], outline="black")
    for i, (name, ys, color) in enumerate(series):
        top = max(ys) * 1.1
        pts = [(px(x), H - B - y / top * (H - T - B)) for x, y in zip(xs, ys)]
        d.line(pts, fill=color, width=3)
        for p, y in zip(pts, ys):
            d.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=color)
            d.text((p[0] + 4, p[1] - 14 if i == 0 else p[1] + 4), f"{y:.0f}" if y >= 10 else f"{y:.2f}", fill=color)
        d.text((L + 10 + 120 * i, T - 18), name, fill=color)
    for r, x in zip(rows, xs):
        d.text((px(x) - 6, H - B + 6), str(r["rows"]), fill="black")
    d.text((W // 2 - 60, H - 22), "rows per decode step", fill="black")
    d.text((L, 8), f"HiveJet decode step, {res['model']} on {res['device']}", fill="black")
    img.save(out_png)
