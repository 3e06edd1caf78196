"""KV cache codecs: layouts and sizes, q8_0 bit-exact with gguf-py (llama.cpp's reference), the
rotation, round-trip quality of every type (norm kept, tcq better than the scalar type with more
bits), and the Triton encode/decode against the torch references (interpreter on the CPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from kernels.kvcodec import CACHE_TYPES, get_codec
from kernels.kvcodec.codebooks import load_codebooks
from kernels.kvcodec.rotation import hadamard
from kernels.kvcodec.tcq import pack_states, unpack_states, viterbi

QUANTIZED = ("q8_0", "turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq")
TURBO = ("turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq")

# (values per group, bytes per group) as the issue specifies them
LAYOUT = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "turbo4": (128, 66), "turbo3": (32, 14),
          "turbo2": (32, 10), "turbo3_tcq": (128, 52), "turbo2_tcq": (128, 36)}
BITS = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "turbo4": 4.125, "turbo3": 3.5, "turbo2": 2.5,
        "turbo3_tcq": 3.25, "turbo2_tcq": 2.25}
# relative squared error bounds on Gaussian rows (d = 128): Lloyd-Max MSE of the marginal + fp16 scale
REL_MSE = {"f32": 1e-12, "f16": 1e-6, "bf16": 2e-5, "q8_0": 1e-4, "turbo4": 0.0105, "turbo3": 0.036,
           "turbo2": 0.121, "turbo3_tcq": 0.026, "turbo2_tcq": 0.092}


def _rows(n, d, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * scale


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_layout(name):
    c = get_codec(name)
    assert (c.group, c.group_bytes) == LAYOUT[name]
    assert c.bits_per_value == BITS[name]
    for d in (128, 256):
        assert c.row_bytes(d) * 8 == BITS[name] * d
    if name in TURBO:  # 64-value heads are zero-padded to 128
        assert c.row_bytes(64) == c.row_bytes(128)
        assert c.bits_per_head_value(64) == 2 * BITS[name]


def test_unknown_type():
    with pytest.raises(ValueError, match="unknown KV cache type 'q4_9'"):
        get_codec("q4_9")


def test_q8_0_is_llamacpp_bit_exact():
    x = _rows(50, 256, seed=1)
    x[3] = 0.0                      # zero block: scale 0
    x[4, :32] = torch.linspace(-1, 1, 32) * 127  # exact .5 cases for the rounding
    ref = quants.quantize(x.numpy(), QT.Q8_0)
    c = get_codec("q8_0")
    ours = c.encode(x, impl="ref").numpy()
    assert np.array_equal(ours, ref)
    assert np.array_equal(c.encode(x, impl="triton").numpy(), ref)
    assert torch.equal(c.decode(torch.from_numpy(ref), 256, impl="ref"),
                       torch.from_numpy(quants.dequantize(ref, QT.Q8_0)).reshape(50, 256))


def test_rotation_is_orthonormal():
    rot = get_codec("turbo3").rotation
    r = rot.matrix64
    assert torch.allclose(r @ r.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    h = hadamard(128)
    assert torch.equal(h @ h.T, 128 * torch.eye(128, dtype=torch.float64))
    x, y = _rows(5, 256, 2), _rows(5, 256, 3)
    rx, ry = rot.rotate(x), rot.rotate(y)
    assert torch.allclose((rx * ry).sum(-1), (x * y).sum(-1), rtol=1e-4, atol=1e-3)
    assert torch.allclose(rot.unrotate(rx, 256), x, atol=1e-5)
    x64 = _rows(5, 64, 4)
    assert rot.rotate(x64).shape == (5, 128)
    assert torch.allclose(rot.unrotate(rot.rotate(x64), 64), x64, atol=1e-5)


def test_lloyd_max_tables():
    cb = load_codebooks()
    for bits in (2, 3, 4):
        c = torch.from_numpy(cb[f"lm{bits}"]).double()
        assert c.numel() == 1 << bits and bool((c[1:] > c[:-1]).all())
        assert torch.allclose(c, -c.flip(0))
        # centroid condition on the marginal (~N(0,1)): each centroid is its cell's mean
        g = torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        cell = torch.bucketize(g, (c[1:] + c[:-1]) / 2)
        means = torch.zeros(c.numel(), dtype=torch.float64).index_add_(0, cell, g) / torch.bincount(cell)
        assert torch.allclose(means, c, atol=0.02)
    assert cb["tcq3"].shape == (512,) and cb["tcq2"].shape == (256,)
    assert set(np.unique(cb["signs1"])) == {-1, 1}


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_roundtrip_quality(name):
    c = get_codec(name)
    x = _rows(256, 128, seed=5)
    y = c.roundtrip(x, impl="ref")
    rel = ((y - x) ** 2).sum() / (x ** 2).sum()
    assert rel < REL_MSE[name], rel
    if name in TURBO:  # the scale keeps each row's norm (up to fp16 rounding of the scale)
        assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=2e-3)


@pytest.mark.parametrize("tcq,scalar", [("turbo3_tcq", "turbo3"), ("turbo2_tcq", "turbo2")])
def test_tcq_beats_scalar_with_more_bits(tcq, scalar):
    x = _rows(128, 256, seed=6)
    err = {n: ((get_codec(n).roundtrip(x, impl="ref") - x) ** 2).mean().item() for n in (tcq, scalar)}
    assert err[tcq] < 0.8 * err[scalar], err


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("d", [64, 256])
def test_zero_and_outlier_rows(name, d):
    c = get_codec(name)
    x = torch.zeros(3, d)
    x[1, 5] = 40.0                    # one huge channel (rotation spreads it)
    x[2] = torch.linspace(-2, 2, d)
    y = c.roundtrip(x, impl="ref")
    assert torch.equal(y[0], torch.zeros(d))
    assert torch.isfinite(y).all()
    assert ((y[1:] - x[1:]) ** 2).sum() / (x[1:] ** 2).sum() < 0.2


def test_trellis_bitstream_roundtrip():
    cb = get_codec("turbo3_tcq").codebook()
    u = torch.randn(7, 128, generator=torch.Generator().manual_seed(7))
    for L, k, nbytes in ((9, 3, 50), (8, 2, 34)):
        st = viterbi(u, cb[: 1 << L], L, k)
        assert torch.equal((st[:, 1:] & ((1 << (L - k)) - 1)), st[:, :-1] >> k)   # a valid path
        assert torch.equal(unpack_states(pack_states(st, L, k, nbytes), L, k), st)


def test_viterbi_is_optimal_on_a_small_trellis():
    """Brute force over all paths of a 4-state, 1-bit trellis of length 6."""
    L, k, T = 2, 1, 6
    cb = torch.tensor([-1.5, -0.4, 0.5, 1.3])
    u = torch.randn(5, T, generator=torch.Generator().manual_seed(8))
    st = viterbi(u, cb, L, k)
    best = []
    for row in u:
        costs = []
        for bits in range(1 << (L + T - 1)):
            states = [(bits >> t) & 3 for t in range(T)]
            costs.append(sum((row[t] - cb[s]) ** 2 for t, s in enumerate(states)).item())
        best.append(min(costs))
    got = ((cb[st] - u) ** 2).sum(-1)
    assert torch.allclose(got, torch.tensor(best), atol=1e-5)


# ----- Triton (the interpreter on the CPU) -----
triton = pytest.importorskip("triton")


@pytest.mark.parametrize("name", [n for n in CACHE_TYPES if not n.endswith("_tcq")])
@pytest.mark.parametrize("d", [64, 256])
def test_triton_encode_matches_reference(name, d):
    c = get_codec(name)
    x = _rows(40, d, seed=9)
    a, b = c.encode(x, impl="ref"), c.encode(x, impl="triton")
    # rotation by tl.dot vs torch matmul may move a value across a code boundary, rarely
    assert (a != b).float().mean().item() < 2e-3
    assert torch.allclose(c.decode(a, d, impl="ref"), c.decode(b, d, impl="ref"), atol=0.05 * x.abs().max().item())


@pytest.mark.parametrize("name", ["turbo3_tcq", "turbo2_tcq"])
def test_triton_viterbi_matches_reference(name):
    """The Viterbi kernel (one program per 128-group, one state per lane) on 3 groups: a 256-value
    row (two groups) and a zero row."""
    c = get_codec(name)
    x = _rows(1, 256, seed=10)
    a, b = c.encode(x, impl="ref"), c.encode(x, impl="triton")
    if not torch.equal(a, b):  # float summation order may break a near-tie differently
        ya, yb = c.decode(a, 256, impl="ref"), c.decode(b, 256, impl="ref")
        ea, eb = ((ya - x) ** 2).sum(), ((yb - x) ** 2).sum()
        assert abs(ea - eb) / ea < 1e-4
    z = c.encode(torch.zeros(1, 128), impl="triton")
    assert torch.equal(c.decode(z, 128, impl="ref"), torch.zeros(1, 128))


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_triton_decode_is_exact(name):
    c = get_codec(name)
    for d in (64, 256):
        p = c.encode(_rows(33, d, seed=12), impl="ref")
        assert torch.equal(c.decode_stored(p, impl="triton"), c.decode_stored(p, impl="ref"))


def test_bits_of_a_real_head_size():
    """What one token's K+V costs per layer for the two test models' head shapes."""
    smol = {n: get_codec(n).row_bytes(64) * 3 * 2 for n in CACHE_TYPES}      # 3 KV heads of 64
    gemma = {n: get_codec(n).row_bytes(256) * 1 * 2 for n in CACHE_TYPES}    # 1 KV head of 256
    assert smol["f16"] == 768 and smol["q8_0"] == 408 and smol["turbo4"] == 396
    assert gemma["f16"] == 1024 and gemma["turbo4"] == 264 and gemma["turbo2_tcq"] == 144
    assert math.isclose(gemma["f16"] / gemma["turbo3_tcq"], 16 / 3.25)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_rotation_matches_torch(device):
    """The rotation kernel CUDA tensors take (row by row, in a fixed order whatever the row count)
    against torch's matmul: rotate, un-rotate, and a row alone equals the same row among others (bit for
    bit on CUDA; under the interpreter on the CPU numpy's matmul may sum in another order for another row
    count, so there to float32 rounding)."""
    pytest.importorskip("triton")
    from kernels.kvcodec import default_rotation
    from kernels.kvcodec.rotation import _rows_times
    rot = default_rotation()
    x = _rows(37, 256, seed=5).to(device)
    y = _rows_times(x, rot.matrix_t(device))
    assert torch.allclose(y.cpu(), rot.rotate(x.cpu()), atol=1e-5)
    assert torch.allclose(_rows_times(y, rot.matrix(device)), x, atol=1e-5)
    alone = _rows_times(x[5:6], rot.matrix_t(device))
    assert torch.equal(alone, y[5:6]) if device == "cuda" else torch.allclose(alone, y[5:6], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CACHE_TYPES)
def test_gpu_triton_decode_is_exact(name):
    """The Triton decoder compiled for CUDA gives the torch reference's values, at the 27B's head size."""
    c = get_codec(name)
    p = c.encode(_rows(257, 256, seed=13), impl="ref").cuda()
    assert torch.equal(c.decode_stored(p, impl="triton").cpu(), c.decode_stored(p.cpu(), impl="ref"))
