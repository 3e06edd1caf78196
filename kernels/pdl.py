"""Programmatic dependent launch (PDL, Hopper sm_90 and later) for the decode step's Triton kernels.

A decode step is ~960 kernels in one CUDA graph; most are small (a norm, a gate: 1-3 us) and each
matmul spends its first microsecond or two waiting for its first weight bytes. With PDL a kernel is
launched while the one before it still runs: it triggers its successor early
(`griddepcontrol.launch_dependents`), and the successor, already resident, does the work that does
not depend on its predecessor, then waits (`griddepcontrol.wait`: the predecessor has completed and
its writes are visible) before touching anything the predecessor wrote or reads. The packed matmul
uses the time to start its weights streaming into L2 (`prefetch_l2`): weights never change, so that
is safe before the wait.

Rules that keep it correct:
- a kernel launched with PDL (`pdl_args(...)` in its launch) calls `pdl_enter` (or `pdl_wait`)
  before its first load of an activation and its first store: every kernel then completes after
  everything before it, so the usual stream order holds transitively (torch's kernels, launched
  without PDL, wait for full completion as always);
- PDL is on only for CUDA devices of the sm90 family (kernels/family.py: the instructions do not exist before
  sm_90, and on sm_100/sm_120, which have them, the path was never run) and never under Triton's interpreter
  (~7 % of a decode step, docs/decisions/programmatic-dependent-launch.md). A 27B prompt's prefill that is not
  the same bits twice is not a PDL launch-order problem: the packed matmul compiled with its L2 prefetch in
  64-row blocks of x gives another result nearly every run, launched with PDL or not, so the prefetch is kept
  to 16-row blocks (kernels/quant/packed.py: prefetch_tiles).
"""
from __future__ import annotations

import os

import torch

from kernels.family import device_family

try:
    import triton
    import triton.language as tl
except ImportError:          # no Triton: nothing launches these kernels
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:          # a Triton without grid dependency control (before 3.4): PDL stays off
    HAVE_GDC = False

# PDL wherever the family and Triton have it: no setting turns it off (the launch attribute is in every CUDA 12
# driver torch runs on; docs/decisions/programmatic-dependent-launch.md). Tests and .ci/gpu/sweep_pdl.py set
# ENABLED to compare against launches without it.
ENABLED = HAVE_GDC and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _capable(device_index: int) -> bool:
    return device_family(device_index).hopper_paths


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (read at each launch: ENABLED may be switched)."""
    return ENABLED and t.is_cuda and _capable(t.device.index if t.device.index is not None
                                              else torch.cuda.current_device())


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` argument, for a launch on t's device."""
    if not pdl_on(t):
        return {}
    return dict(PDL=1, launch_pdl=True)


if triton is not None:
    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        """Let the next kernel launch (once every program of this one has got here or ended)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait until the previous kernel has completed and its writes are visible."""
        if PDL:
            gdc_wait()

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """pdl_trigger, then pdl_wait: a kernel with nothing to do before its inputs are there. (Waiting
        first, as CUTLASS-style kernels do, measured 0.5 % slower: docs/decisions/programmatic-dependent-launch.md.)"""
        pdl_trigger(PDL)
        pdl_wait(PDL)

    @triton.jit
    def prefetch_l2(ptr, nbytes):
        """Thread 0 of the program asks the TMA unit to bring nbytes at ptr into L2
        (cp.async.bulk.prefetch, sm_90+; ptr 16-byte aligned, nbytes a multiple of 16). A hint: it
        loads nothing into registers and cannot change the kernel's result."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
            " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
