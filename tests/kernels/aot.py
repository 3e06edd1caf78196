"""Compiling the registry's launches (kernels/launches.py) ahead of time for GPU families on a machine without a
GPU: Triton's compiler with an explicit target and its bundled ptxas, then each compiled kernel's shared memory
(Triton's allocation plus any static shared memory) and registers and spill stack (cuobjdump -res-usage).

Triton lowers a kernel for sm_80, sm_86 and sm_89 through the same passes (the same layouts, the same shared
memory; its PTX differs only in the .target line: `same_ptx` checks that on this Triton), so a launch is
compiled once for sm_86 and its PTX assembled by ptxas for sm_80 and sm_89 as well: about a third of the time
of three compiles. sm_120 takes other passes and is compiled on its own.

Runs in worker processes without TRITON_INTERPRET (Triton reads it when a kernel is defined) and with a
Triton cache made fresh per run (nothing cached across runs can hide a failure)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# compile classes: (the arch Triton compiles for, {family: archs assembled from that PTX by ptxas})
CLASSES = ((86, {"sm80": (80,), "sm86": (86, 89)}), (120, {"sm120": (120,)}))


def worker_init(cache_dir: str) -> None:
    """A compile worker's environment: the repository importable, no interpreter, its own Triton cache."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    if REPO not in sys.path:
        sys.path.insert(0, REPO)


_REGISTRIES: dict = {}


def registry(family_name: str) -> list:
    """The family's launches, deduplicated by Launch.key (first name kept)."""
    if family_name not in _REGISTRIES:
        from kernels.family import FAMILIES
        from kernels.launches import all_launches
        seen, out = set(), []
        for launch in all_launches(FAMILIES[family_name]):
            if launch.key not in seen:
                seen.add(launch.key)
                out.append(launch)
        _REGISTRIES[family_name] = out
    return _REGISTRIES[family_name]


def jobs() -> list[tuple]:
    """One job per distinct compile: (family whose registry holds the launch, its index, the arch compiled
    for, ((family, arch) figured from that compile, ...))."""
    out = []
    for base, targets in CLASSES:
        by_key: dict = {}
        for fam, archs in targets.items():
            for i, launch in enumerate(registry(fam)):
                job = by_key.setdefault(launch.key, [fam, i, base, []])
                job[3] += [(fam, a) for a in archs]
        out += [(f, i, b, tuple(t)) for f, i, b, t in by_key.values()]
    return out


def _launch_compile(launch, arch: int):
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(launch.fn.arg_names) if n in launch.divisible}
    return triton_compile(ASTSource(launch.fn, launch.signature, launch.constants, attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def _ptxas(ptx: str, arch: int, fp_fusion: bool = True) -> bytes:
    """PTX assembled for sm_<arch> the way Triton assembles it (its bundled ptxas, -lineinfo -v)."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptx = re.sub(r"\.target sm_\d+a?", f".target sm_{arch}", ptx, count=1)
    with tempfile.TemporaryDirectory() as d:
        src, binary = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               f"--gpu-name=sm_{arch}", src, "-o", binary]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        with open(binary, "rb") as f:
            return f.read()


def compile_figures(job: tuple) -> list[dict]:
    """A job of `jobs()` compiled: per (family, arch) its figures {family, arch, name, shared, regs, stack,
    local, seconds} or {family, arch, name, error}."""
    from tests.kernels.sm90 import resource_usage
    family_name, index, base, targets = job
    launch = registry(family_name)[index]
    t0 = time.perf_counter()
    try:
        k = _launch_compile(launch, base)
    except Exception as e:   # the test reports it with the launch's name
        return [dict(family=f, arch=a, name=launch.name, error=f"{type(e).__name__}: {str(e)[-600:]}")
                for f, a in targets]
    out = []
    for fam, arch in targets:
        try:
            cubin = k.asm["cubin"] if arch == base else _ptxas(k.asm["ptx"], arch, k.metadata.enable_fp_fusion)
            usage = resource_usage(cubin)
        except Exception as e:
            out.append(dict(family=fam, arch=arch, name=launch.name, error=f"{type(e).__name__}: {str(e)[-600:]}"))
            continue
        out.append(dict(family=fam, arch=arch, name=launch.name, shared=int(k.metadata.shared) + usage.get("SHARED", 0),
                        regs=usage.get("REG", 0), stack=usage.get("STACK", 0), local=usage.get("LOCAL", 0),
                        seconds=time.perf_counter() - t0))
    return out


def same_ptx(family_name: str, index: int, archs=(80, 86, 89)) -> bool:
    """Whether Triton gives one launch the same PTX for every arch of a compile class (but the .version and
    .target lines)."""
    launch = registry(family_name)[index]
    texts = {re.sub(r"^\.(version|target) .*$", "", _launch_compile(launch, a).asm["ptx"], flags=re.M)
             for a in archs}
    return len(texts) == 1
