"""Long-context retrieval with a compressed KV cache: a passkey hidden in filler text (the prompt
of llama.cpp's examples/passkey), greedy answer, for each cache type.

    python -m engine.tools.passkey -m gemma3-270m --tokens 8192 16384 --depths 0.1 0.3 0.5 0.7 0.9

For one context length, the prompt up to the first depth is read once per cache type and forked
(the pool shares its blocks) for every depth, so only each trial's remainder is computed again.
Prints one line per trial and a table: retrieval rate per cache type, and how often each type
answers like the f16 cache.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

import torch

from engine.models.common import SeqChunk

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = " What is the pass key? The pass key is"


def _key_sentence(key: int) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


@dataclass
class Trial:
    cache_type: str
    n_tokens: int
    depth: float
    key: int
    answer: str
    key_nll: float = float("nan")   # -log p(" KEY" | prompt), teacher-forced, nats


    @property
    def found(self) -> bool:
        return str(self.key) in self.answer


def build_prompt(tokenizer, n_tokens: int, depth: float, key: int) -> list[int]:
    """The whole prompt of one trial (what run_passkey evaluates with shared prefixes)."""
    intro = tokenizer.encode(INTRO, add_special=True)
    filler = tokenizer.encode(FILLER, add_special=False)
    question = tokenizer.encode(QUESTION, add_special=False)
    key_ids = tokenizer.encode(_key_sentence(key), add_special=False)
    n_fill = _n_fill(n_tokens, intro, filler, question, [key_ids])
    cut = round(depth * n_fill)
    return intro + filler * cut + key_ids + filler * (n_fill - cut) + question


def _n_fill(n_tokens, intro, filler, question, key_ids) -> int:
    return max(1, (n_tokens - len(intro) - len(question) - max(map(len, key_ids))) // len(filler))


def _feed(model, kv, ids: list[int], start: int, chunk: int, logits_last: bool = False) -> torch.Tensor | None:
    out = None
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        last = logits_last and s + chunk >= len(ids)
        (lg,) = model.forward([SeqChunk(torch.tensor(part), start + s, kv, "last" if last else "none")])
        out = lg if last else out
    return out


def run_passkey(model, tokenizer, n_tokens: int, depths: list[float], cache_types: list[str], seed: int = 1,
                chunk: int = 1024, answer_tokens: int = 7, log=None) -> list[Trial]:
    """One context of about n_tokens; per depth a different 5-digit key; for each cache type."""
    rnd = random.Random(seed)
    keys = [rnd.randint(10000, 99999) for _ in depths]
    intro = tokenizer.encode(INTRO, add_special=True)
    filler = tokenizer.encode(FILLER, add_special=False)
    question = tokenizer.encode(QUESTION, add_special=False)
    key_ids = [tokenizer.encode(_key_sentence(k), add_special=False) for k in keys]
    n_fill = _n_fill(n_tokens, intro, filler, question, key_ids)
    # filler sentences before each key: the trials share the prompt up to the first key
    cut = [round(d * n_fill) for d in depths]
    order = sorted(range(len(depths)), key=lambda i: cut[i])
    trials = []
    for ct in cache_types:
        kv = model.new_kv(cache_type_k=ct, cache_type_v=ct)
        base = list(intro)
        pos = 0
        done_fill = 0
        for i in order:
            more = filler * (cut[i] - done_fill)
            _feed(model, kv, base[pos:] + more, pos, chunk)
            base += more
            pos = len(base)
            done_fill = cut[i]
            kv.length = pos
            branch = kv.fork()
            rest = key_ids[i] + filler * (n_fill - cut[i]) + question
            logits = _feed(model, branch, rest, pos, chunk, logits_last=True)
            p = pos + len(rest)
            # teacher-forced log-probability of the key, on a fork of the branch
            target = tokenizer.encode(f" {keys[i]}", add_special=False)
            probe = branch.fork()
            (lg,) = model.forward([SeqChunk(torch.tensor(target[:-1]), p, probe, "all")]) if len(target) > 1 else (logits[:0],)
            lp = torch.log_softmax(torch.cat([logits[-1:], lg]).double(), -1)
            nll = -float(lp[torch.arange(len(target)), torch.tensor(target)].sum())
            probe.release()
            out = []
            for _ in range(answer_tokens):
                t = int(logits[-1].argmax())
                out.append(t)
                (logits,) = model.forward([SeqChunk(torch.tensor([t]), p, branch, "last")])
                p += 1
            branch.release()
            tr = Trial(ct, p - len(out), depths[i], keys[i], tokenizer.decode(out), nll)
            trials.append(tr)
            if log:
                log(f"{ct:11s} {tr.n_tokens:6d} tokens depth {tr.depth:.2f} key {tr.key}: {tr.answer.strip()!r} "
                    f"{'ok' if tr.found else 'MISSED'} (key NLL {tr.key_nll:.3f})")
        kv.release()
    return trials


def summary(trials: list[Trial], reference: str = "f16") -> list[tuple[str, int, int, int, float]]:
    """(cache type, retrieved, trials, answers equal to the reference type's, mean key NLL)."""
    ref = {(t.n_tokens, t.depth): t.answer for t in trials if t.cache_type == reference}
    rows = []
    for ct in dict.fromkeys(t.cache_type for t in trials):
        ts = [t for t in trials if t.cache_type == ct]
        same = sum(1 for t in ts if ref.get((t.n_tokens, t.depth)) == t.answer)
        rows.append((ct, sum(t.found for t in ts), len(ts), same, sum(t.key_nll for t in ts) / len(ts)))
    return rows


def main(argv=None) -> int:
    from engine.catalog import ensure_model
    from engine.engine import default_threads
    from engine.models import open_model
    from engine.tokenizer import Tokenizer
    from kernels.kvcodec import CACHE_TYPES

    ap = argparse.ArgumentParser(description="passkey retrieval per KV cache type")
    ap.add_argument("-m", "--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--types", nargs="+", default=[t for t in CACHE_TYPES if t not in ("f32", "bf16")])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--smooth-clamp", type=float, default=None, help="SequenceKV.SMOOTH_CLAMP (1: centering only)")
    ap.add_argument("--plain-keys", action="store_true", help="no key preconditioning")
    args = ap.parse_args(argv)
    from engine.kv import SequenceKV
    if args.smooth_clamp is not None:
        SequenceKV.SMOOTH_CLAMP = args.smooth_clamp
    if args.plain_keys:
        SequenceKV.PRECONDITION_KEYS = False
    torch.set_num_threads(args.threads or default_threads())
    model = open_model(ensure_model(args.model))
    tok = Tokenizer.from_metadata(model.file.metadata)
    t0 = time.time()
    trials = []
    for i, n in enumerate(args.tokens):
        trials += run_passkey(model, tok, n, args.depths, args.types, seed=args.seed + i,
                              log=lambda s: print(s, flush=True))
    print(f"\n{time.time() - t0:.0f} s\n\n| cache type | retrieved | same answer as f16 | mean key NLL |\n|---|---|---|---|")
    for ct, found, n, same, nll in summary(trials):
        print(f"| {ct} | {found}/{n} | {same}/{n} | {nll:.3f} |")
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
