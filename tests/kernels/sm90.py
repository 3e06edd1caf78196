"""Compiling Triton kernels for the H200 (sm_90) on a machine without a GPU: Triton's own compiler and
ptxas, in a process without TRITON_INTERPRET (the test session sets it, and Triton reads it when a kernel
is defined). `sm90_figures` runs such a script in a subprocess: it prints its figures on its last line, or
exits with 3 when it cannot compile here (then the test skips). `compile_decode_matmul` is what those
scripts (and .ci/gpu/sass_stats.py) compile."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sm90_figures(script: str, *args: str) -> list[int]:
    """The integers on the last line the script prints (run with `args`, from the repository's root)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stderr[-2000:]
    return [int(v) for v in r.stdout.strip().splitlines()[-1].split()]


# the decode matmul's pointer arguments as packed_matmul passes them (x rounded to fp16, float32 out)
_MM_POINTERS = dict(x_ptr="*fp16", lo_ptr="*u8", hi_ptr="*u8", s_ptr="*fp16", m_ptr="*fp16", sup_ptr="*fp16",
                    part_ptr="*fp32", out_ptr="*fp32", add_ptr="*fp32", cnt_ptr="*i32")


def compile_decode_matmul(qtype: str, tile_n: int, tile_k: int = 128, k: int = 5120, *, num_warps: int = 4,
                          num_stages: int = 3, swap_ab: bool = True, split: int = 4, pdl: bool = False,
                          prefetch: int = 0, maxnreg: int | None = None, block_m: int = 16):
    """kernels/quant/packed.py's decode matmul for a [tile_n, k] weight of GGUF type `qtype` packed as the
    engine packs it (its layout's constants from `kernel_constants`), compiled for sm_90: the
    CompiledKernel (asm["ptx"], asm["cubin"]). pdl, prefetch: as packed_matmul launches it with
    programmatic dependent launch (kernels/pdl.py); maxnreg: a cap on the registers per thread; block_m: the
    rows of x per program (wide_decode_rows). Call it in a process without TRITON_INTERPRET."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gguf import GGMLQuantizationType as QT
    from kernels.quant.packed import _packed_mm_kernel as fn
    from kernels.quant.packed import kernel_constants
    from kernels.quant.packing import pack_weight
    from tests.kernels.test_packed import _random_weight
    qt = QT[qtype]
    p = pack_weight(_random_weight(qt, tile_n, k), qt, tile_n, k, tile_n=tile_n, tile_k=tile_k)
    const = dict(kernel_constants(p), BLOCK_M=block_m, SWAP_AB=swap_ab, FAST_CVT=True, TMA=False, SPLIT=split,
                 SUM_HERE=split > 1, HAS_ADD=False, PDL=pdl, PREFETCH=prefetch)
    sig = {n: "constexpr" if n in const else _MM_POINTERS.get(n, "i32") for n in fn.arg_names}
    # what the launcher specializes: pointers and the row stride divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in _MM_POINTERS or n == "stride_xm"}
    return triton_compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **(dict(maxnreg=maxnreg) if maxnreg else {})))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump FLAG on a compiled kernel (the cuobjdump of Triton's wheel, else the CUDA toolkit's)."""
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def sass_of(cubin: bytes) -> str:
    """A compiled kernel's SASS."""
    return _cuobjdump(cubin, "-sass")


def resource_usage(cubin: bytes) -> dict:
    """cuobjdump's resource usage of a compiled kernel: {"REG": registers per thread, "STACK": bytes of
    stack frame (spills), ...}."""
    import re
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", _cuobjdump(cubin, "-res-usage"))}
