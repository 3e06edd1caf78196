"""kernels/cpu/paged_decode.py: one query row's K/V write and attention over a paged cache, read in place through the
block table, gives its torch reference's bits (the write into the pool and the float32 output): f16 and bf16 caches,
GQA, sliding windows with dropped blocks, scattered block ids; and its fp16 / bf16 rounding is torch's. The runner's
decode rows (paged_decode: several rows, their K/V already in the pool) give ref_paged_decode's bits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention.ref import ref_paged_decode
from kernels.cpu import paged_decode as pd
from kernels.kvcodec import get_codec

needs_numba = pytest.mark.skipif(not pd.available(), reason="numba is not installed")


@needs_numba
@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_rounding_to_16_bits_is_torchs(name):
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    vals = torch.cat([bits.view(torch.float32), torch.randn(1 << 16, generator=g) * 1e-5,
                      torch.randn(1 << 16, generator=g) * 3e4,
                      torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 6e-8, 2.98e-8, 2.9802322e-08, 5.96e-8,
                                    float("inf"), -float("inf"), -0.0, 0.0, 1e-45])])
    vals = vals[~vals.isnan()]
    dtype = get_codec(name).dtype
    out = np.empty(len(vals), np.int16)
    pd._KERNELS.get()["encode_row"](vals.view(torch.int32).numpy(), pd._KINDS[name], out)
    assert torch.equal(torch.from_numpy(out), vals.to(dtype).view(torch.int16))


def _case(name, start, window, seed, H=9, Hkv=3, D=64, n_blocks=12, drop_first=False):
    g = torch.Generator().manual_seed(seed)
    dtype = get_codec(name).dtype
    kc = torch.randn(n_blocks, 16, Hkv, D, generator=g).to(dtype).view(torch.uint8).view(n_blocks, 16, Hkv, 2 * D)
    vc = torch.randn(n_blocks, 16, Hkv, D, generator=g).to(dtype).view(torch.uint8).view(n_blocks, 16, Hkv, 2 * D)
    table = torch.randperm(n_blocks, generator=g)[:start // 16 + 1].long()
    first = 0
    if drop_first:
        table[0] = -1
        first = 16
    q = torch.randn(1, H, D, generator=g) * 2
    k, v = torch.randn(1, Hkv, D, generator=g) * 2, torch.randn(1, Hkv, D, generator=g)
    return q, k, v, kc, vc, table, first


@needs_numba
@pytest.mark.parametrize("name", ["f16", "bf16"])
@pytest.mark.parametrize("start,window,drop", [(0, 0, False), (5, 0, False), (16, 0, False), (150, 0, False),
                                              (150, 40, True), (31, 20, True), (40, 512, False)])
def test_decode_attention_gives_the_references_bits(name, start, window, drop):
    codec = get_codec(name)
    q, k, v, kc, vc, table, first = _case(name, start, window, seed=start + window, drop_first=drop)
    kc2, vc2 = kc.clone(), vc.clone()
    got = pd.decode_attention(q, k, v, kc, vc, table, first, start, 0.125, window, codec, codec)
    want = pd.ref_decode_attention(q, k, v, kc2, vc2, table, first, start, 0.125, window, codec, codec)
    assert torch.equal(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)   # the row written, in the same bits, in the same slot


@needs_numba
def test_mixed_cache_types_and_one_kv_head():
    f16, bf16 = get_codec("f16"), get_codec("bf16")
    q, k, v, kc, _, table, first = _case("f16", 70, 0, seed=3, H=4, Hkv=1)
    _, _, _, _, vc, _, _ = _case("bf16", 70, 0, seed=3, H=4, Hkv=1)
    kc2, vc2 = kc.clone(), vc.clone()
    got = pd.decode_attention(q, k, v, kc, vc, table, first, 70, 0.3, 0, f16, bf16)
    assert torch.equal(got, pd.ref_decode_attention(q, k, v, kc2, vc2, table, first, 70, 0.3, 0, f16, bf16))
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@needs_numba
@pytest.mark.parametrize("kname,vname", [("f16", "f16"), ("bf16", "bf16"), ("f16", "bf16")])
@pytest.mark.parametrize("window", [0, 20])
def test_runner_rows_give_the_references_bits(kname, vname, window):
    """Rows of several slots at several lengths, two of them one slot's consecutive positions (a draft row
    after its sequence's row), tables padded past their ends as the runner's are."""
    ck, cv = get_codec(kname), get_codec(vname)
    g = torch.Generator().manual_seed(window)
    H, Hkv, D, nb = 8, 2, 64, 20
    kc = torch.randn(nb, 16, Hkv, D, generator=g).to(ck.dtype).view(torch.uint8).view(nb, 16, Hkv, 2 * D)
    vc = torch.randn(nb, 16, Hkv, D, generator=g).to(cv.dtype).view(torch.uint8).view(nb, 16, Hkv, 2 * D)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    tables = torch.stack([perm[0:6], perm[6:12], perm[6:12], perm[12:18]])
    lengths = torch.tensor([1, 40, 41, 96], dtype=torch.int32)
    q = torch.randn(4, H, D, generator=g) * 2
    got = pd.paged_decode(q, kc, vc, tables, lengths, ck, cv, 0.125, D, window)
    want = ref_paged_decode(q, kc, vc, tables, lengths, ck, cv, 0.125, D, window)
    assert got.shape == (4, H, D) and torch.equal(got, want)


def test_other_cache_types_take_the_reference():
    codec = get_codec("q8_0")
    assert not pd.supported(codec, codec)
    assert not pd.supported(get_codec("f32"), get_codec("f16"))


@needs_numba
@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_decoding_16_bits_is_torchs_for_every_pattern(name):
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    out = np.empty(65536, np.float64)
    pd._KERNELS.get()["decode_row"](pats.numpy(), pd._KINDS[name], np.empty(65536, np.int32), out)
    want = pats.view(get_codec(name).dtype).double()
    got = torch.from_numpy(out)
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok]) and torch.equal(got[ok].signbit(), want[ok].signbit())
