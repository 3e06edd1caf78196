"""One module per architecture family; `load_model` picks the class from general.architecture."""
from __future__ import annotations

import os

from engine.gguf.reader import GGUFError, GGUFFile
from engine.gguf.spec import spec_from_gguf
from engine.models.common import DecoderModel
from engine.models.gemma3 import Gemma3Model
from engine.models.llama import LlamaModel, Qwen2Model, Qwen3Model
from engine.models.qwen35 import Qwen35Model

ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "gemma3": Gemma3Model,
    "qwen2": Qwen2Model,
    "qwen3": Qwen3Model,
    "qwen35": Qwen35Model,
}


def open_model(path: str | os.PathLike) -> DecoderModel:
    """Open a GGUF model file. On any error the file is closed again and one GGUFError is raised
    naming the file and the problem; nothing half-loaded stays behind."""
    f = GGUFFile(path)
    try:
        arch = f.architecture
        cls = ARCHITECTURES.get(arch)
        if cls is None:
            raise GGUFError(f.path, f"unknown architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
        return cls(f, spec_from_gguf(f))
    except BaseException:
        f.close()
        raise
