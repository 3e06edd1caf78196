"""Time the vision tower on one image: `python -m engine.tools.bench_vision [--mmproj FILE] [--size 1024x768]
[--device cuda]`. Without --mmproj it writes a synthetic projector of a real model's shape first
(default: Qwen3.5-27B's, 1152 wide x 27 blocks, F16). Reports preprocessing and encoder time
(median of --repeat runs after one warm-up), the patch and token counts."""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def bench(mmproj: str, width: int, height: int, device: str = "cpu", repeat: int = 3) -> dict:
    from PIL import Image

    from engine.vision import open_mmproj
    enc = open_mmproj(mmproj, device=device)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    t0 = time.perf_counter()
    prep = enc.prepare(img)
    prep_ms = 1000 * (time.perf_counter() - t0)
    enc.encode(prep)            # warm-up (kernel selection, allocator)
    sync()
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        out = enc.encode(prep)
        sync()
        times.append(1000 * (time.perf_counter() - t0))
    res = dict(projector=enc.projector, device=device, image=f"{width}x{height}",
               resized=f"{prep.pixels.shape[2]}x{prep.pixels.shape[1]}",
               patches=(prep.pixels.shape[1] // enc.patch) * (prep.pixels.shape[2] // enc.patch),
               tokens=int(out.shape[0]), n_params=enc.n_params, preprocess_ms=round(prep_ms, 2),
               encode_ms=round(statistics.median(times), 2), encode_ms_all=[round(t, 2) for t in times])
    enc.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.bench_vision", description=__doc__)
    ap.add_argument("--mmproj", help="projector file (default: a synthetic one, see --preset)")
    ap.add_argument("--preset", default="qwen35-27b", help="synthetic projector shape: qwen35-27b or gemma3-4b")
    ap.add_argument("--size", default="1024x768", help="image size WxH")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: the engine's, all cores)")
    a = ap.parse_args(argv)
    from engine.engine import default_threads
    torch.set_num_threads(a.threads or default_threads())
    w, h = (int(x) for x in a.size.lower().split("x"))
    with tempfile.TemporaryDirectory() as d:
        path = a.mmproj
        if path is None:
            from engine.tools.synth_mmproj import write_mmproj
            proj = "gemma3" if a.preset.startswith("gemma3") else "qwen3vl_merger"
            path = str(Path(d) / "mmproj.gguf")
            write_mmproj(path, proj, a.preset, weight_type="F16")
        r = bench(path, w, h, a.device, a.repeat)
    print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
