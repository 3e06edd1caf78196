"""On the GPU machine: the engine on the synthetic Qwen3.5-27B Q4_K_M as if the card had 24 GiB, the GPU
HiveJet is built for. A tensor first takes the rest of the H200's memory, so the engine's own fit
(engine/runner_fit.py: the KV pool from torch.cuda.mem_get_info, less the step workspace) sees what a
24 GiB card leaves; then three agents decode while a fourth sends a 20,000-token prompt, as `bench agents`
scenario 4 does; that 20K prompt is regenerated (sent again) and followed up with its reply's first tokens
dropped (as Qwen3.5's chat template drops the last reply's reasoning), both resuming at the prompt's last
state checkpoint (in host memory on such a card, by default); and sixteen agents' short prompts arrive
together (read in shared passes). Whether it all
runs (no out-of-memory in the graph captures or in a step), and how close the step memory came to the end
of the card.

    python3 -u .ci/gpu/engine24.py [--card-gib 24] [--prefill-chunk N] [--checkpoints N]
                                   [--checkpoint-memory auto|device|host] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

GiB = 1 << 30
MODEL = "/tmp/m27.gguf"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--card-gib", type=float, default=24.0)
    ap.add_argument("--prefill-chunk", type=int, default=0, help="0: the engine's default")
    ap.add_argument("--long", type=int, default=20000)
    ap.add_argument("--checkpoints", type=int, default=-1, help="EngineConfig.state_checkpoints")
    ap.add_argument("--checkpoint-memory", default="auto")
    ap.add_argument("--json")
    a = ap.parse_args()
    from engine.engine import Engine, EngineConfig
    from engine.sampling import SamplingParams
    from engine.types import Request

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    used_before = total - free                       # this process's CUDA context, as on any card
    blocker = torch.empty(int(total - a.card_gib * GiB), dtype=torch.uint8, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    res = {"card_gib": a.card_gib, "context_gib": round(used_before / GiB, 2), "free_at_start_gib": round(free / GiB, 2),
           "date": time.strftime("%Y-%m-%d %H:%M")}
    cfg = dict(model=MODEL, device="cuda", state_checkpoints=a.checkpoints, checkpoint_memory=a.checkpoint_memory)
    if a.prefill_chunk:
        cfg["prefill_chunk"] = a.prefill_chunk
    t = time.perf_counter()
    try:
        eng = Engine(EngineConfig(**cfg))
    except Exception as e:   # (what a user would see: the message, not a crash)
        res["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(res))
        return
    res.update(prefill_chunk=eng.config.prefill_chunk, start_s=round(time.perf_counter() - t, 1),
               pool_tokens=eng.runner.pool.n_blocks * eng.runner.block_size,
               free_after_start_gib=round(torch.cuda.mem_get_info()[0] / GiB, 3),
               checkpoints=eng.runner.n_checkpoints, checkpoints_on_host=eng.runner.checkpoints_on_host)
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    vocab = eng.spec.vocab_size
    try:
        agents = [eng.submit(Request(prompt_ids=torch.randint(0, vocab, (32,), generator=g).tolist(),
                                     sampling=SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
                  for _ in range(3)]
        time.sleep(1.0)
        t = time.perf_counter()
        long_ids = torch.randint(0, vocab, (a.long,), generator=g).tolist()
        greedy8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        long = eng.submit(Request(prompt_ids=long_ids, sampling=greedy8))
        _, toks, fin = long.result()
        res["long_prompt_s"] = round(time.perf_counter() - t, 2)
        res["long_finish"] = fin.reason
        res["agents_finish"] = [h.result()[2].reason for h in agents]
        # Regenerate: the same prompt again; then a follow-up whose history lost the reply's first tokens
        for name, ids in (("regenerate", long_ids),
                          ("stripped_follow_up", long_ids + toks[3:] + torch.randint(0, vocab, (50,), generator=g).tolist())):
            _, again, fin2 = eng.submit(Request(prompt_ids=ids, sampling=greedy8)).result()
            res[name] = dict(first_token_s=round(fin2.timings.prompt_ms / 1000, 3), cached=fin2.usage.cached_tokens,
                             finish=fin2.reason, same_tokens=again == toks if name == "regenerate" else None)
        res["host_checkpoint_gib"] = round(eng.runner.checkpoint_bytes(host=True) / GiB, 2)
        # then 16 agents' short prompts arriving together (read in shared passes: the pass graphs in use)
        t = time.perf_counter()
        burst = [eng.submit(Request(prompt_ids=torch.randint(0, vocab, (32,), generator=g).tolist(),
                                    sampling=SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)))
                 for _ in range(16)]
        res["burst_finish"] = [h.result()[2].reason for h in burst]
        res["burst_s"] = round(time.perf_counter() - t, 2)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    free_end, _ = torch.cuda.mem_get_info()
    res.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GiB - blocker.numel() / GiB, 3),
               reserved_gib=round(torch.cuda.memory_reserved() / GiB - blocker.numel() / GiB, 3),
               free_at_end_gib=round(free_end / GiB, 3), totals=eng.stats().get("totals"))
    eng.shutdown()
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
