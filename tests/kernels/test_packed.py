"""The packed layout for every quantized GGUF type (kernels/quant/packed.py): repacking matches
gguf's dequantization (bit-exact where no fp16 scale product is rounded), the Triton kernel matches
the torch reference for several M, a row's result does not depend on the other rows, and the
packed bytes stay near the GGUF bytes. On the CPU the kernel runs in Triton's interpreter (tiny
shapes, 1-2 K steps per program); the `gpu` tests use real sizes and skip without CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

triton = pytest.importorskip("triton")

from kernels.quant.packed import (  # noqa: E402
    dequant_packed, packed_matmul, packed_rows, packed_rows_triton, prefill_matmul,
)
from kernels.quant.packing import (  # noqa: E402
    PACKED_TYPES, PackedWeight, dequant_packed_ref, group_scales, nibble_values, pack_weight, row_major,
)
from kernels.quant.ref import SUPPORTED_TYPES, dequantize  # noqa: E402
from tests.kernels.sm90 import sm90_figures  # noqa: E402

TYPES = sorted(t for t in SUPPORTED_TYPES if t not in (QT.F32, QT.F16, QT.BF16))

# byte offsets of each block's fp16 super-scales (d, and dmin / m where present)
F16_FIELDS = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
    QT.IQ4_NL: (0,), QT.IQ4_XS: (0,),
}
# types whose packed scale/min is a product rounded to fp16 (exact only for special scales)
ROUNDED = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS}


def _random_weight(qtype, n, k, seed=0, pow2=False):
    """Random GGUF bytes of an [n, k] weight, with finite modest fp16 super-scales: uniform in
    [-0.01, 0.01), or (pow2) +-2^-e, e in 8..11, which makes every scale product exact in fp16."""
    g = torch.Generator().manual_seed(seed)
    nb, bs = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n * k // nb * bs,), dtype=torch.uint8, generator=g)
    blk = raw.view(-1, bs)
    rng = np.random.default_rng(seed)
    for off in F16_FIELDS[qtype]:
        if pow2:
            v = rng.choice([-1.0, 1.0], blk.shape[0]) * 2.0 ** -rng.integers(8, 12, blk.shape[0])
        else:
            v = (rng.random(blk.shape[0]) * 0.02 - 0.01)
        blk.view(torch.int16)[:, off // 2] = torch.from_numpy(v.astype(np.float16)).view(torch.int16)
    return raw


def test_every_quantized_type_is_packable():
    assert set(TYPES) == set(PACKED_TYPES)
    for qt in (QT.F32, QT.F16, QT.BF16):
        with pytest.raises(ValueError):
            pack_weight(torch.zeros(4 * 32 * 4, dtype=torch.uint8), qt, 4, 32)
    with pytest.raises(ValueError):
        pack_weight(torch.zeros(4 * 18, dtype=torch.uint8), QT.Q4_0, 4, 64)  # wrong byte count


CODED = pytest.mark.parametrize("coded", [False, True], ids=["f16", "codes"])


@CODED
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_pack_matches_gguf_dequant(qtype, coded):
    n, k = 8, 512
    # exact whenever the scale products are exact in fp16 (power-of-two super-scales)
    raw = _random_weight(qtype, n, k, seed=1, pow2=True)
    assert torch.equal(dequant_packed_ref(pack_weight(raw, qtype, n, k, coded=coded)), dequantize(raw, qtype, (n, k)))
    # random super-scales: exact unless a scale product is rounded to fp16
    raw = _random_weight(qtype, n, k, seed=2)
    ref = dequantize(raw, qtype, (n, k))
    packed = dequant_packed_ref(pack_weight(raw, qtype, n, k, coded=coded))
    if qtype in ROUNDED:
        assert torch.allclose(packed, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    else:
        assert torch.equal(packed, ref)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
def test_4bit_types_pack_exactly_like_packed4(qtype):
    from kernels.quant.q4_gemm import pack_q4
    n, k = 4, 512
    raw = _random_weight(qtype, n, k, seed=10)
    p, p4 = pack_weight(raw, qtype, n, k), pack_q4(raw, qtype, n, k)
    assert p.hi_bits == 0 and p.group == 32 and len(p.planes) == 1
    q = nibble_values(p)
    assert torch.equal(q[:, 0::2] | (q[:, 1::2] << 4), p4.q)
    for a, b in zip(group_scales(p), (p4.scale, p4.minv)):   # (stored as fp16 products by Packed4)
        assert torch.equal(a, b)


def test_4bit_plane_is_in_fragment_order():
    """In each tile row of R = tile_k / 32 runs of 32 values, byte 4Rt + 4r + 2c + p holds value
    32r + 16c + 2t + p (low nibble) and that + 8 (high nibble): the values a tensor-core fragment gives
    thread t, one 32-bit word per run, thread t's words of the tile row side by side (one 16-byte load
    for a 128-value tile)."""
    n, k = 64, 256
    q = (torch.arange(n * k) % 16).to(torch.uint8).view(n, k)
    q = (q + torch.arange(n, dtype=torch.uint8)[:, None] * 3) % 16
    raw = _random_weight(QT.Q4_0, n, k, seed=2)
    for tk in (64, 128):
        p = pack_weight(raw, QT.Q4_0, n, k, tile_k=tk)
        vals = nibble_values(p)
        row = row_major(p, p.planes[0])[5]
        runs = tk // 32
        for byte in (0, 1, 2, 3, 4, 13, 16 + 7, 63, 64 + 17, 127):
            tile, b = byte // (tk // 2), byte % (tk // 2)
            t, r, c, par = b // (4 * runs), b % (4 * runs) // 4, b % 4 // 2, b % 2
            v = tk * tile + 32 * r + 16 * c + 2 * t + par
            assert row[byte] & 15 == vals[5, v] and row[byte] >> 4 == vals[5, v + 8]
        from kernels.quant.packing import _deinterleave_nibbles, _interleave_nibbles
        assert torch.equal(_deinterleave_nibbles(_interleave_nibbles(q, tk), tk), q)
        assert not torch.equal(_interleave_nibbles(q, tk), q[:, 0::2] | (q[:, 1::2] << 4))


def test_2bit_high_plane_is_in_fragment_order():
    """Q6_K's high plane: in each tile row of R = tile_k / 32 runs, byte 2Rt + 2r + p holds in bits 2f,
    2f+1 (f = c + 2h) the high bits of value 32r + 16c + 8h + 2t + p: thread t's 8 values per run, the
    same ones as its word of the 4-bit plane, its bytes of the tile row side by side; a weight packs and
    dequantizes as gguf does (test_packed_dequant_matches_gguf) either way."""
    from kernels.quant.packing import _deinterleave_crumbs, _interleave_crumbs, high_values
    n, k = 64, 256
    raw = _random_weight(QT.Q6_K, n, k, seed=3)
    p = pack_weight(raw, QT.Q6_K, n, k, tile_k=128)
    vals = high_values(p)
    row = row_major(p, p.planes[1])[7]
    for byte in (0, 1, 2, 5, 7, 8 + 3, 31, 32 + 9, 63):
        tile, b = byte // 32, byte % 32
        t, r, par = b // 8, b % 8 // 2, b % 2
        for f in range(4):
            c, h = f % 2, f // 2
            assert (row[byte] >> (2 * f)) & 3 == vals[7, 128 * tile + 32 * r + 16 * c + 8 * h + 2 * t + par]
    q = torch.randint(0, 4, (8, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for tk in (64, 128, 256):
        assert torch.equal(_deinterleave_crumbs(_interleave_crumbs(q, tk), tk), q)
    assert vals.max() == 3 and vals.float().std() > 0.5      # a real plane, not zeros


_PTX_SCRIPT = r"""
import re, sys
from tests.kernels.sm90 import compile_decode_matmul
# the engine's decode matmul, the tile in registers: Q4_K (fp16 scale products and mins, 128 x 128 tiles)
# or Q6_K (fp16 scale products, offset 32, 64 x 128 tiles); sys.argv[1] names one
q6 = sys.argv[1] == "Q6_K"
try:
    k = compile_decode_matmul(sys.argv[1], tile_n=64 if q6 else 128, split=8 if q6 else 4)
