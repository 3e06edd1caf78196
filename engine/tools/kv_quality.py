"""The KV cache quality table of docs/KV_CACHE.md: `hivejet perplexity` with each cache type against
our own f16-cache run (its full log-probs saved in llama.cpp's binary --kl-divergence-base format).

    python -m engine.tools.kv_quality --out /tmp/kvq [--models demo gemma3-270m] [--texts gpl3 heapq_py]

Runs, per model and text: the f16 base (`--save-kl-divergence-base`), then every cache type with
`-ctk T -ctv T` (plus mixes) against it; ctx 256, 6 chunks, -b 256 like ../shared/reference.
Each run's output is kept in OUT/MODEL.TEXT.K-V.txt (existing files are reused), and the table is
printed as markdown.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"
TYPES = [("q8_0", "q8_0"), ("turbo4", "turbo4"), ("turbo3", "turbo3"), ("turbo3_tcq", "turbo3_tcq"),
         ("turbo2", "turbo2"), ("turbo2_tcq", "turbo2_tcq"), ("q8_0", "turbo4"), ("q8_0", "turbo3"),
         ("q8_0", "turbo3_tcq")]
SHORT = {"demo": "SmolLM2-135M", "gemma3-270m": "Gemma-3-270M"}


KEY_SETTINGS: dict[str, object] = {}   # SequenceKV class settings for the child runs (--plain-keys, --smooth-clamp)


def _run(args: list[str], out: Path) -> str:
    """`hivejet ARGS` in a child process, as a user runs it (the tools do not import the app), with
    KEY_SETTINGS applied to SequenceKV there first."""
    if out.exists():
        return out.read_text()
    t0 = time.time()
    child = ("import sys\nfrom engine.kv import SequenceKV\n"
             + "".join(f"SequenceKV.{k} = {v!r}\n" for k, v in KEY_SETTINGS.items())
             + "from app.cli import main\nsys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"hivejet {' '.join(args)} failed: {r.stderr[-2000:]}")
    text = r.stdout + f"\n# {time.time() - t0:.0f} s: hivejet {' '.join(args)}\n"
    out.write_text(text)
    return text


def parse(text: str) -> dict:
    def f(pat):
        m = re.search(pat, text)
        return float(m.group(1)) if m else None
    return {"ppl": f(r"Final estimate: PPL = ([0-9.]+)"), "kld": f(r"Mean\s+KLD:\s+([0-9.]+)"),
            "median": f(r"Median\s+KLD:\s+([0-9.]+)"), "same": f(r"Same top p:\s+([0-9.]+)"),
            "ratio": f(r"PPL\(Q\)/PPL\(base\)\s+:\s+([0-9.]+)")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/kvq")
    ap.add_argument("--models", nargs="+", default=["demo", "gemma3-270m"])
    ap.add_argument("--texts", nargs="+", default=["gpl3", "heapq_py"])
    ap.add_argument("--reference", default=str(REFERENCE))
    ap.add_argument("-t", "--threads", default="0")
    ap.add_argument("--types", nargs="+", default=None, help="K/V pairs as K:V (default: all of TYPES)")
    ap.add_argument("--plain-keys", action="store_true",
                    help="turn the key preconditioning (centering + smoothing) off; runs get a '.plain' suffix")
    ap.add_argument("--smooth-clamp", type=float, default=None,
                    help="SequenceKV.SMOOTH_CLAMP for these runs (files get a '.cX' suffix)")
    args = ap.parse_args(argv)
    types = [tuple(t.split(":")) if ":" in t else (t, t) for t in args.types] if args.types else TYPES
    suffix = ""
    if args.plain_keys:
        KEY_SETTINGS["PRECONDITION_KEYS"] = False
        suffix = ".plain"
    if args.smooth_clamp is not None:
        KEY_SETTINGS["SMOOTH_CLAMP"] = args.smooth_clamp
        suffix += f".c{args.smooth_clamp:g}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for text in args.texts:
            common = ["perplexity", "-m", model, "-f", str(Path(args.reference) / "texts" / f"{text}.txt"),
                      "-c", "256", "--chunks", "6", "-b", "256", "-t", args.threads]
            base = out / f"{model}.{text}.f16.kld"
            if not base.exists():
                (out / f"{model}.{text}.f16-f16.txt").unlink(missing_ok=True)
            r = parse(_run(common + ["--save-kl-divergence-base", str(base)], out / f"{model}.{text}.f16-f16.txt"))
            print(f"{model} {text} f16: PPL {r['ppl']}", file=sys.stderr, flush=True)
            for kt, vt in types:
                r = parse(_run(common + ["--kl-divergence-base", str(base), "-ctk", kt, "-ctv", vt],
                               out / f"{model}.{text}.{kt}-{vt}{suffix}.txt"))
                rows.append((model, text, kt, vt, r))
                print(f"{model} {text} {kt}/{vt}: {r}", file=sys.stderr, flush=True)
    print("| model | text | K / V | mean KLD | median KLD | same top | PPL ratio |")
    print("|---|---|---|---|---|---|---|")
    for model, text, kt, vt, r in rows:
        kv = kt if kt == vt else f"{kt} / {vt}"
        print(f"| {SHORT.get(model, model)} | {text} | {kv} | {r['kld']:.6f} | {r['median']:.6f} | "
              f"{r['same']:.3f} % | {r['ratio']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
