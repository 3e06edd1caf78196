"""kernels.quant: torch dequantization must be bit-identical to gguf-py's numpy reference
(gguf.quants.dequantize); bits are compared, not values (so -0.0 != 0.0 and NaN payloads count)."""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

import kernels.quant.ref as ref_module
from kernels.quant import (
    SUPPORTED_TYPES,
    UnsupportedTypeError,
    check_supported,
    dequantize,
    dequantize_rows,
    quantized_matmul_ref,
    row_bytes,
)

DENSE_TYPES = [QT.F32, QT.F16, QT.BF16]
QUANT_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K,
               QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS]
ALL_TYPES = DENSE_TYPES + QUANT_TYPES

# byte offsets of the fp16 scale fields inside one block
F16_FIELDS = {
    QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
    QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208],
    QT.IQ4_NL: [0], QT.IQ4_XS: [0],
}


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([abs(k) for k in key])


def finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random fp16 bit patterns that are finite: any sign, zero, subnormal or normal."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    inf_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_nan] ^= 0x4000  # exponent 31 -> 15
    return bits


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator,
                  scale_range: tuple[float, float] | None = None) -> np.ndarray:
    """uint8 [n_blocks, type_size]: random payload bytes, finite fp16 scale fields (random bit
    patterns, or uniform in scale_range with random sign)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        if scale_range is None:
            bits = finite_f16_bits(rng, n_blocks)
        else:
            v = rng.uniform(*scale_range, n_blocks) * rng.choice([-1.0, 1.0], n_blocks)
            bits = v.astype(np.float16).view(np.uint16)
        raw[:, off:off + 2] = bits.view(np.uint8).reshape(n_blocks, 2)
    return raw


def assert_bits_equal(actual: torch.Tensor, expected: np.ndarray) -> None:
    assert actual.dtype == torch.float32
    assert tuple(actual.shape) == tuple(expected.shape)
    a = actual.detach().cpu().contiguous().numpy().view(np.uint32)
    e = np.ascontiguousarray(expected, dtype=np.float32).view(np.uint32)
    bad = np.flatnonzero(a != e)
    if bad.size:
        i = bad[:5]
        pytest.fail(f"{bad.size} of {a.size} values differ; first at flat {i.tolist()}: "
                    f"got {a.ravel()[i].view(np.float32).tolist()} "
                    f"({[hex(x) for x in a.ravel()[i]]}), "
                    f"expected {e.ravel()[i].view(np.float32).tolist()} "
                    f"({[hex(x) for x in e.ravel()[i]]})")


def make_tensor(qtype: QT, shape: tuple[int, ...], rng: np.random.Generator,
                scale_range: tuple[float, float] | None = None) -> np.ndarray:
    """GGUF bytes (uint8, shape [..., row_bytes]) of a random tensor of torch shape `shape`."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = math.prod(shape) // block
    if qtype in F16_FIELDS:
        raw = random_blocks(qtype, n_blocks, rng, scale_range)
    elif qtype == QT.F32:
        raw = rng.standard_normal(n_blocks, dtype=np.float32).view(np.uint8)
    elif qtype == QT.F16:
        raw = rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8)
    else:  # BF16: the top halves of float32 values
        raw = rng.standard_normal(n_blocks, dtype=np.float32).view(np.uint16)[1::2].copy().view(np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block * type_size)