except (RuntimeError, FileNotFoundError) as e:
    print("cannot compile for sm_90 here:", e)
    sys.exit(3)
ptx = k.asm["ptx"]
# scalar byte loads, byte-pair loads (ld.shared.v2.b8), 16-byte and 8-byte word loads, ldmatrix, PRMTs
count = lambda pat: len(re.findall(pat, ptx))
print(count(r"ld\.shared(\.(?!v\d)\w+)*\.[ub]8\b"), count(r"ld\.shared\.v2\.[ub]8\b"),
      count(r"ld\.shared\.v4\.b32\b"), count(r"ld\.shared\.v2\.b32\b"), count(r"ldmatrix\."),
      count(r"prmt\.b32"))
"""


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_decode_matmul_reads_the_planes_as_words(qtype):
    """The Q4_K and Q6_K decode matmuls compiled for the H200 (sm_90, on this machine: Triton's compiler
    and ptxas, in a process without TRITON_INTERPRET) read the 4-bit plane (and Q6_K's 2-bit plane) from
    shared memory as one 16-byte (8-byte) load per tile row and thread and spread the fields with PRMT
    (_nibbles_f16, _crumbs_f16): not one byte load and ~4 instructions per byte, as planes outside
    fragment order need (Q4_K's matmuls 15-20 % slower on the H200, Q6_K's 1.3-1.45x), nor ldmatrix over
    rows 64 bytes apart, whose 4-way bank conflicts are 30 % of the gate+up stack's shared-memory
    wavefronts (docs/PERFORMANCE.md)."""
    byte_loads, pair_loads, quads, pairs, ldmatrix, prmt = sm90_figures(_PTX_SCRIPT, qtype)[-6:]
    assert byte_loads == 0 and pair_loads == 0
    # two per 8 values of the 4-bit plane, and for Q6_K two per 8 of the 2-bit one: 128 values per
    # thread and tile for Q4_K, 64 for Q6_K
    assert prmt >= 32
    if qtype == "Q4_K":   # 4 rows of 64 bytes a thread; the epilogue's 4 ldmatrix remain
        assert quads >= 8 and ldmatrix <= 4
    else:                 # 2 rows: the 4-bit plane's 16 bytes and the 2-bit plane's 8 bytes each
        assert quads >= 2 and pairs >= 2 and ldmatrix == 0


_REGS_SCRIPT = r"""
import sys
from tests.kernels.sm90 import compile_decode_matmul, resource_usage
from kernels.quant.packed import DECODE_MAXNREG
# the 128-row Q4_K decode matmul as the engine launches it (PDL, the register cap of its tile rows)
try:
    k = compile_decode_matmul("Q4_K", tile_n=128, split=4, pdl=True, prefetch=1, maxnreg=DECODE_MAXNREG.get(128))
except (RuntimeError, FileNotFoundError) as e:
    print("cannot compile for sm_90 here:", e)
    sys.exit(3)
u = resource_usage(k.asm["cubin"])
print(u["REG"], u.get("STACK", 0), u.get("LOCAL", 0))
"""


def test_128_row_decode_matmul_fits_four_programs_per_sm():
    """The engine caps the 128-row decode matmul's registers (DECODE_MAXNREG) so that four 4-warp programs
    share an SM (128 registers per thread; ~141 uncapped: three), without spilling to local memory: the
    Q4_K gate+up stack 5 % faster on the H200 (.ci/gpu/sweep_regs.py)."""
    regs, stack, local = sm90_figures(_REGS_SCRIPT)[-3:]
    assert regs <= 128 and stack == 0 and local == 0


def test_packing_in_chunks_and_unaligned_bytes(monkeypatch):
    """Packing row bands in several steps (the last one a partial tile band) from bytes at an odd offset
    gives the same tensors as one step; the tiles' padding rows are zero."""
    import kernels.quant.packing as packing
    n, k = 37, 512
    raw = _random_weight(QT.Q6_K, n, k, seed=3)
    whole = pack_weight(raw, QT.Q6_K, n, k, tile_n=16, tile_k=128, coded=True)
    assert whole.n_pad == 48 and not whole.scale[2, :, 5:].any()
    monkeypatch.setattr(packing, "_CHUNK_VALUES", 16 * k)  # 16 rows per step, last step 5 rows
    buf = torch.empty(raw.numel() + 1, dtype=torch.uint8)
    buf[1:] = raw
    chunked = pack_weight(buf[1:], QT.Q6_K, n, k, tile_n=16, tile_k=128, coded=True)  # odd storage offset
    assert len(whole.tensors) == len(chunked.tensors) == 4     # 4-bit and high planes, scale codes, d
    for a, b in zip(whole.tensors, chunked.tensors):
        assert torch.equal(a, b)


# Packed bytes / GGUF bytes (bits per value: packed / GGUF), as the layout defines them. The types with a
# fixed min (Q4_0, Q5_0, Q3_K, Q6_K) and those without one store no min; by default (f16) the K-quants and
# IQ4_XS store fp16 products per group:
#   Q4_0 1.000 (4.5/4.5)     Q4_1 1.000 (5/5)       Q5_0 1.000 (5.5/5.5)    Q5_1 1.000 (6/6)
#   Q8_0 1.000 (8.5/8.5)     Q4_K 1.111 (5/4.5)     Q5_K 1.091 (6/5.5)      Q6_K 1.067 (7/6.5625)
#   Q2_K 2.286 (6/2.625)     Q3_K 1.455 (5/3.4375)  IQ4_NL 1.889 (8.5/4.5)  IQ4_XS 2.000 (8.5/4.25)
# coded (pack_weight(coded=True)): their 8-bit sub-block codes and one fp16 d (and dmin) per 256 values:
#   Q4_K 1.028 (4.625/4.5)   Q5_K 1.023 (5.625/5.5) Q6_K 1.000 (6.5625)
#   Q2_K 1.952 (5.125/2.625) Q3_K 1.327 (4.5625/3.4375) IQ4_XS 1.956 (8.3125/4.25)
# The 2-/3-bit and IQ4 types exceed 1.25x by construction: Q2_K/Q3_K keep q in the 4-bit plane, IQ4
# stores the codebook value as int8.
RATIO = {QT.Q4_0: 1.0, QT.Q4_1: 1.0, QT.Q5_0: 1.0, QT.Q5_1: 1.0, QT.Q8_0: 1.0,
         QT.Q4_K: 5 / 4.5, QT.Q5_K: 6 / 5.5, QT.Q6_K: 7 / 6.5625, QT.Q2_K: 6 / 2.625,
         QT.Q3_K: 5 / 3.4375, QT.IQ4_NL: 8.5 / 4.5, QT.IQ4_XS: 8.5 / 4.25}
RATIO_CODED = {**RATIO, QT.Q4_K: 4.625 / 4.5, QT.Q5_K: 5.625 / 5.5, QT.Q6_K: 1.0, QT.Q2_K: 5.125 / 2.625,
               QT.Q3_K: 4.5625 / 3.4375, QT.IQ4_XS: 8.3125 / 4.25}
OVER_BUDGET = {QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS}


@CODED
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_bytes_near_gguf_bytes(qtype, coded):
    n, k = 64, 512   # (a whole tile band: rows short of one are padded)
    raw = _random_weight(qtype, n, k)
    ratio = pack_weight(raw, qtype, n, k, coded=coded).nbytes / raw.numel()
    assert ratio == pytest.approx((RATIO_CODED if coded else RATIO)[qtype])
    if qtype not in OVER_BUDGET:
        assert ratio <= 1.25


def test_packed_rows():
    n, k = 16, 512
    for qtype in (QT.Q6_K, QT.Q8_0, QT.Q5_1):
        p = pack_weight(_random_weight(qtype, n, k, seed=4), qtype, n, k)
        ids = torch.tensor([[3, 0], [15, 3]])
        got = packed_rows(p, ids)
        assert got.shape == (2, 2, k)
        assert torch.equal(got, dequant_packed_ref(p)[ids])


@CODED
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_rows_kernel(qtype, coded):
    """The embedding lookup's Triton kernel (one launch: the decode step's first): each id's row as the
    float32 reference gives it, tail-band rows included; an id outside the table gives zeros, not a read past it."""
    n, k = 40, 256
    p = pack_weight(_random_weight(qtype, n, k, seed=3), qtype, n, k, tile_n=16, coded=coded)
    ids = torch.tensor([[0, 39], [17, 16], [39, 5]])
    got = packed_rows(p, ids, impl="triton")
    assert got.shape == (3, 2, k) and got.dtype == torch.float32
    assert torch.equal(got, dequant_packed_ref(p)[ids])
    assert torch.equal(packed_rows(p, ids, impl="triton"), packed_rows(p, ids, impl="torch"))
    assert (packed_rows_triton(p, torch.tensor([n, -1])) == 0).all()


def _check(y, x, p):
    ref = x.half().float() @ dequant_packed_ref(p).T
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-3, err


@CODED
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_matches_reference(qtype, coded):
    n, k = 32, 512
    p = pack_weight(_random_weight(qtype, n, k, seed=5), qtype, n, k, tile_n=32, coded=coded)
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        _check(packed_matmul(x, p, split_k=2), x, p)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_do_not_depend_on_batch(qtype):
    n, k = 32, 512
    p = pack_weight(_random_weight(qtype, n, k, seed=6), qtype, n, k, tile_n=32)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(6))
    kw = dict(split_k=2)
    assert torch.equal(packed_matmul(x[:1], p, **kw), packed_matmul(x, p, **kw)[:1])


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_swapped_operands_and_tuned_configs(qtype):
    """SWAP_AB (weight tile as the dot's first operand) and the engine's tuned decode / prefill
    configurations give the reference's result, and a row's result does not depend on the batch."""
    from kernels.quant.packed import tuned_config
    n, k = 64, 512
    p = pack_weight(_random_weight(qtype, n, k, seed=7), qtype, n, k, tile_n=32, tile_k=128)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(7))
    kw = dict(split_k=2, swap_ab=True)
    y = packed_matmul(x, p, **kw)
    _check(y, x, p)
    assert torch.equal(packed_matmul(x[:1], p, **kw), y[:1])
    for prefill in (0, 64, 256):      # decode rows, a small prompt chunk, a prompt chunk (Triton's path)
        cfg = tuned_config(p, prefill, 4)
        _check(packed_matmul(x, p, **cfg), x, p)


