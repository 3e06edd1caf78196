"""On the GPU machine: is a prompt's prefill the same bits every time? The 27B, one runner as the engine makes
it (graphs captured at start): prefill of the same 32-token prompt into slot 0 three times, into slot 1, eagerly
(a runner without graphs), and with prefill_pieces beside three other prompts; the largest difference in the
last row's logits and whether the argmax agrees; the memory the prompt graphs reserve -> $OUT/prefill_repeat.json.
    python3 -u .ci/gpu/prefill_repeat.py /tmp/m27.gguf [N]"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from engine.models import open_model  # noqa: E402
from engine.runner import Runner  # noqa: E402

model = open_model(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 32
DEV = os.environ.get("DEV", "cuda")
V = model.spec.vocab_size
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, V, (N,), generator=gen).tolist() for _ in range(4)]


def diff(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return dict(same_bits=bool(torch.equal(a, b)), max_abs=float((a - b).abs().max()),
                same_argmax=bool(torch.equal(a.argmax(-1), b.argmax(-1))))


res = {}
r = Runner(model, device=DEV, n_slots=16, max_ctx=4096)
if DEV == "cuda":
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
r.capture_prefill(512)   # (as the engine starts: the chunk graphs and, with the pieces on, the wider passes)
if DEV == "cuda":
    res["prompt_graphs_mib"] = (torch.cuda.memory_reserved() - before) / 2**20
first = r.prefill(0, prompts[0], chunk=512).clone()
res["again"] = diff(first, r.prefill(0, prompts[0], chunk=512))
res["third"] = diff(first, r.prefill(0, prompts[0], chunk=512))
res["slot1"] = diff(first, r.prefill(1, prompts[0], chunk=512))
# after other slots' prompts and a decode step
for s in range(2, 5):
    r.prefill(s, prompts[s - 1], chunk=512)
r.decode([2, 3, 4], [1, 2, 3], [N, N, N])
res["after_others"] = diff(first, r.prefill(0, prompts[0], chunk=512))
if r.prompt_pieces > 1:
    out = r.prefill_pieces([(0, prompts[0], 0)] + [(s, prompts[s - 1], 0) for s in range(2, 5)], chunk=512)
    res["pieces"] = diff(first, out[:1])
    alone = [r.prefill(s, prompts[s - 1], chunk=512) for s in range(2, 5)]
    res["pieces_others"] = [diff(a, out[i + 1:i + 2]) for i, a in enumerate(alone)]
r.close()
# the padded pass run eagerly (no graphs): every layer's output recorded, so that a difference shows where it starts
pe = Runner(model, device=DEV, n_slots=2, max_ctx=4096, padded_prefill=True, graphs=False)
records = []


def recorded(name, fn):
    def call(*a, **kw):
        out = fn(*a, **kw)
        if torch.is_tensor(out):   # (partial sums [split, rows, n]: each slice's first N rows)
            rec = out[:, :N] if name == "matmul_tuned" and out.dim() == 3 else out[:N]
            records.append((name, rec.detach().float().clone()))
        return out
    return call


BLOCKS = ("_gated_delta_net", "_gated_attention", "_ffn")
for name in BLOCKS:
    if hasattr(model, name):
        setattr(model, name, recorded(name, getattr(model, name)))
# and the kernels inside a block (module attributes the model looks up at each call)
import engine.models.qwen35 as q35  # noqa: E402
import engine.runner.recurrent as rec  # noqa: E402
import kernels.fused as fused  # noqa: E402
import kernels.quant.packed as packed  # noqa: E402
patched = [(q35, "rms_norm"), (fused, "gated_sum_parts"), (packed, "matmul_tuned"), (rec, "conv_rule_pieces"),
           (rec, "conv_rule_rows")]
saved = [(mod, name, getattr(mod, name)) for mod, name in patched if hasattr(mod, name)]
for mod, name, fn in saved:
    setattr(mod, name, recorded(name, fn))
runs = []
for _ in range(2):
    records.clear()
    logits = pe.prefill(0, prompts[0], chunk=512).clone()
    runs.append((logits, list(records)))
res["padded_eager_again"] = diff(runs[0][0], runs[1][0])
res["padded_eager_vs_graph"] = diff(first, runs[0][0])
firsts = [(i, n, float((a - b).abs().max()))
          for i, ((n, a), (_, b)) in enumerate(zip(runs[0][1], runs[1][1])) if not torch.equal(a, b)]
res["padded_eager_records"] = len(runs[0][1])
res["padded_eager_first_differences"] = firsts[:6]
for name in BLOCKS:
    model.__dict__.pop(name, None)
for mod, name, fn in saved:
    setattr(mod, name, fn)
pe.close()
e = Runner(model, device=DEV, n_slots=2, max_ctx=4096, padded_prefill=False, graphs=False)
eager = e.prefill(0, prompts[0], chunk=512).clone()
res["eager_again"] = diff(eager, e.prefill(0, prompts[0], chunk=512))
res["eager_vs_graph"] = diff(first, eager)
e.close()
print(json.dumps(res, indent=1), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefill_repeat.json"), "w"), indent=1)
