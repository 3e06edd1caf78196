"""Make the turbo codecs' tables: resources/codebooks/turbo_codebooks.npz (+ .json with how).

    python -m engine.tools.train_codebooks                      # what the stored file was made with
    python -m engine.tools.train_codebooks --synthetic          # TCQ trained on Gaussian samples instead

1. Rotation signs: two vectors of 128 random signs from numpy's default_rng(seed).
2. Lloyd-Max centroids (2, 3, 4 bits) for one coordinate of a uniformly random unit vector in R^128,
   scaled by sqrt(128): density proportional to (1 - x^2/128)^((128-3)/2) on [-sqrt(128), sqrt(128)]
   (close to N(0, 1)), computed by Lloyd's iteration on a fine grid, kept symmetric.
3. TCQ codebooks (512 states for 3 bits, 256 for 2): trained on real K and V. Both catalog models
   (SmolLM2-135M Q4_1, Gemma-3-270M Q4_K_M) read two texts that the quality tests do not use
   (the first tokens of CPython's Lib/argparse.py and Lib/pydoc_data/topics.py of the running
   Python) with a turbo4 KV cache; every attention layer's K and V rows exactly as the cache
   encodes them (after RoPE; keys centered per segment and smoothed, see
   engine/kv/sequence.py) are rotated (zero-padded to 128) and normalised like the codec does; `--groups` random 128-value groups per
   model are the training set, another `--groups / 4` the held-out set. Training starts from a
   seeded N(0, 1) codebook and alternates Viterbi encoding (the codec's own `viterbi`) with setting
   each state's value to the mean of the samples coded with it (a Lloyd step for the trellis).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kernels.kvcodec.codebooks import CODEBOOK_FILE
from kernels.kvcodec.rotation import GROUP, Rotation
from kernels.kvcodec.tcq import viterbi

D = GROUP


def lloyd_max(levels: int, d: int = D, grid: int = 400_001, iters: int = 3000) -> tuple[np.ndarray, float]:
    """Centroids (ascending) and MSE of the optimal scalar quantizer for sqrt(d) * (a coordinate of a
    random unit vector in R^d)."""
    r = math.sqrt(d)
    x = np.linspace(-r, r, grid)[1:-1]
    f = (1.0 - x * x / d) ** ((d - 3) / 2.0)
    f /= f.sum()
    c = np.quantile(np.random.default_rng(0).standard_normal(200_000), (np.arange(levels) + 0.5) / levels)
    for _ in range(iters):
        idx = np.searchsorted((c[1:] + c[:-1]) / 2, x)
        c = np.bincount(idx, weights=f * x, minlength=levels) / np.bincount(idx, weights=f, minlength=levels)
        c = (c - c[::-1]) / 2.0                      # exactly symmetric
    idx = np.searchsorted((c[1:] + c[:-1]) / 2, x)
    return c.astype(np.float32), float((f * (x - c[idx]) ** 2).sum())


def normalised_groups(rows: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """K or V rows [N, d] -> rotated, normalised 128-groups [N * ceil(d/128), 128] (scale sqrt(128))."""
    y = rot.rotate(rows).reshape(-1, GROUP)
    n = y.norm(dim=-1, keepdim=True)
    keep = n[:, 0] > 0
    return (y[keep] * (math.sqrt(GROUP) / n[keep]))


def dump_kv(model_name: str, texts: list[str], n_tokens: int) -> list[torch.Tensor]:
    """The K and V rows ([n, d] per head) exactly as a turbo4 cache encodes them (keys centered and
    smoothed, engine/kv/sequence.py) while the model reads each text in 256-token chunks."""
    from engine.catalog import ensure_model
    from engine.models import open_model
    from engine.models.common import SeqChunk
    from engine.tokenizer import Tokenizer
    from kernels.kvcodec.turbo import TurboCodec

    m = open_model(ensure_model(model_name, progress=lambda s: print(s, file=sys.stderr)))
    tok = Tokenizer.from_metadata(m.file.metadata)
    rows: list[torch.Tensor] = []
    orig = TurboCodec.encode

    def record(self, x, impl="auto"):
        rows.append(x.reshape(-1, x.shape[-1]).float().clone())
        return orig(self, x, impl)

    TurboCodec.encode = record
    try:
        for text in texts:
            ids = tok.encode(text, add_special=True)[:n_tokens]
            kv = m.new_kv(cache_type_k="turbo4", cache_type_v="turbo4")
            for s in range(0, len(ids), 256):
                m.forward([SeqChunk(torch.tensor(ids[s:s + 256]), s, kv, logits="none")])
    finally:
        TurboCodec.encode = orig
        m.close()
    return rows


def _use_tables(tables: dict[str, np.ndarray], path: Path) -> None:
    """Make get_codec() use these (provisional) tables: the model runs need the rotation and lm4."""
    import kernels.kvcodec as kv
    from kernels.kvcodec import codebooks
    np.savez(path, **tables)
    codebooks.CODEBOOK_FILE = path
    codebooks.load_codebooks.cache_clear()
    kv.default_rotation.cache_clear()
    kv.get_codec.cache_clear()


def train_tcq(data: torch.Tensor, L: int, k: int, iters: int, seed: int, log=print) -> torch.Tensor:
    S = 1 << L
    cb = torch.randn(S, generator=torch.Generator().manual_seed(seed))
    for it in range(iters):
        st = viterbi(data, cb, L, k)
        err = ((cb[st] - data) ** 2).mean().item()
        num = torch.zeros(S, dtype=torch.float64).index_add_(0, st.flatten(), data.flatten().double())
        cnt = torch.zeros(S, dtype=torch.float64).index_add_(0, st.flatten(), torch.ones(data.numel(), dtype=torch.float64))
        cb = torch.where(cnt > 0, num / cnt.clamp_min(1), cb.double()).float()
        log(f"  tcq L={L} k={k} iteration {it + 1}/{iters}: train MSE {err:.5f} ({int((cnt == 0).sum())} unused states)")
    return cb


def tcq_mse(data: torch.Tensor, cb: torch.Tensor, L: int, k: int) -> float:
    return ((cb[viterbi(data, cb, L, k)] - data) ** 2).mean().item()


def scalar_mse(data: torch.Tensor, c: np.ndarray) -> float:
    ct = torch.from_numpy(c)
    idx = torch.bucketize(data, (ct[1:] + ct[:-1]) / 2)
    return ((ct[idx] - data) ** 2).mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(CODEBOOK_FILE))
    ap.add_argument("--seed", type=int, default=20251130)
    ap.add_argument("--groups", type=int, default=12000, help="training groups per model")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens read per text")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--synthetic", action="store_true", help="train TCQ on N(0,1) samples, not real KV")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    rng = np.random.default_rng(args.seed)
    signs1 = rng.choice(np.array([-1, 1], np.int8), GROUP)
    signs2 = rng.choice(np.array([-1, 1], np.int8), GROUP)
    rot = Rotation(torch.from_numpy(signs1), torch.from_numpy(signs2))
    out: dict[str, np.ndarray] = {"signs1": signs1, "signs2": signs2}
    meta: dict = {"command": "python -m engine.tools.train_codebooks " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "seed": args.seed, "python": sys.version.split()[0], "torch": torch.__version__, "mse": {}}
    for bits in (2, 3, 4):
        c, mse = lloyd_max(1 << bits)
        out[f"lm{bits}"] = c
        meta["mse"][f"lm{bits} (analytic marginal)"] = mse
        print(f"Lloyd-Max {bits} bits: MSE {mse:.5f}, centroids {np.round(c, 4).tolist()}")

    g = torch.Generator().manual_seed(args.seed)
    if args.synthetic:
        train = torch.randn(2 * args.groups, GROUP, generator=g)
        held = torch.randn(args.groups // 2, GROUP, generator=g)
        meta["data"] = f"synthetic N(0,1): {2 * args.groups} training groups"
    else:
        import argparse as _argparse_mod
        import pydoc_data.topics as _topics
        texts = [Path(_argparse_mod.__file__).read_text(encoding="utf-8"),
                 Path(_topics.__file__).read_text(encoding="utf-8")]
        import tempfile
        tmp = Path(tempfile.mkdtemp()) / "provisional.npz"
        _use_tables({**out, "tcq3": np.zeros(512, np.float32), "tcq2": np.zeros(256, np.float32)}, tmp)
        train_parts, held_parts = [], []
        for name in ("demo", "gemma3-270m"):
            rows = dump_kv(name, texts, args.tokens)
            groups = torch.cat([normalised_groups(r, rot) for r in rows])
            perm = torch.randperm(groups.shape[0], generator=g)
            n_held = args.groups // 4
            train_parts.append(groups[perm[:args.groups]])
            held_parts.append(groups[perm[args.groups:args.groups + n_held]])
            print(f"{name}: {groups.shape[0]} K/V groups, kept {args.groups} + {n_held} held out")
        train = torch.cat(train_parts)
        held = torch.cat(held_parts)
        meta["data"] = (f"K and V rows as a turbo4 cache encodes them (keys centered and smoothed) in every attention layer "
                        f"of SmolLM2-135M-Instruct Q4_1 and Gemma-3-270M Q4_K_M reading the first {args.tokens} tokens of "
                        f"CPython {sys.version.split()[0]}'s Lib/argparse.py and Lib/pydoc_data/topics.py (256-token chunks, "
                        f"turbo4 KV cache); rotated, normalised 128-groups; "
                        f"{args.groups} random groups per model for training, {args.groups // 4} others held out")
    for bits, L in ((3, 9), (2, 8)):
        cb = train_tcq(train, L, bits, args.iters, args.seed + bits)
        out[f"tcq{bits}"] = cb.numpy().astype(np.float32)
        meta["mse"][f"tcq{bits} (held-out KV)"] = tcq_mse(held, cb, L, bits)
        meta["mse"][f"lm{bits} (held-out KV)"] = scalar_mse(held, out[f"lm{bits}"])
    meta["mse"]["lm4 (held-out KV)"] = scalar_mse(held, out["lm4"])
    gauss = torch.randn(2000, GROUP, generator=torch.Generator().manual_seed(1))
    for bits, L in ((3, 9), (2, 8)):
        meta["mse"][f"tcq{bits} (N(0,1))"] = tcq_mse(gauss, torch.from_numpy(out[f"tcq{bits}"]), L, bits)
    meta["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **out)
    Path(args.out).with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