def test_wide_decode_rows_settings():
    """Decode settings by row count: 16-row blocks up to 16 rows, then one block of the rows' power of two
    up to DECODE_BLOCK_M (more rows: several such blocks), the split, warps and the rest kept, no register cap;
    settings not made for 16-row blocks, without the weight tile as the dot's first operand, or with TMA are
    left alone."""
    from kernels.quant.packed import DECODE_BLOCK_M, wide_decode_rows
    assert DECODE_BLOCK_M == 64
    cfg = dict(block_m=16, num_warps=4, num_stages=3, swap_ab=True, split_k=5, maxnreg=128)
    assert wide_decode_rows(cfg, 1) is cfg and wide_decode_rows(cfg, 16) is cfg
    assert wide_decode_rows(cfg, 17) == dict(block_m=32, num_warps=4, num_stages=3, swap_ab=True, split_k=5)
    assert wide_decode_rows(cfg, 33)["block_m"] == 64 and wide_decode_rows(cfg, 200)["block_m"] == 64
    assert wide_decode_rows(dict(cfg, block_m=64), 40)["block_m"] == 64
    for other in (dict(cfg, swap_ab=False), dict(cfg, tma=True)):
        assert wide_decode_rows(other, 64) is other


def test_small_prompt_chunks_take_the_decode_settings_in_one_block():
    """A prompt chunk of at most SMALL_PROMPT_ROWS rows: the weight's decode settings with every row in
    one block of x (each weight tile dequantized once), without the decode rows' register cap, its split
    from SMALL_PROMPT_WAVES; longer chunks keep the prefill settings."""
    import kernels.quant.packed as packed
    from kernels.packed_layout import default_tile_k, default_tile_n
    from kernels.quant.packed import SMALL_PROMPT_ROWS, SMALL_PROMPT_WAVES, tuned_config
    assert SMALL_PROMPT_ROWS == 64
    for qtype, tile_n in ((QT.Q4_K, 128), (QT.Q6_K, 64)):
        p = pack_weight(_random_weight(qtype, 256, 512, seed=7), qtype, 256, 512, tile_n=tile_n, tile_k=128)
        dec, small = tuned_config(p, 0, 132), tuned_config(p, 64, 132)
        assert dec["block_m"] == 16 and small["block_m"] == 64 and "maxnreg" not in small
        assert small["swap_ab"] == dec["swap_ab"]
        assert small["split_k"] == tuned_config(p, 0, 132, waves=SMALL_PROMPT_WAVES)["split_k"]
        assert tuned_config(p, 256, 132)["block_m"] == 128
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    _check(packed_matmul(x, p, **dict(small, split_k=2)), x, p)
    assert packed.weight_class(p) == "hi"
    # 5120 output rows in 64-row tiles, K = 17408: 80 bands; decode's 8 programs per SM -> split 17 of the
    # 136 K tiles, the small chunks' 4 -> 8 (tuned_config reads only the shape: a stand-in without values)
    down = PackedWeight(planes=(torch.empty(80, 0, dtype=torch.uint8),),
                               scale=torch.empty(80, 0, dtype=torch.float16), minv=None, n=5120, k=17408, group=32,
                               hi_bits=0, qtype=QT.Q4_K, tile_n=default_tile_n(5120),
                               tile_k=default_tile_k(17408, False))
    assert down.tile_n == 64 and down.n_pad == 5120
    assert (tuned_config(down, 0, 132)["split_k"], tuned_config(down, 64, 132)["split_k"]) == (17, 8)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_fp16_input_gives_the_same_bits(qtype):
    """x handed over in fp16 (what the producers of a packed matmul's input write on the GPU:
    Weight.input_dtype) gives the bits of float32 x, which the kernel rounds to fp16 first, in the engine's
    decode settings and with the residual added in the epilogue."""
    from kernels.quant.packed import tuned_config
    n, k = 64, 512
    p = pack_weight(_random_weight(qtype, n, k, seed=9), qtype, n, k, tile_n=32, tile_k=128)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    add = torch.randn(3, n, generator=torch.Generator().manual_seed(10))
    cfg = tuned_config(p, False, 4)
    assert torch.equal(packed_matmul(x.half(), p, **cfg), packed_matmul(x, p, **cfg))
    assert torch.equal(packed_matmul(x.half(), p, add=add, **cfg), packed_matmul(x, p, add=add, **cfg))