def expected_dequant(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(shape)


# shapes in blocks along the last dim: one block, one row, several rows, a 3-D tensor
BLOCK_SHAPES = [(1, 1), (1, 4), (3, 2), (3, 4), (2, 3, 2)]


@pytest.mark.parametrize("shape_blocks", BLOCK_SHAPES, ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(qtype, shape_blocks):
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (*shape_blocks[:-1], shape_blocks[-1] * block)
    raw = make_tensor(qtype, shape, _rng(int(qtype), *shape))
    out = dequantize(torch.from_numpy(raw), qtype, shape)
    assert_bits_equal(out, expected_dequant(raw, qtype, shape))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_many_random_blocks(qtype):
    """Enough random blocks to hit every bit of every field many times."""
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (8, 64 * block)
    raw = make_tensor(qtype, shape, _rng(int(qtype), 99))
    assert_bits_equal(dequantize_rows(torch.from_numpy(raw), qtype, shape[1]),
                      expected_dequant(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.BF16],
                         ids=lambda t: t.name)
def test_dequantize_real_quantized_weights(qtype):
    """Weights quantized by gguf-py itself (realistic scales), not just random bytes."""
    w = _rng(int(qtype), 7).standard_normal((16, 256), dtype=np.float32) * 0.05
    raw = gguf.quants.quantize(w, qtype)
    out = dequantize_rows(torch.from_numpy(raw), qtype, 256)
    expected = expected_dequant(raw, qtype, w.shape)
    assert_bits_equal(out, expected)
    assert np.abs(out.numpy() - w).max() < 0.05  # sanity: it is an approximation of w


def test_f32_any_bits():
    raw = _rng(1).integers(0, 256, 4 * 1000, dtype=np.uint8)
    assert_bits_equal(dequantize(torch.from_numpy(raw), QT.F32, (10, 100)),
                      expected_dequant(raw, QT.F32, (10, 100)))


def test_bf16_all_bit_patterns():
    raw = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    assert_bits_equal(dequantize(torch.from_numpy(raw), QT.BF16, (256, 256)),
                      expected_dequant(raw, QT.BF16, (256, 256)))


def test_f16_all_bit_patterns():
    """Every non-NaN fp16 (zeros, subnormals, normals, infinities) converts bit-exactly. NaNs
    stay NaN, but torch's hardware conversion quiets signalling NaNs where numpy keeps their
    bits (and torch's scalar tail path returns a canonical NaN), so NaN bits are not compared."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = dequantize(torch.from_numpy(bits.view(np.uint8)), QT.F16, (1 << 16,))
    expected = expected_dequant(bits.view(np.uint8), QT.F16, (1 << 16,))
    nan = np.isnan(expected)
    assert nan.sum() == 2046
    assert torch.isnan(out[torch.from_numpy(nan)]).all()
    assert_bits_equal(out[torch.from_numpy(~nan)], expected[~nan])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_rows_slice_matches_full(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    n_cols = 3 * block
    raw = torch.from_numpy(make_tensor(qtype, (7, n_cols), _rng(int(qtype), 3)))
    full = dequantize_rows(raw, qtype, n_cols)
    assert full.shape == (7, n_cols)
    assert torch.equal(dequantize_rows(raw[2:5], qtype, n_cols), full[2:5])
    assert torch.equal(dequantize_rows(raw[6:], qtype, n_cols), full[6:])
    ids = torch.tensor([4, 0, 4, 1])  # an embedding lookup: gathered rows
    assert torch.equal(dequantize_rows(raw[ids], qtype, n_cols), full[ids])
    # 1-D bytes of whole rows
    assert torch.equal(dequantize_rows(raw[1:3].reshape(-1), qtype, n_cols), full[1:3])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_misaligned_and_noncontiguous_input(qtype):
    """Bytes at an odd address offset (e.g. a slice of a byte buffer) or in a strided view."""
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (3, 2 * block)
    raw_np = make_tensor(qtype, shape, _rng(int(qtype), 5))
    expected = expected_dequant(raw_np, qtype, shape)
    raw = torch.from_numpy(raw_np)
    buf = torch.zeros(raw.numel() + 1, dtype=torch.uint8)
    buf[1:] = raw.reshape(-1)
    assert_bits_equal(dequantize(buf[1:], qtype, shape), expected)
    wide = torch.zeros(3, raw.shape[1] + 5, dtype=torch.uint8)
    wide[:, 5:] = raw
    assert_bits_equal(dequantize_rows(wide[:, 5:], qtype, shape[1]), expected)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_input_bytes_untouched(qtype):
    """Weights stay memory-mapped; dequantizing must never write to them."""
    block = GGML_QUANT_SIZES[qtype][0]
    raw = torch.from_numpy(make_tensor(qtype, (2, 2 * block), _rng(int(qtype), 17)))
    before = raw.clone()
    dequantize_rows(raw, qtype, 2 * block)
    quantized_matmul_ref(torch.ones(1, 2 * block), raw, qtype, 2, 2 * block)
    assert torch.equal(raw, before)


def test_out_buffer():
    qtype, shape = QT.Q4_K, (4, 512)
    raw = torch.from_numpy(make_tensor(qtype, shape, _rng(11)))
    buf = torch.full((4 * 512,), float("nan"))
    out = dequantize_rows(raw, qtype, 512, out=buf)
    assert out.data_ptr() == buf.data_ptr() and out.shape == shape
    assert torch.equal(out, dequantize_rows(raw, qtype, 512))
    with pytest.raises(ValueError, match="out"):
        dequantize_rows(raw, qtype, 512, out=torch.empty(10))


def test_wrong_byte_count():
    raw = torch.zeros(row_bytes(QT.Q8_0, 64) * 2 + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw, QT.Q8_0, (2, 64))
    with pytest.raises(ValueError, match="block size"):
        dequantize(torch.zeros(34, dtype=torch.uint8), QT.Q8_0, (1, 31))


def test_supported_types():
    assert SUPPORTED_TYPES == frozenset(ALL_TYPES)
    for t in ALL_TYPES:
        check_supported(t)
        check_supported(int(t))


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.TQ1_0, QT.Q8_1, QT.IQ1_S],
                         ids=lambda t: t.name)
def test_unsupported_type(qtype):
    assert issubclass(UnsupportedTypeError, ValueError)
    with pytest.raises(UnsupportedTypeError, match=qtype.name):
        check_supported(qtype)
    with pytest.raises(UnsupportedTypeError, match=qtype.name):
        check_supported(int(qtype))
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.zeros(type_size, dtype=torch.uint8)
    with pytest.raises(UnsupportedTypeError, match=qtype.name):
        dequantize(raw, qtype, (1, block))
    with pytest.raises(UnsupportedTypeError, match=qtype.name):
        dequantize_rows(raw.view(1, -1), qtype, block)
    with pytest.raises(UnsupportedTypeError, match=qtype.name):
        quantized_matmul_ref(torch.zeros(1, block), raw, qtype, 1, block)


def test_unknown_type_id():
    with pytest.raises(UnsupportedTypeError, match="9999"):
        check_supported(9999)


def test_row_bytes():
    assert row_bytes(QT.F32, 10) == 40
    assert row_bytes(QT.F16, 10) == 20
    assert row_bytes(QT.BF16, 10) == 20
    assert row_bytes(QT.Q8_0, 576) == 18 * 34
    assert row_bytes(QT.Q4_0, 64) == 36
    assert row_bytes(QT.Q4_1, 576) == 18 * 20
    assert row_bytes(QT.Q5_0, 640) == 20 * 22
    assert row_bytes(QT.Q5_1, 32) == 24
    assert row_bytes(QT.Q2_K, 256) == 84
    assert row_bytes(QT.Q3_K, 256) == 110
    assert row_bytes(QT.Q4_K, 1536) == 6 * 144
    assert row_bytes(QT.Q5_K, 512) == 352
    assert row_bytes(QT.Q6_K, 2048) == 8 * 210
    assert row_bytes(QT.IQ4_NL, 64) == 36
    assert row_bytes(QT.IQ4_XS, 256) == 136
    assert row_bytes(QT.IQ2_XXS, 256) == GGML_QUANT_SIZES[QT.IQ2_XXS][1]  # any type: pure arithmetic
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes(QT.Q4_K, 576)


@pytest.mark.parametrize("tile_rows", [3, 4096])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.IQ4_XS, QT.F16,
                                   QT.F32], ids=lambda t: t.name)
def test_quantized_matmul_ref(qtype, tile_rows):
    block = GGML_QUANT_SIZES[qtype][0]
    n_out, n_in = 10, 2 * block
    rng = _rng(int(qtype), tile_rows)
    raw = torch.from_numpy(make_tensor(qtype, (n_out, n_in), rng, scale_range=(1e-3, 1e-1)))
    x = torch.from_numpy(rng.standard_normal((5, n_in), dtype=np.float32))
    w = dequantize(raw, qtype, (n_out, n_in))
    y = quantized_matmul_ref(x, raw, qtype, n_out, n_in, tile_rows=tile_rows)
    assert y.shape == (5, n_out) and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5 * float(w.abs().max()) * n_in)


@pytest.mark.parametrize("tile_rows", [3, 4096])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_kept_tiles_give_the_same_bits(qtype, tile_rows):
    """The CPU path's dequantized weights kept in memory (dequantized_tiles + matmul_tiles) give the bits
    quantized_matmul_ref gives expanding them on every call, for every row count."""
    from kernels.quant import dequantized_tiles, matmul_tiles
    n_out, n_in = 10, 512
    rng = _rng(int(qtype), tile_rows, 7)
    raw = torch.from_numpy(make_tensor(qtype, (n_out, n_in), rng, scale_range=(1e-3, 1e-1)))
    tiles = dequantized_tiles(raw, qtype, n_out, n_in, tile_rows=tile_rows)
    assert [t.shape[0] for t in tiles] == [min(tile_rows, n_out - s) for s in range(0, n_out, tile_rows)]
    for m in (1, 5, 17):
        x = torch.from_numpy(rng.standard_normal((m, n_in), dtype=np.float32))
        assert torch.equal(matmul_tiles(x, tiles, n_out),
                           quantized_matmul_ref(x, raw, qtype, n_out, n_in, tile_rows=tile_rows))


def test_quantized_matmul_ref_tiles(monkeypatch):
    """No more than tile_rows rows of W are expanded at once; every row is expanded once."""
    qtype, n_out, n_in = QT.Q4_0, 11, 64
    raw = torch.from_numpy(make_tensor(qtype, (n_out, n_in), _rng(8), scale_range=(1e-3, 1e-1)))
    seen = []
    real = ref_module.dequantize_rows

    def spy(raw_rows, qt, n_cols, **kw):
        w = real(raw_rows, qt, n_cols, **kw)
        seen.append(w.shape[0])
        return w

    monkeypatch.setattr(ref_module, "dequantize_rows", spy)
    x = torch.randn(2, n_in)
    y = quantized_matmul_ref(x, raw, qtype, n_out, n_in, tile_rows=4)
    assert seen == [4, 4, 3]
    monkeypatch.undo()
    w = dequantize(raw, qtype, (n_out, n_in))
    torch.testing.assert_close(y, x @ w.T)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_cuda(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (4, 8 * block)
    raw = make_tensor(qtype, shape, _rng(int(qtype), 13))
    out = dequantize_rows(torch.from_numpy(raw).cuda(), qtype, shape[1])
    assert out.device.type == "cuda"
    expected = expected_dequant(raw, qtype, shape)
    if qtype == QT.F16:  # NaN payloads aside, see test_f16_all_bit_patterns
        assert not np.isnan(expected).any()
    assert_bits_equal(out, expected)
