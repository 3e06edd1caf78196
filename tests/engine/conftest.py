"""Fixtures shared by the engine tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    """tiny(arch) -> the path of a tiny synthetic GGUF of that architecture, written on first use, once per
    test module, with the module's TINY_SEED (each module keeps the weights its tolerances were measured on)."""
    from engine.tools.synth import write_synthetic
    seed = request.module.TINY_SEED
    d = tmp_path_factory.mktemp("tiny")
    paths = {}

    def get(arch: str):
        if arch not in paths:
            paths[arch] = d / f"{arch}.gguf"
            write_synthetic(paths[arch], arch, "tiny", seed=seed)
        return paths[arch]
    return get
