"""The turbo codecs' tables, made by engine/tools/train_codebooks.py and stored in
resources/codebooks/turbo_codebooks.npz (resources/codebooks/README.md says how):
  signs1, signs2  int8 [128]  the rotation's random signs (rotation.py)
  lm2, lm3, lm4   float32     Lloyd-Max centroids (ascending) for one coordinate of a rotated
                              unit-norm 128-vector, scaled by sqrt(128) (so ~N(0, 1))
  tcq2, tcq3      float32     the trellis codebooks, one value per state (256 and 512 states),
                              same scale
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

CODEBOOK_DIR = Path(__file__).resolve().parents[2] / "resources" / "codebooks"     # a source checkout
if not CODEBOOK_DIR.is_dir():  # an installed wheel: pyproject's data-files put resources in <prefix>/share/hivejet
    CODEBOOK_DIR = Path(sys.prefix) / "share" / "hivejet" / "resources" / "codebooks"
CODEBOOK_FILE = CODEBOOK_DIR / "turbo_codebooks.npz"


@functools.lru_cache(maxsize=4)
def load_codebooks(path: str | None = None) -> dict[str, np.ndarray]:
    p = Path(path) if path else CODEBOOK_FILE
    if not p.exists():
        raise FileNotFoundError(f"{p}: turbo codebooks missing; make them with "
                                "`python -m engine.tools.train_codebooks` (see resources/codebooks/README.md)")
    with np.load(p) as d:
        return {k: d[k] for k in d.files}
