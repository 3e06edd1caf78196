"""kernels/quant/intdot.py: the CPU path's integer matmul. Its repacked weights give dequantize()'s bits, the numba
kernels (kernels/quant/intdot_numba.py) give their torch reference's bits (activations, decode rows and many
rows), a row's result does not depend on the rows beside it, and the result is llama.cpp's product."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from kernels.quant import activations_like_llamacpp, block_mins, dequantize
from kernels.quant.intdot import FEW_ROWS, INT_TYPES, IntWeight, int_activations, int_matmul
from tests.kernels.test_quant_ref import _rng, finite_f16_bits, make_tensor

TYPES = sorted(INT_TYPES, key=int)
numba_kernels = pytest.mark.skipif(not __import__("kernels.quant.intdot_numba", fromlist=["x"]).available(),
                                   reason="numba is not installed")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaN where the other has NaN (large activations overflow the fp16 block sums, as in llama.cpp)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _weight(qtype, n_out: int, blocks: int, seed: int, scale_range=(1e-3, 1e-1)):
    block = GGML_QUANT_SIZES[qtype][0]
    n_in = blocks * block
    raw = torch.from_numpy(make_tensor(qtype, (n_out, n_in), _rng(int(qtype), seed), scale_range=scale_range))
    return raw, n_in


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacked_weights_dequantize_to_the_same_bits(qtype):
    """float32(a * q) + c of the repacked integers is dequantize()'s value, bit for bit (any fp16 scale bits, and
    an output count that is not a multiple of the tile)."""
    raw, n_in = _weight(qtype, 70, 2, 1)
    blocks = raw.view(-1, GGML_QUANT_SIZES[qtype][1]).numpy()
    for off in range(0, 4, 2):   # random finite fp16 bit patterns in the first scale fields too
        if qtype not in (QT.Q2_K, QT.Q3_K, QT.Q6_K):
            blocks[:, off:off + 2] = finite_f16_bits(_rng(off, int(qtype)), blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    w = IntWeight(raw, qtype, 70, n_in)
    assert torch.equal(w.dequantized().view(torch.int32), dequantize(raw, qtype, (70, n_in)).view(torch.int32))


def _activations(n_rows: int, n_in: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n_rows * 7 + n_in)
    x = torch.randn(n_rows, n_in, generator=g) * torch.logspace(-6, 4, n_rows)[:, None]
    x[0, :32] = 0                       # an all-zero block
    if n_rows > 2:
        x[2, 3] = 1e-42                 # a subnormal
        x[2, 40:72] = 0.5               # equal values: ties in the argmax
    return x


@numba_kernels
@pytest.mark.parametrize("qtype,group", [(QT.Q4_0, 32), (QT.Q4_1, 32), (QT.Q5_1, 32), (QT.Q8_0, 32),
                                         (QT.Q4_K, 32), (QT.Q6_K, 16)], ids=str)
def test_numba_activations_give_the_reference_bits(qtype, group):
    x = _activations(7, 512)
    ref, fast = int_activations(x, qtype, group), int_activations(x, qtype, group, fast=True)
    for r, f in zip(ref, fast):
        assert _same(r, f)


def test_activation_integers_times_scales_are_llamacpp_rounding():
    """intdot's integers times their scale are the values activations_like_llamacpp gives (Q8_0 and Q8_K)."""
    x = _activations(5, 512)
    for qtype, group in ((QT.Q8_0, 32), (QT.Q4_K, 32), (QT.Q6_K, 16)):
        xq, dx, _, _ = int_activations(x, qtype, group)
        vals = (xq.double().view(5, -1, group) * dx[..., None]).view(5, 512).float()
        assert torch.equal(vals, activations_like_llamacpp(x, qtype)[0])


