"""Opening mmproj (vision projector) GGUF files, pairing them with a model, and sizing them.

An mmproj file is llama.cpp's multimodal projector format: `general.architecture = "clip"`, the
projector type in `clip.projector_type` (or `clip.vision.projector_type` when the file also holds
an audio encoder), hyper-parameters under `clip.vision.*`, tensors named `v.*` (the vision tower)
and `mm.*` (the projector). See tools/mtmd/clip.cpp and clip-impl.h in llama.cpp.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from engine.gguf.reader import GGUFError, GGUFFile
from engine.vision.encoders import ENCODERS, MmprojError, VisionEncoder, mmproj_facts, projector_type

# which language-model architectures each projector feeds (general.architecture of the model file)
PROJECTOR_ARCHS: dict[str, tuple[str, ...]] = {
    "qwen3vl_merger": ("qwen35", "qwen35moe", "qwen3vl", "qwen3vlmoe"),
    "gemma3": ("gemma3",),
}


def open_mmproj(path: str | os.PathLike, device: str = "cpu", **options) -> VisionEncoder:
    """Load a vision projector. Projector types other than qwen3vl_merger and gemma3 raise a
    MmprojError saying they are not supported yet. `options` go to the encoder (gemma3:
    resize="letterbox"|"stretch")."""
    f = GGUFFile(path)
    try:
        proj = projector_type(f)
        cls = ENCODERS.get(proj)
        if cls is None:
            raise MmprojError(f.path, f"vision projector type {proj!r} is not supported yet "
                                      f"(supported: {', '.join(sorted(ENCODERS))})")
        return cls(f, device, **options)
    except BaseException:
        f.close()
        raise


def check_pair(enc: VisionEncoder, arch: str, n_embd: int) -> None:
    """Raise MmprojError if this projector cannot feed a model of this architecture and width."""
    ok = PROJECTOR_ARCHS.get(enc.projector, ())
    if arch not in ok:
        raise MmprojError(enc.path, f"a {enc.projector} projector belongs to a {' / '.join(ok)} model, "
                                    f"but the loaded model is {arch!r}")
    if enc.n_embd != n_embd:
        raise MmprojError(enc.path, f"the projector outputs {enc.n_embd}-wide embeddings but the model's "
                                    f"are {n_embd} wide: it belongs to another model size")


_PREC_ORDER = ("f16", "bf16", "f32", "q8_0")


def find_mmproj(model_path: str | os.PathLike) -> Path | None:
    """The vision projector that goes with a model file: an `*mmproj*.gguf` in the same folder (a
    Hugging Face repo's snapshot folder holds both). When there are several, the one whose name
    shares most of the model's name wins, then F16 over BF16 over F32 over Q8_0. None if there is
    none. The pick is not opened; `open_mmproj` + `check_pair` decide whether it fits."""
    p = Path(model_path)
    folder = p.parent
    try:
        cands = [c for c in folder.iterdir() if c.is_file() and c.suffix.lower() == ".gguf"
                 and "mmproj" in c.name.lower() and c != p]
    except OSError:
        return None
    if not cands:
        return None
    stem = re.sub(r"[-_.]?(q\d.*|iq\d.*|f16|bf16|f32|ud-.*)$", "", p.stem.lower())

    def score(c: Path):
        name = c.stem.lower()
        common = os.path.commonprefix([name.replace("mmproj-", "").replace("mmproj_", ""), stem])
        prec = next((i for i, t in enumerate(_PREC_ORDER) if name.endswith(t) or f"-{t}" in name), len(_PREC_ORDER))
        return (-len(common), prec, c.name)
    return sorted(cands, key=score)[0]


def mmproj_info(path: str | os.PathLike) -> dict:
    """Facts the model library and the memory planner need, from the header only (nothing loaded):
    projector type, parameter count, tensor bytes (memory the weights take on the device), the
    output width, and `workspace_bytes`: activations while encoding the largest image (float32)."""
    f = GGUFFile(path)
    try:
        return mmproj_facts(f)
    finally:
        f.close()


__all__ = ["ENCODERS", "PROJECTOR_ARCHS", "MmprojError", "GGUFError", "open_mmproj", "check_pair",
           "find_mmproj", "mmproj_facts", "mmproj_info", "projector_type"]
