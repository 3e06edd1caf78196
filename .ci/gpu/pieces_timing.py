"""On the GPU machine: k arriving prompts of N tokens each (k = 1, 2, 4, 8, 16) prefilled one pass each
(Runner.prefill) against one padded pass of several slots' pieces (Runner.prefill_pieces), on the 27B with its
graphs captured as the engine captures them -> $OUT/pieces_timing.json. Also checks that each piece's logits are
the bits its own prefill gives.
    python3 -u .ci/gpu/pieces_timing.py /tmp/m27.gguf [N] [CHUNK]"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from engine.models import open_model  # noqa: E402
from engine.runner import Runner  # noqa: E402

model = open_model(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 32
CHUNK = int(sys.argv[3]) if len(sys.argv) > 3 else 512
runner = Runner(model, device="cuda", n_slots=16, max_ctx=4096)
torch.cuda.synchronize()
before = torch.cuda.memory_reserved()
runner.capture_prefill(CHUNK)   # (the engine's start: the chunk graphs and, with the pieces on, the wider passes)
graphs_mib = (torch.cuda.memory_reserved() - before) / 2**20
print(f"prompt_pieces {runner.prompt_pieces}, pass graphs {sorted(runner._pass_graphs)}, the prompt graphs "
      f"reserve {graphs_mib:.0f} MiB", flush=True)
V = model.spec.vocab_size
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, V, (N,), generator=gen).tolist() for _ in range(16)]


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    best = None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best or 1e9, time.perf_counter() - t)
    return best * 1e3, out


res = []
for k in (1, 2, 4, 8, 16):
    apart_ms, apart = timed(lambda: torch.cat([runner.prefill(s, prompts[s], chunk=CHUNK) for s in range(k)]))
    together_ms, together = timed(lambda: runner.prefill_pieces([(s, prompts[s], 0) for s in range(k)], chunk=CHUNK))
    same = bool(torch.equal(apart.float(), together.float()))
    res.append(dict(k=k, tokens=N, apart_ms=apart_ms, together_ms=together_ms, speedup=apart_ms / together_ms,
                    same_bits=same))
    print(f"k={k:2d} x {N} tokens: apart {apart_ms:7.1f} ms, one pass {together_ms:7.1f} ms "
          f"({apart_ms / together_ms:.2f}x), same bits {same}", flush=True)
json.dump(dict(prompt_pieces=runner.prompt_pieces, graphs_mib=graphs_mib, rows=res),
          open(os.path.join(os.environ.get("OUT", "/tmp"), "pieces_timing.json"), "w"), indent=1)