def test_deep_pipeline_only_where_it_measured_faster():
    """4 stages for 4-bit-only weights with at most DEEP_PIPELINE_MAX_N outputs (the 27B's projections back
    to its 5120 hidden values), 3 elsewhere: a high plane, or more rows (H200, .ci/gpu/sweep_tile_k.py --stages)."""
    from kernels.quant.packed import DEEP_PIPELINE_MAX_N, tuned_config
    stages = {}
    for qtype, n in ((QT.Q4_K, DEEP_PIPELINE_MAX_N), (QT.Q4_K, DEEP_PIPELINE_MAX_N + 1152), (QT.Q6_K, 1024)):
        p = pack_weight(_random_weight(qtype, n, 256, seed=8), qtype, n, 256, tile_k=128)
        stages[qtype.name, n] = tuned_config(p, False, 132)["num_stages"]
    assert list(stages.values()) == [4, 3, 3]


@CODED
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_tma_loads_give_the_same_result(qtype, coded, monkeypatch):
    """Tiles brought in by tensor descriptors (TMA on sm_90+, run here by the interpreter) give the same
    bits as per-thread loads, in the engine's tuned decode settings too; tiles whose rows are under 16
    bytes (what a TMA box needs) fall back to per-thread loads."""
    import kernels.quant.packed as packed
    from kernels.quant.packed import _descriptors, tuned_config
    used = []
    monkeypatch.setattr(packed, "_descriptors", lambda p: used.append(_descriptors(p)) or used[-1])
    n, k = 256, 512     # two bands of 128-row tiles
    p = pack_weight(_random_weight(qtype, n, k, seed=8), qtype, n, k, tile_n=128, tile_k=256, coded=coded)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8))
    for swap in (False, True):
        kw = dict(split_k=2, swap_ab=swap)
        assert torch.equal(packed_matmul(x, p, tma=True, **kw), packed_matmul(x, p, **kw))
    assert used and all(d is not None for d in used)      # the descriptor path ran
    cfg = tuned_config(p, False, 4, tma=True)
    assert cfg.get("tma", False) == (qtype != QT.Q8_0)
    y = packed_matmul(x, p, **cfg)
    _check(y, x, p)
    assert torch.equal(packed_matmul(x[:1], p, **cfg), y[:1])
    small = pack_weight(_random_weight(qtype, n, k, seed=8), qtype, n, k, tile_n=32, tile_k=32, coded=coded)
    assert _descriptors(small) is None
    assert torch.equal(packed_matmul(x, small, tma=True), packed_matmul(x, small))
    # 128-value tiles (the default without codes): no TMA in the tuned settings (scale rows under 16 bytes)
    short = pack_weight(_random_weight(qtype, n, k, seed=8), qtype, n, k, tile_n=32, tile_k=128, coded=coded)
    assert not tuned_config(short, False, 4, tma=True).get("tma")
    assert pack_weight(_random_weight(qtype, n, k, seed=8), qtype, n, k, coded=coded).tile_k == \
        (256 if coded and qtype != QT.Q8_0 else 128)
    # 256-value tiles of 64 rows with fp16 scales (pack_weight(tile_k=256) only): the tile in registers, as
    # 128-value ones, not TMA's settings
    narrow = pack_weight(_random_weight(qtype, 128, k, seed=8), qtype, 128, k, tile_n=64, tile_k=256, coded=coded)
    cfg = tuned_config(narrow, False, 4, tma=True)
    in_registers = not coded and qtype != QT.Q8_0
    assert bool(cfg.get("tma")) == (not in_registers and qtype != QT.Q8_0)
    assert cfg.get("swap_ab", False) == (in_registers or (coded and qtype == QT.Q4_K))
    _check(packed_matmul(x, narrow, **cfg), x, narrow)