@numba_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_numba_matmul_gives_the_reference_bits_whatever_the_batch(qtype):
    """Decode rows (the few-row numba kernel), many rows (the many-row numba kernel) and torch alone: the same
    bits, and each row's result the same alone as in a batch of 9 (the runner's batches)."""
    raw, n_in = _weight(qtype, 130, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 8, 2)
    w = IntWeight(raw, qtype, 130, n_in)
    x = _activations(9, n_in)
    ref = int_matmul(x, w, fast=False)
    assert ref.shape == (9, 130) and ref.dtype == torch.float32
    assert _same(int_matmul(x, w, fast=True), ref)
    assert _same(int_matmul(x[:FEW_ROWS], w, fast=True), ref[:FEW_ROWS])
    for i in range(9):
        assert _same(int_matmul(x[i:i + 1], w, fast=True), ref[i:i + 1])
        assert _same(int_matmul(x[i:i + 1], w, fast=False), ref[i:i + 1])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_integer_matmul_is_the_rounded_activations_times_the_weights(qtype):
    """The same product as activations_like_llamacpp's values times dequantize()'s weights summed in float64 (plus
    the Q8_1 block-sum term for Q4_1 / Q5_1), to float32 rounding."""
    raw, n_in = _weight(qtype, 40, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 8, 3)
    x = _activations(6, n_in) / 100   # no fp16 overflow in the block sums here
    xa, err = activations_like_llamacpp(x, qtype)
    want = xa.double() @ dequantize(raw, qtype, (40, n_in)).double().T
    if err is not None:
        want = want + err.double() @ block_mins(raw, qtype, 40, n_in).double().T
    got = int_matmul(x, IntWeight(raw, qtype, 40, n_in), fast=False)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6 * float(want.abs().max()))


def test_reference_in_column_chunks(monkeypatch):
    """The torch reference's many-row product cut into column chunks (its block dots over P_BYTES) gives the same
    bits."""
    import kernels.quant.intdot as intdot
    raw, n_in = _weight(QT.Q4_1, 300, 4, 4)
    w = IntWeight(raw, QT.Q4_1, 300, n_in)
    x = _activations(20, n_in)
    whole = int_matmul(x, w, fast=False)
    monkeypatch.setattr(intdot, "P_BYTES", 1)   # one tile per chunk
    assert _same(int_matmul(x, w, fast=False), whole)


@numba_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_many_rows_whatever_the_threads_and_row_chunks(qtype):
    """The many-row kernel splits its rows into chunks by the thread count and the tile count: every split gives the
    reference's bits, and a row's result is the same in any batch."""
    raw, n_in = _weight(qtype, 70, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 8, 6)
    w = IntWeight(raw, qtype, 70, n_in)
    x = _activations(100, n_in)
    ref = int_matmul(x, w, fast=False)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (5, 17, 64, 100):
                assert _same(int_matmul(x[:m], w, fast=True), ref[:m])
            assert _same(int_matmul(x[40:57], w, fast=True), ref[40:57])
    finally:
        torch.set_num_threads(threads)


@numba_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q6_K], ids=lambda t: t.name)
def test_parallel_few_rows_give_the_same_bits(qtype, monkeypatch):
    """A few-row product spread over numba's threads (a large matrix) gives the one-thread kernel's bits."""
    import kernels.quant.intdot_numba as intdot_numba
    raw, n_in = _weight(qtype, 300, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 8, 5)
    w = IntWeight(raw, qtype, 300, n_in)
    x = _activations(3, n_in)
    one = int_matmul(x, w)
    monkeypatch.setattr(intdot_numba, "PARALLEL_MACS", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _same(int_matmul(x, w), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_stacked_weights_give_each_parts_own_product(qtype):
    """stack_int_weights: the parts' columns of the stack's product are each part's product to the bit (decode rows
    and many rows, numba and torch), output counts that are not a multiple of the tile included."""
    from kernels.quant.intdot import stack_int_weights
    parts = []
    for seed, n_out in enumerate((64, 70, 128)):
        raw, n_in = _weight(qtype, n_out, 2, 10 + seed)
        parts.append(IntWeight(raw, qtype, n_out, n_in))
    stack, cols = stack_int_weights(parts)
    assert cols == [0, 64, 192] and stack.n_pad == 320
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 40):
        x = torch.randn(m, parts[0].n_in, generator=g)
        for fast in ({False, True} if __import__("kernels.quant.intdot_numba", fromlist=["x"]).available() else {False}):
            y = int_matmul(x, stack, fast)
            for w, c in zip(parts, cols):
                assert torch.equal(y[:, c:c + w.n_out], int_matmul(x, w, fast))
    raw, n_in = _weight(qtype, 64, 1, 20)
    with pytest.raises(ValueError):
        stack_int_weights([parts[0], IntWeight(raw, qtype, 64, n_in)])
