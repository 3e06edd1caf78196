"""kernels/quant/intdot_vnni.py: the many-row integer matmul with its group dots in bytes (AVX-512 VNNI) gives the
float32-dot kernel's bits and the torch reference's, for every weight type (4-bit nibbles and int8 integers, groups
of 16 and 32), any row count (a last block of fewer than four rows) and row chunk; where numba compiles for a CPU
without the feature it is not used."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.quant.intdot import INT_TYPES, IntWeight, int_matmul
from tests.kernels.test_intdot import _activations, _same, _weight, numba_kernels

TYPES = sorted(INT_TYPES, key=int)
vnni = pytest.mark.skipif(not __import__("kernels.quant.intdot_vnni", fromlist=["x"]).usable(),
                          reason="numba does not compile for a CPU with AVX-512 VNNI here")


def _both(w, x, chunk: int):
    """The VNNI kernel's and the float32 kernel's products of x and w (row chunks of `chunk` rows)."""
    from kernels.quant import intdot_numba as n
    k = n._kernels()
    q, a, c, xq, dx, s, e, _ = n._operands(k, w, x)
    nib, zero = w.zero is not None, int(w.zero or 0)
    outs = []
    for name in ("vnni", "float"):
        out = np.full((x.shape[0], w.n_pad), np.nan, np.float32)
        if name == "vnni":
            k["many_rows_vnni"](q, nib, zero, a, c, xq, xq.view(np.int32), dx, s, e, out, chunk)
        else:
            k["many_rows"](q, nib, zero, a, c, xq, dx, s, e, out, chunk)
        outs.append(torch.from_numpy(out)[:, :w.n_out])
    return outs


@numba_kernels
@vnni
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_vnni_dots_give_the_float_kernels_bits(qtype):
    from gguf import GGML_QUANT_SIZES
    raw, n_in = _weight(qtype, 130, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 8, 3)
    w = IntWeight(raw, qtype, 130, n_in)
    x = _activations(39, n_in)
    ref = int_matmul(x, w, fast=False)
    for chunk in (64, 7):
        got, flt = _both(w, x, chunk)
        assert _same(got, flt)
        assert _same(got, ref)


@numba_kernels
@vnni
def test_the_engine_takes_the_vnni_kernel_for_prompt_rows(monkeypatch):
    """int_matmul of many rows goes through the VNNI kernel where it is usable (and gives the reference's bits)."""
    from gguf import GGMLQuantizationType as QT

    from kernels.quant import intdot_numba as n
    k = n._kernels()
    calls = []
    real = k["many_rows_vnni"]
    monkeypatch.setitem(k, "many_rows_vnni", lambda *a: (calls.append(1), real(*a)))
    raw, n_in = _weight(QT.Q4_1, 70, 8, 4)
    w = IntWeight(raw, QT.Q4_1, 70, n_in)
    x = _activations(20, n_in)
    assert _same(int_matmul(x, w, fast=True), int_matmul(x, w, fast=False))
    assert calls


def test_usable_follows_numbas_target_cpu(monkeypatch):
    """A named target CPU (NUMBA_CPU_NAME=generic: a portable cache) or features without avx512vnni: not usable."""
    from numba.core import config

    from kernels.quant import intdot_vnni
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    monkeypatch.setattr(config, "CPU_NAME", "generic")
    assert not intdot_vnni.usable()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512vnni")
    assert not intdot_vnni.usable()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+avx512f,+avx512vnni")
    assert intdot_vnni.usable()