def test_tma_that_fails_falls_back_to_per_thread_loads(monkeypatch):
    """Where TMA loads do not work (no tensor descriptors in that Triton, a driver without them), the
    engine's matmul settings fall back to per-thread loads with a warning instead of failing every step."""
    import kernels.quant.packed as packed
    n, k = 256, 512
    p = pack_weight(_random_weight(QT.Q4_K, n, k, seed=9), QT.Q4_K, n, k, tile_n=128, tile_k=256)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(9))
    assert packed._checked_config(x, p, 0, 4, True).get("tma")

    def broken(p):
        raise RuntimeError("no tensor descriptors here")
    monkeypatch.setattr(packed, "_descriptors", broken)
    with pytest.warns(RuntimeWarning, match="no tensor descriptors"):
        cfg = packed._checked_config(x, p, 0, 4, True)
    assert not cfg.get("tma")
    _check(packed_matmul(x, p, **cfg), x, p)


@CODED
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequant_kernel_matches_reference(qtype, coded):
    """The prefill path's fp16 copy of a weight (tail rows included) is the reference rounded once."""
    n, k = 40, 256
    p = pack_weight(_random_weight(qtype, n, k, seed=11), qtype, n, k, tile_n=16, coded=coded)
    assert torch.equal(dequant_packed(p), dequant_packed_ref(p).half())


def test_fast_conversion_gives_the_float32_paths_result():
    """The kernel's conversion-free dequantization (bit tricks and one fp16 fma) and its float32 path
    agree to fp16 rounding (exactly on the GPU, where the fma is fused; the interpreter rounds twice)."""
    for qtype in (QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.IQ4_NL):
        n, k = 32, 256
        p = pack_weight(_random_weight(qtype, n, k, seed=13), qtype, n, k, tile_n=32)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(13))
        fast, slow = packed_matmul(x, p, fast_cvt=True), packed_matmul(x, p, fast_cvt=False)
        assert ((fast - slow).abs().max() / slow.abs().max()).item() < 2e-3
        _check(fast, x, p)


