"""On the GPU machine: the synthetic Qwen3.5-27B Q4_K_M at long context through engine/runner/runner.py.

    source .ci/gpu/env.sh
    python3 -u .ci/gpu/ctx200k.py ctx200k [--budget S]   -> $OUT/ctx200k.json
    python3 -u .ci/gpu/ctx200k.py depth [--steps N]      -> $OUT/ctx_depth.json

ctx200k: the process is capped at 24 GiB (torch.cuda.set_per_process_memory_fraction: torch's allocator
refuses to go past it), a runner with one slot of 200,032 tokens, K and V in turbo3_tcq; a 200,000-token
prompt of random ids is prefilled in chunks of 512 (progress every 10 chunks), then 32 greedy tokens are
decoded (CUDA graph replays, each token fed back on the device). Prints torch.cuda.max_memory_allocated
beside engine/planner.py's prediction (`hivejet plan -m /tmp/m27.gguf --kv turbo3_tcq --ctx 200032 --vram
24GiB`, its "allocated by torch" line) and the error in %. If the prefill has not finished after --budget
seconds (default 420, so the mode stays under ~8 minutes), the remaining positions are filled with encoded
random K/V instead (the JSON says how many tokens were prefilled) and the decode still runs at 200,000.

depth: decode tokens/s of one sequence at depth 23,000 and 131,072 (128K) for the K/V types f16, q8_0,
turbo4, turbo3_tcq. The cache before the depth is NOT prefilled (128K x 4 types would take far longer than
10 minutes): it is filled directly with encoded random keys and values (unit normal, a shared offset per
head and an outlier channel, as real keys have; rotated K types get segment centers as a prefill would),
which is what a decode step reads; its speed does not depend on the values. No memory cap in this mode.

The model is generated at /tmp/m27.gguf first when missing (as .ci/gpu/env.sh: m27_start does).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

MODEL = "/tmp/m27.gguf"
GiB = 1 << 30
OUT = os.environ.get("OUT", "/tmp")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def save(name: str, res: dict) -> None:
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(res, f, indent=1)


def sync() -> None:
    torch.cuda.synchronize()


def ensure_model() -> float:
    if os.path.exists(MODEL):
        return 0.0
    from engine.tools.synth import write_synthetic
    t = time.perf_counter()
    log(f"generating {MODEL} (synthetic Qwen3.5-27B Q4_K_M) ...")
    write_synthetic(MODEL, "qwen35", "27b-q4_k_m", threads=os.cpu_count() or 16)
    log(f"generated in {time.perf_counter() - t:.0f} s")
    return time.perf_counter() - t


def fill_kv(runner, lo: int, hi: int, seed: int = 0, pool: int = 4096) -> None:
    """Slot 0's positions lo..hi in every attention layer: encoded random K/V with statistics like real
    ones (a pool of `pool` encoded tokens repeated: speed does not depend on the values). Rotated K types
    get what a prefill would have made: a center per segment (the pool's mean) and unit weights."""
    s, dev = runner.spec, runner.device
    g = torch.Generator(device=dev).manual_seed(seed)
    hkv, d = s.n_head_kv, s.head_dim
    runner.reserve(0, hi)                                     # the pool's blocks for positions < hi
    runner.sync_tables()
    rows = runner.tables.rows(0, torch.arange(lo, hi, device=dev))  # where slot 0's positions live in the pool
    for il in runner.k:
        k = torch.randn(pool, hkv, d, device=dev, generator=g) + torch.randn(1, hkv, d, device=dev, generator=g)
        k[..., 3] += 4.0
        v = torch.randn(pool, hkv, s.head_dim_v, device=dev, generator=g)
        kp = runner.kprep.get(il)
        if kp is not None:    # segments without a center yet get the pool's mean
            c = k.mean(0)
            have, n_seg = int(kp.ncent[0]), -(-hi // runner.keys.segment)
            if n_seg > have:
                kp.centers[0, have:n_seg] = c
                kp.ncent[0] = n_seg
            k = k - c
        kb, vb = runner.codec_k.encode(k), runner.codec_v.encode(v)
        reps = -(-(hi - lo) // pool)
        kc, vc = runner.k[il], runner.v[il]
        kc.view(-1, hkv, kc.shape[-1])[rows] = kb.repeat(reps, 1, 1)[:hi - lo]
        vc.view(-1, hkv, vc.shape[-1])[rows] = vb.repeat(reps, 1, 1)[:hi - lo]
    sync()


def decode_loop(runner, token: int, pos: int, n: int) -> tuple[float, list[int]]:
    """n greedy decode steps of slot 0 from position pos (graph replays, the argmax fed back on the
    device). Returns (seconds, tokens)."""
    g = runner._graph(1)
    graph, tok, posb, out = g.graph, g.tokens, g.positions, g.logits
    runner.reserve(0, pos + n)           # the replays below write positions pos.. without asking the runner
    runner.sync_tables()
    runner.fill(1, [0], [token], [pos])
    toks = torch.empty(n, dtype=torch.long, device=runner.device)
    sync()
    t = time.perf_counter()
    for i in range(n):
        graph.replay()
        nxt = out.argmax(-1)
        toks[i:i + 1].copy_(nxt)
        tok.copy_(nxt)
        posb.add_(1)
    sync()
    return time.perf_counter() - t, toks.tolist()


def mem() -> dict:
    return {"allocated": torch.cuda.memory_allocated(), "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved()}


def run_ctx200k(budget: float) -> dict:
    from app.cli_plan import format_plan
    from engine import planner as P
    from engine.models import open_model
    from engine.runner import Runner
    PROMPT, N_GEN, CHUNK, KV = 200_000, 32, 512, "turbo3_tcq"
    CTX = PROMPT + N_GEN
    CAP = 24 * GiB
    res: dict = {"mode": "ctx200k", "device": torch.cuda.get_device_name(), "model": MODEL, "cache_type_k": KV,
                 "cache_type_v": KV, "prompt_tokens": PROMPT, "decode_tokens": N_GEN, "max_ctx": CTX,
                 "chunk": CHUNK, "cap_bytes": CAP, "date": time.strftime("%Y-%m-%d %H:%M")}
    res["generate_s"] = ensure_model()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP / total, 0)
    res["memory_fraction"] = CAP / total
    facts = P.model_facts(MODEL)
    plan = P.plan(facts, CTX, KV, 1, CAP, kv_type_v=KV, step_tokens=CHUNK)
    res["plan"] = plan.breakdown()
    res["plan_command"] = f"hivejet plan -m {MODEL} --kv {KV} --ctx {CTX} --vram 24GiB"
    log("plan:\n" + format_plan(plan))
    save("ctx200k.json", res)
    try:
        t = time.perf_counter()
        model = open_model(MODEL)
        model.to_device(torch.device("cuda"))
        sync()
        res["load_s"] = time.perf_counter() - t
        res["weights_measured"] = torch.cuda.memory_allocated()
        log(f"weights on the GPU: {res['weights_measured'] / 1e9:.3f} GB measured, "
            f"{plan.weights / 1e9:.3f} GB planned ({res['load_s']:.0f} s)")
        runner = Runner(model, device="cuda", n_slots=1, max_ctx=CTX, cache_type_k=KV, cache_type_v=KV)
        sync()
        res["runner_bytes"] = runner.device_bytes()
        res["after_init"] = mem()
        log(f"runner: KV {runner.kv_bytes() / 1e9:.3f} GB, states {runner.state_bytes() / 1e9:.3f} GB; "
            f"allocated {torch.cuda.memory_allocated() / 1e9:.3f} GB")
        V = model.spec.vocab_size
        prompt = torch.randint(0, V, (PROMPT,), generator=torch.Generator().manual_seed(0))
        t = time.perf_counter()
        done, logits, progress = 0, None, []
        n_chunks = -(-PROMPT // CHUNK)
        for i in range(n_chunks):
            lo, hi = i * CHUNK, min(PROMPT, (i + 1) * CHUNK)
            logits = runner.prefill(0, prompt[lo:hi], start=lo, chunk=CHUNK)
            done = hi
            if (i + 1) % 10 == 0 or hi == PROMPT:
                sync()
                el = time.perf_counter() - t
                rec = {"chunks": i + 1, "tokens": done, "s": round(el, 2), "tok_s": round(done / el, 1),
                       "max_allocated": torch.cuda.max_memory_allocated()}
                progress.append(rec)
                log(f"prefill {done:>7}/{PROMPT} tokens, {el:6.1f} s, {done / el:7.1f} tok/s (overall), "
                    f"max allocated {rec['max_allocated'] / 1e9:.3f} GB")
                res["prefill_progress"] = progress
                save("ctx200k.json", res)
                if el > budget and hi < PROMPT:
                    log(f"prefill budget of {budget:.0f} s spent: filling positions {hi}..{PROMPT} directly")
                    break
        sync()
        res["prefill_s"] = time.perf_counter() - t
        res["prefilled_tokens"] = done
        res["prefill_tok_s"] = done / res["prefill_s"]
        if done < PROMPT:
            fill_kv(runner, done, PROMPT)
            res["filled_tokens"] = PROMPT - done
            first = 1
        else:
            first = int(logits[-1].argmax())
        t = time.perf_counter()
        runner._graph(1)                 # capture the 1-row decode graph (compiles the decode kernels)
        sync()
        res["capture_s"] = time.perf_counter() - t
        secs, toks = decode_loop(runner, first, PROMPT, N_GEN)
        res["decode_s"] = secs
        res["decode_tok_s"] = N_GEN / secs
        res["decoded"] = toks
        log(f"decode: {N_GEN} tokens at position {PROMPT} in {secs:.2f} s = {N_GEN / secs:.2f} tok/s "
            f"(graph capture {res['capture_s']:.1f} s)")
    except torch.OutOfMemoryError as e:
        res["error"] = f"out of memory under the 24 GiB cap: {e}"
        log(res["error"])
    res["memory"] = mem()
    meas = res["memory"]["max_allocated"]
    res["plan_error_pct"] = 100.0 * (plan.allocated - meas) / meas
    reserved = res["memory"]["max_reserved"]    # (the plan's total less the CUDA context, which torch does not see)
    res["plan_total_vs_max_reserved_pct"] = 100.0 * (plan.total - P.CUDA_CONTEXT_BYTES - reserved) / reserved
    log(f"max_memory_allocated {meas / 1e9:.3f} GB vs planned {plan.allocated / 1e9:.3f} GB: "
        f"{res['plan_error_pct']:+.2f} %; max_memory_reserved {res['memory']['max_reserved'] / 1e9:.3f} GB "
        f"(cap {CAP / 1e9:.3f} GB)")
    save("ctx200k.json", res)
    return res


def run_depth(steps: int, profile: bool = False) -> dict:
    from engine.models import open_model
    from engine.runner import Runner
    DEPTHS = (23_000, 131_072)
    TYPES = tuple(os.environ.get("CTX_TYPES", "f16,q8_0,turbo4,turbo3_tcq").split(","))
    res: dict = {"mode": "depth", "device": torch.cuda.get_device_name(), "model": MODEL, "steps": steps,
                 "depths": DEPTHS, "date": time.strftime("%Y-%m-%d %H:%M"), "results": [],
                 "note": "the cache before each depth was filled with encoded random K/V (not prefilled); "
                         "decode speed does not depend on the values"}
    res["generate_s"] = ensure_model()
    t = time.perf_counter()
    model = open_model(MODEL)
    model.to_device(torch.device("cuda"))
    sync()
    res["load_s"] = time.perf_counter() - t
    log(f"model on the GPU in {res['load_s']:.0f} s")
    V = model.spec.vocab_size
    for kt in TYPES:
        t = time.perf_counter()
        runner = Runner(model, device="cuda", n_slots=1, max_ctx=max(DEPTHS) + steps + 16, cache_type=kt)
        runner.prefill(0, torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(1)))   # warm-up
        fill_kv(runner, 64, max(DEPTHS))
        runner._graph(1)
        sync()
        setup = time.perf_counter() - t
        for d in DEPTHS:
            secs, _ = decode_loop(runner, 1, d, steps)
            r = {"cache_type": kt, "depth": d, "tok_s": steps / secs, "ms_per_token": 1e3 * secs / steps,
                 "kv_gb_read_per_token": runner.kv_bytes() / max(runner.max_ctx, 1) * d / 1e9}
            if profile and d == DEPTHS[0]:   # CUDA time per kernel of one eager step at this depth
                from engine.tools.bench_decode import _profile_step
                r["profile"] = _profile_step(runner, 1, d)
            res["results"].append(r)
            log(f"{kt:>10} depth {d:>7}: {r['tok_s']:6.2f} tok/s ({r['ms_per_token']:.2f} ms/token; "
                f"setup {setup:.0f} s)")
            save("ctx_depth.json", res)
        del runner
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["ctx200k", "depth"])
    ap.add_argument("--budget", type=float, default=420.0, help="ctx200k: seconds of prefill before filling the rest")
    ap.add_argument("--steps", type=int, default=64, help="depth: decode steps timed per depth")
    ap.add_argument("--profile", action="store_true", help="depth: CUDA time per kernel of a step at 23K")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    res = run_ctx200k(args.budget) if args.mode == "ctx200k" else run_depth(args.steps, args.profile)
    print(json.dumps({k: v for k, v in res.items() if k not in ("prefill_progress", "decoded")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