def test_defaults_tails_and_dtypes():
    # default tiles and split (4 "SMs" under the interpreter), N not a multiple of the tile's rows
    n, k = 40, 512
    p = pack_weight(_random_weight(QT.Q5_K, n, k, seed=7), QT.Q5_K, n, k)
    x = torch.randn(2, 3, k, dtype=torch.bfloat16)
    y = packed_matmul(x, p)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    _check(y.view(6, n), x.view(6, k).float(), p)
    y16 = packed_matmul(x, p, out_dtype=torch.float16, split_k=4)
    assert y16.dtype == torch.float16
    _check(y16.view(6, n), x.view(6, k).float(), p)
    # K = 160: 32-value tiles (the largest power of two dividing K), a split that is no divisor of the
    # 5 K tiles goes up to one that is
    n, k = 32, 160
    p = pack_weight(_random_weight(QT.Q5_0, n, k, seed=8), QT.Q5_0, n, k)
    assert p.tile_k == 32
    x = torch.randn(3, k)
    _check(packed_matmul(x, p, split_k=2), x, p)
    assert packed_matmul(x[:0], p).shape == (0, n)


# --- GPU (real sizes; skipped without CUDA) ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(17408, 5120), (5120, 17408)])
def test_kernel_real_shapes_on_gpu(qtype, n, k):
    raw = _random_weight(qtype, n, k).cuda()
    p = pack_weight(raw, qtype, n, k)
    w = dequant_packed_ref(p)
    ref_full = dequantize(raw, qtype, (n, k))
    assert torch.allclose(w, ref_full, rtol=2e-3, atol=2e-3 * ref_full.abs().max().item())
    del ref_full
    for m in (1, 16, 64):
        x = torch.randn(m, k, device="cuda")
        y = packed_matmul(x, p)
        ref = x.half().float() @ w.T
        assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-3
        assert torch.equal(packed_matmul(x[:1], p), y[:1])  # batch invariance


@pytest.mark.gpu
@CODED
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_on_gpu(qtype, coded):
    n, k = 2048, 4096
    raw = _random_weight(qtype, n, k, seed=9).cuda()
    p = pack_weight(raw, qtype, n, k, coded=coded)
    w = dequant_packed_ref(p)
    ref_w = dequantize(raw, qtype, (n, k))
    if qtype in ROUNDED:
        assert torch.allclose(w, ref_w, rtol=2e-3, atol=2e-3 * ref_w.abs().max().item())
    else:
        assert torch.equal(w, ref_w)
    for m in (1, 5, 33):
        x = torch.randn(m, k, device="cuda")
        y = packed_matmul(x, p)
        _check(y, x, p)
        assert torch.equal(packed_matmul(x[:1], p), y[:1])
    ids = torch.tensor([0, 7, n - 1], device="cuda")
    assert torch.equal(packed_rows(p, ids), w[ids])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q5_K, QT.Q8_0], ids=lambda t: t.name)
def test_prefill_matmul_on_gpu(qtype):
    """Prompt rows: dequantize + cuBLAS matches the reference; the same rows give the same result
    again (a prompt's chunks are fixed, so that is the invariance the engine needs)."""
    n, k = 4096, 5120
    p = pack_weight(_random_weight(qtype, n, k, seed=12).cuda(), qtype, n, k)
    assert torch.equal(dequant_packed(p), dequant_packed_ref(p).half())
    for m in (1, 37, 512):
        x = torch.randn(m, k, device="cuda")
        y = prefill_matmul(x, p)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        _check(y, x, p)
        assert torch.equal(y, prefill_matmul(x, p))
    # padded to a fixed row count, a row's result does not depend on how many rows its chunk had
    x = torch.randn(256, k, device="cuda")
    whole = prefill_matmul(x, p, pad_rows=256)
    assert torch.equal(prefill_matmul(x[200:237], p, pad_rows=256), whole[200:237])
    assert torch.equal(prefill_matmul(x[:1], p, pad_rows=256), whole[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_small_prompt_matmul_on_gpu(qtype):
    """A small prompt chunk's rows (matmul_tuned with prefill <= SMALL_PROMPT_ROWS: the packed kernel, all
    rows in one block) match the reference at the 27B's widest shape, with and without the residual."""
    from kernels.quant.packed import SMALL_PROMPT_ROWS, matmul_tuned
    n, k = 17408, 5120
    p = pack_weight(_random_weight(qtype, n, k, seed=15).cuda(), qtype, n, k)
    for m in (1, 37, SMALL_PROMPT_ROWS):
        x = torch.randn(m, k, device="cuda")
        y = matmul_tuned(x, p, SMALL_PROMPT_ROWS)
        _check(y, x, p)
        add = torch.randn(m, n, device="cuda")
        assert torch.equal(matmul_tuned(x, p, SMALL_PROMPT_ROWS, add=add), add + y)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
def test_cuda_graph_capture(tma):
    n, k = 4096, 5120
    p = pack_weight(_random_weight(QT.Q6_K, n, k).cuda(), QT.Q6_K, n, k)
    x = torch.randn(4, k, device="cuda")
    eager = packed_matmul(x, p, tma=tma)  # compiles, caches the SM count and the descriptors
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = packed_matmul(x, p, tma=tma)
    x.copy_(torch.randn(4, k, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, packed_matmul(x, p, tma=tma))
    assert not torch.equal(y, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_tma_on_gpu(qtype):
    """On a GPU with TMA (sm_90+): the engine's decode matmul (matmul_tuned: TMA settings) gives the
    same bits as per-thread loads with the same settings, at the 27B's widest shape."""
    from kernels.quant.packed import _has_tma, _sm_count, matmul_tuned, tuned_config
    if not _has_tma(0):
        pytest.skip("needs TMA (sm_90+)")
    n, k = 17408, 5120
    p = pack_weight(_random_weight(qtype, n, k, seed=14).cuda(), qtype, n, k, tile_k=256)
    cfg = tuned_config(p, False, _sm_count(0), tma=True)
    for m in (1, 16, 33):
        x = torch.randn(m, k, device="cuda")
        y = matmul_tuned(x, p)
        assert torch.equal(y, packed_matmul(x, p, **dict(cfg, tma=False)))
        assert torch.equal(matmul_tuned(x[:1], p), y[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q5_K, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(6144, 5120), (5120, 17408)])
def test_wide_decode_blocks_keep_each_rows_bits_on_gpu(qtype, n, k):
    """Decode steps of more than 16 rows multiply blocks of up to 64 rows of x per weight tile
    (wide_decode_rows; Q8_0 keeps 16-row blocks): every row's product is the bits it gets alone in a 1-row
    step, at 17, 33 and 64 rows, with the residual added and as split-K partials too (batch invariance)."""
    from kernels.quant.packed import matmul_tuned
    p = pack_weight(_random_weight(qtype, n, k, seed=23).cuda(), qtype, n, k)
    x = torch.randn(64, k, device="cuda")
    a = torch.randn(64, n, device="cuda")
    alone = torch.cat([matmul_tuned(x[i:i + 1], p) for i in range(64)])
    for m in (17, 33, 64):
        assert torch.equal(matmul_tuned(x[:m], p), alone[:m])
        assert torch.equal(matmul_tuned(x[:m], p, add=a[:m]), a[:m] + alone[:m])
        parts = matmul_tuned(x[:m], p, partials=True)
        assert torch.equal(parts, torch.cat([matmul_tuned(x[i:i + 1], p, partials=True) for i in range(m)], 1))


# --- split-K sums in the kernel, the residual added there, stacked weights ---------------------

@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_split_sums_in_the_kernel(qtype):
    """The last k-slice of each output block adds the partial sums (in k-slice order): the same bits as
    the separate sum kernel, for any split and row count (more m-blocks than the first count buffer
    holds too), with `add` folded in as add + product; the arrival counts are back at 0 after each call."""
    n, k = 40, 512
    p = pack_weight(_random_weight(qtype, n, k, seed=15), qtype, n, k, tile_n=16, tile_k=64)
    g = torch.Generator().manual_seed(15)
    for m in (1, 5, 80):
        x, a = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
        for split in (2, 8):
            apart = packed_matmul(x, p, split_k=split, sum_here=False)
            here = packed_matmul(x, p, split_k=split, sum_here=True)
            assert torch.equal(here, apart)
            assert int(p.counts.abs().sum()) == 0
            assert torch.equal(packed_matmul(x, p, split_k=split, add=a), a + apart)
            assert torch.equal(packed_matmul(x, p, split_k=split, add=a, sum_here=False), a + apart)
        assert torch.equal(packed_matmul(x, p, split_k=1, add=a), a + packed_matmul(x, p, split_k=1))
    assert p.counts.numel() >= 5 * 3      # 80 rows: 5 m-blocks of 16, 3 row bands
    # the first buffer (4 m-blocks) was outgrown: kept alive, at 0, for graphs captured with its address
    assert [c.numel() for c in p.old_counts] == [4 * 3] and int(p.old_counts[0].abs().sum()) == 0
    _check(here, x, p)
    with pytest.raises(ValueError, match="add must be"):
        packed_matmul(x, p, add=a[:, :-1])


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_partial_sums_added_by_the_consumer(qtype):
    """partials=True: split-K's partial sums unadded, [split, ..., N]; added in slice order they are the
    product's bits (what the gated activation relies on), for any split and row count; one slice when the
    split is 1; no `add` with them."""
    n, k = 40, 512
    p = pack_weight(_random_weight(qtype, n, k, seed=27), qtype, n, k, tile_n=16, tile_k=64)
    g = torch.Generator().manual_seed(27)
    for m in (1, 5, 20):
        x = torch.randn(m, k, generator=g)
        for split in (1, 2, 8):
            parts = packed_matmul(x, p, split_k=split, partials=True)
            assert parts.shape == (split, m, n)
            tot = parts[0]
            for i in range(1, split):
                tot = tot + parts[i]
            assert torch.equal(tot, packed_matmul(x, p, split_k=split))
    assert packed_matmul(x.view(4, 5, k), p, split_k=2, partials=True).shape == (2, 4, 5, n)
    with pytest.raises(ValueError, match="no `add`"):
        packed_matmul(x, p, split_k=2, partials=True, add=torch.zeros(20, n))


def test_stacked_weights_give_each_parts_result():
    """Weights of one tile layout stacked into one: each part becomes a view of the stack, and the stack's
    product holds each part's product, bit for bit at the same split, at its column offset; a Q6_K part
    (another layout) stays on its own. Different GGUF types of one layout stack too (Q8_0 and IQ4_NL: an
    int8 plane with an fp16 scale per 32 values); Q4_K and Q4_0 (codes or fp16 scales) do not."""
    from engine.models.common import StackedWeights
    from kernels.quant.packing import stack_rows

    class Part:      # what StackedWeights needs of a Weight
        def __init__(self, qtype, n, seed):
            self.n_out, self.n_in = n, 256
            self.gpu = pack_weight(_random_weight(qtype, n, 256, seed=seed), qtype, n, 256, tile_n=16)
            self.orig = self.gpu

        def matmul(self, x):
            return packed_matmul(x, self.gpu, split_k=2)
    parts = [Part(QT.Q4_K, 40, 1), Part(QT.Q6_K, 32, 2), Part(QT.Q4_K, 16, 3), Part(QT.Q4_K, 24, 4)]
    mixed = [Part(t, 16, 5).gpu for t in (QT.Q8_0, QT.IQ4_NL, QT.Q4_0)]
    stack_rows(mixed[:2])
    with pytest.raises(ValueError, match="same packed tile layout"):
        stack_rows([parts[0].gpu, mixed[2]])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(16))
    alone = [packed_matmul(x, w.orig, split_k=2) for w in parts]
    stack, views = stack_rows([parts[0].gpu, parts[2].gpu, parts[3].gpu])
    assert stack.n == 48 + 16 + 32 and [v.n for v in views] == [40, 16, 24]
    y = packed_matmul(x, stack, split_k=2)
    for v, w, col in zip(views, (parts[0], parts[2], parts[3]), (0, 48, 64)):
        assert torch.equal(y[:, col:col + v.n], packed_matmul(x, w.orig, split_k=2))
        assert torch.equal(dequant_packed_ref(v), dequant_packed_ref(w.orig))
        assert v.planes[0].data_ptr() >= stack.planes[0].data_ptr()     # a view, no copy
    st = StackedWeights(*parts)
    st.stack_packed()
    assert [cols for _, cols in st.groups] == [[(0, 0), (2, 48), (3, 64)]] and st.single == [1]
    outs = st.stacked_matmul(x)
    for o, a, w in zip(outs, alone, parts):
        assert o.shape == (3, w.n_out)
        _check(o, x, w.orig)
        if w is parts[1]:
            assert torch.equal(o, a)
    # prompt rows: one product per part with the fp16 operand made once, the same bits as each alone
    from engine.models.common import PREFILL_ROWS
    tok = PREFILL_ROWS.set(8)
    try:
        for o, w in zip(st._prefill(x), parts):
            assert torch.equal(o, prefill_matmul(x, w.orig, pad_rows=8))
    finally:
        PREFILL_ROWS.reset(tok)
    with pytest.raises(ValueError, match="same packed tile layout"):
        stack_rows([parts[0].orig, parts[1].orig])
    st.release()
    assert not st.groups and st.single == [0, 1, 2, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["silu", "gelu_tanh"])
def test_gated_stack_on_gpu(op):
    """StackedWeights.gated on the GPU (a gate+up stack of the 27B's FFN shape): the partial sums added by
    the activation give the bits of the stacked matmul followed by the plain activation, for decode rows and
    a small prompt chunk, and inside a CUDA graph."""
    from engine.models.common import PREFILL_ROWS, StackedWeights
    from kernels import fused

    class Part:      # what StackedWeights needs of a Weight
        def __init__(self, seed):
            self.n_out, self.n_in = 17408, 5120
            self.gpu = pack_weight(_random_weight(QT.Q4_K, 17408, 5120, seed=seed).cuda(), QT.Q4_K, 17408, 5120)
            self.orig = self.gpu
    st = StackedWeights(Part(40), Part(41))
    st.stack_packed()
    act = fused.silu_mul if op == "silu" else fused.gelu_tanh_mul
    f16 = torch.float16
    for m in (1, 4, 16, 33):
        x = torch.randn(m, 5120, device="cuda", dtype=f16)
        want = act(*st.stacked_matmul(x), f16)
        for _ in range(5):
            assert torch.equal(st.gated(x, op, f16), want)
    tok = PREFILL_ROWS.set(64)                       # a small prompt chunk
    try:
        x = torch.randn(40, 5120, device="cuda", dtype=f16)
        assert torch.equal(st.gated(x, op, f16), act(*st.stacked_matmul(x, 64), f16))
    finally:
        PREFILL_ROWS.reset(tok)
    x = torch.randn(4, 5120, device="cuda", dtype=f16)
    st.gated(x, op, f16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = st.gated(x, op, f16)
    for i in range(10):
        x.copy_(torch.randn(4, 5120, device="cuda", generator=torch.Generator("cuda").manual_seed(i)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, act(*st.stacked_matmul(x), f16))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_split_sums_in_the_kernel_on_gpu(qtype):
    """On the GPU, where k-slices really race: the engine's decode settings with the sums made by the
    last slice give the separate sum kernel's bits, every time (50 launches), also as a CUDA graph
    replayed many times (the arrival counts reset themselves), with the residual folded in."""
    from kernels.quant.packed import _sm_count, matmul_tuned, tuned_config
    n, k = 17408, 5120
    p = pack_weight(_random_weight(qtype, n, k, seed=17).cuda(), qtype, n, k)
    cfg = tuned_config(p, False, _sm_count(0), tma=torch.cuda.get_device_capability(0) >= (9, 0))
    assert cfg["split_k"] > 1
    for m in (1, 16, 33):
        x = torch.randn(m, k, device="cuda")
        a = torch.randn(m, n, device="cuda")
        apart = packed_matmul(x, p, **dict(cfg, sum_here=False))
        for _ in range(50):
            assert torch.equal(packed_matmul(x, p, **dict(cfg, sum_here=True)), apart)
        assert torch.equal(matmul_tuned(x, p, add=a), a + apart)
        assert int(p.counts.abs().sum()) == 0
    x = torch.randn(4, k, device="cuda")
    a = torch.randn(4, n, device="cuda")
    matmul_tuned(x, p, add=a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = matmul_tuned(x, p, add=a)
    for i in range(30):
        x.copy_(torch.randn(4, k, device="cuda", generator=torch.Generator("cuda").manual_seed(i)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, a + packed_matmul(x, p, **dict(cfg, sum_here=False)))
    assert int(p.counts.abs().sum()) == 0
