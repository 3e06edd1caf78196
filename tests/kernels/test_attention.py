"""Paged attention for every cache type, page size and GQA ratio: the Triton decode (split-K) and
chunked-prefill kernels (interpreter on the CPU) and the torch reference against a plain softmax
over the decoded K/V in the original domain (so the rotation trick is checked too); sliding
window with dropped blocks, qwen35's output gate, split-K invariance."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.kernels.sm90 import sm90_figures

from kernels.attention import ref_paged_attention, ref_paged_decode
from kernels.kvcodec import CACHE_TYPES, get_codec

PAIRS = [(t, t) for t in CACHE_TYPES if t != "bf16"] + [("q8_0", "turbo3"), ("turbo4", "f16"), ("f16", "turbo2_tcq")]
GQA = [(2, 2, 128), (6, 2, 64), (4, 1, 256)]   # (query heads, KV heads, head dim): ratio 1, 3, 4
PAGES = [8, 16]


def _ids(pair):
    return f"{pair[0]}-{pair[1]}"


class Cache:
    """A paged K/V cache in the given types holding random K/V for a few sequences; blocks are
    handed out in a shuffled order and the rest of the storage is random bytes (NaNs for float
    types), so a kernel reading outside its blocks or past a sequence's end shows."""

    def __init__(self, kt, vt, bs, hkv, d, lens, seed=0, n_blocks=None):
        g = torch.Generator().manual_seed(seed)
        self.ck, self.cv = get_codec(kt), get_codec(vt)
        self.bs, self.hkv, self.d = bs, hkv, d
        need = [-(-n // bs) for n in lens]
        n_blocks = n_blocks or sum(need) + 3
        self.k = torch.randint(0, 256, (n_blocks, bs, hkv, self.ck.row_bytes(d)), dtype=torch.uint8, generator=g)
        self.v = torch.randint(0, 256, (n_blocks, bs, hkv, self.cv.row_bytes(d)), dtype=torch.uint8, generator=g)
        perm = torch.randperm(n_blocks, generator=g).tolist()
        maxb = max(need)
        self.tables = torch.full((len(lens), maxb), -1, dtype=torch.int32)
        self.K, self.V = [], []             # decoded, original domain, per sequence [n, hkv, d]
        for s, n in enumerate(lens):
            ids = [perm.pop() for _ in range(need[s])]
            self.tables[s, :need[s]] = torch.tensor(ids, dtype=torch.int32)
            k = torch.randn(n, hkv, d, generator=g)
            v = torch.randn(n, hkv, d, generator=g)
            k[:, :, 3] += 4.0                 # an outlier channel, as real keys have
            pos = torch.arange(n)
            blk = self.tables[s].long()[pos // bs]
            self.k[blk, pos % bs] = self.ck.encode(k, impl="ref")
            self.v[blk, pos % bs] = self.cv.encode(v, impl="ref")
            self.K.append(self.ck.decode(self.k[blk, pos % bs], d, impl="ref"))
            self.V.append(self.cv.decode(self.v[blk, pos % bs], d, impl="ref"))


LENS = [29, 17]


@functools.lru_cache(maxsize=None)
def _cache(pair, bs, heads) -> Cache:
    """The decode and prefill tests share one cache per case (two sequences of LENS tokens)."""
    H, hkv, d = heads
    return Cache(*pair, bs, hkv, d, LENS, seed=bs + H)


def plain_attention(q, K, V, qpos, scale, window=0):
    """q [H, D] at position qpos over K, V [S, Hkv, D] at 0..S-1, one head at a time."""
    H, Hkv = q.shape[0], K.shape[1]
    out = []
    for h in range(H):
        kh = h // (H // Hkv)
        s = (K[:, kh].double() @ q[h].double()) * scale
        p = torch.arange(K.shape[0])
        vis = p <= qpos
        if window:
            vis &= qpos - p < window
        s = s.masked_fill(~vis, float("-inf"))
        out.append(torch.softmax(s, 0) @ V[:, kh].double())
    return torch.stack(out).float()


def _close(a, b, tol=2e-4):
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


triton = pytest.importorskip("triton")
from kernels.attention.paged import _row_split, paged_decode_attention, paged_prefill_attention  # noqa: E402


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("bs", PAGES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}-d{h[2]}")
def test_decode_matches_plain_softmax(pair, bs, heads):
    H, hkv, d = heads
    c = _cache(pair, bs, heads)
    q = torch.randn(len(LENS), H, d, generator=torch.Generator().manual_seed(1))
    scale = d ** -0.5
    out = paged_decode_attention(q, c.k, c.v, c.tables, torch.tensor(LENS), c.ck, c.cv, scale, d, n_split=2,
                                 block_t=16, min_keys=16)
    for b, n in enumerate(LENS):
        _close(out[b], plain_attention(q[b], c.K[b], c.V[b], n - 1, scale))


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("bs", PAGES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}-d{h[2]}")
def test_prefill_matches_plain_softmax(pair, bs, heads):
    """Two sequences in one launch: a 9-token chunk at positions 20..28 (after 20 stored tokens)
    and a first chunk of 17 tokens; each causal inside the chunk."""
    H, hkv, d = heads
    starts = [20, 0]
    c = _cache(pair, bs, heads)
    rows = [n - s for n, s in zip(LENS, starts)]
    q = torch.randn(sum(rows), H, d, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, rows[0], rows[0] + rows[1]])
    scale = 0.7 * d ** -0.5
    out = paged_prefill_attention(q, c.k, c.v, c.tables, cu, torch.tensor(starts), c.ck, c.cv, scale, d,
                                  block_m=16, block_t=16)
    for b in range(2):
        for i in range(rows[b]):
            r = int(cu[b]) + i
            _close(out[r], plain_attention(q[r], c.K[b], c.V[b], starts[b] + i, scale))


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_torch_reference_matches_plain_softmax(pair):
    H, hkv, d = 6, 2, 64
    c = Cache(*pair, 8, hkv, d, [30], seed=5)
    q = torch.randn(6, H, d, generator=torch.Generator().manual_seed(3))
    out = ref_paged_attention(q, c.k, c.v, c.tables[0], 24, c.ck, c.cv, 0.125, d)
    for i in range(6):
        _close(out[i], plain_attention(q[i], c.K[0], c.V[0], 24 + i, 0.125))
    dec = ref_paged_decode(q[:1], c.k, c.v, c.tables, torch.tensor([30]), c.ck, c.cv, 0.125, d)
    _close(dec[0], plain_attention(q[0], c.K[0], c.V[0], 29, 0.125))


@pytest.mark.parametrize("pair", [("f16", "f16"), ("turbo3", "turbo3"), ("q8_0", "turbo2_tcq")], ids=_ids)
def test_sliding_window_with_dropped_blocks(pair):
    """Window 12 over 8-token pages: blocks wholly before every query's window are dropped (-1 in
    the table, their storage garbage) as the pool does for gemma3's local layers."""
    H, hkv, d, bs, W = 4, 1, 128, 8, 12
    c = Cache(*pair, bs, hkv, d, [45], seed=6)
    c.tables[0, :3] = -1                       # positions 0..23: no query at >= 35 can see them
    q = torch.randn(10, H, d, generator=torch.Generator().manual_seed(4))
    scale = d ** -0.5
    pre = paged_prefill_attention(q, c.k, c.v, c.tables, torch.tensor([0, 10]), torch.tensor([35]), c.ck, c.cv,
                                  scale, d, window=W, block_m=16, block_t=16)
    ref = ref_paged_attention(q, c.k, c.v, c.tables[0], 35, c.ck, c.cv, scale, d, window=W)
    dec = paged_decode_attention(q[-1:], c.k, c.v, c.tables, torch.tensor([45]), c.ck, c.cv, scale, d,
                                 window=W, n_split=2, block_t=16, min_keys=16)
    for i in range(10):
        want = plain_attention(q[i], c.K[0], c.V[0], 35 + i, scale, window=W)
        _close(pre[i], want)
        _close(ref[i], want)
    _close(dec[0], plain_attention(q[-1], c.K[0], c.V[0], 44, scale, window=W))


@pytest.mark.parametrize("vt", ["f16", "q8_0", "turbo3"])
def test_output_gate_in_the_merge_kernel(vt):
    """Decode rows with qwen35's output gate (a strided view of the Q|gate projection) and an fp16 result:
    where V is not rotated the merge kernel gates and rounds, the same bits as the attention then
    kernels/fused.py's sigmoid gate; a rotated V (turbo3) gets the torch gate afterwards, within rounding."""
    from kernels.attention.paged import paged_decode_attention
    from kernels.fused import triton_sigmoid_gate_mul
    B, H, hkv, d = 2, 4, 2, 128
    c = Cache("f16", vt, 16, hkv, d, [21, 40], seed=9)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, d, generator=g)
    gate = (torch.randn(B, H, 2 * d, generator=g) * 3)[..., d:]
    lens = torch.tensor([21, 40])
    out = paged_decode_attention(q, c.k, c.v, c.tables, lens, c.ck, c.cv, 0.1, d, gate=gate, out_dtype=torch.float16,
                                 block_t=16)
    plain = paged_decode_attention(q, c.k, c.v, c.tables, lens, c.ck, c.cv, 0.1, d, block_t=16)
    want = triton_sigmoid_gate_mul(plain, gate, torch.float16)
    assert out.dtype == torch.float16 and out.shape == (B, H, d)
    if vt == "turbo3":
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    else:
        assert torch.equal(out, want)


def test_qwen35_output_gate():
    H, hkv, d = 4, 2, 128
    c = Cache("turbo3_tcq", "turbo3_tcq", 16, hkv, d, [21], seed=7)
    q = torch.randn(1, H, d, generator=torch.Generator().manual_seed(5))
    gate = torch.randn(1, H, d, generator=torch.Generator().manual_seed(6))
    out = paged_decode_attention(q, c.k, c.v, c.tables, torch.tensor([21]), c.ck, c.cv, 0.1, d, gate=gate, block_t=16)
    pre = paged_prefill_attention(q, c.k, c.v, c.tables, torch.tensor([0, 1]), torch.tensor([20]), c.ck, c.cv, 0.1, d,
                                  gate=gate, block_t=16)
    want = plain_attention(q[0], c.K[0], c.V[0], 20, 0.1) * torch.sigmoid(gate[0])
    _close(out[0], want)
    _close(pre[0], want)


def test_split_k_gives_the_same_result():
    H, hkv, d = 8, 2, 128
    c = Cache("turbo4", "turbo4", 16, hkv, d, [150, 3], seed=8)
    q = torch.randn(2, H, d, generator=torch.Generator().manual_seed(7))
    lens = torch.tensor([150, 3])
    outs = [paged_decode_attention(q, c.k, c.v, c.tables, lens, c.ck, c.cv, 0.09, d, n_split=s, block_t=32,
                                   min_keys=32) for s in (1, 3, 7)]
    for o in outs[1:]:
        _close(o, outs[0], 1e-5)
    _close(outs[0][0], plain_attention(q[0], c.K[0], c.V[0], 149, 0.09))


def test_decode_splits_depend_on_the_row_alone():
    """A row's result is bit-identical whether it runs alone or beside a longer row (the longer
    row uses more split-K programs; the short row's split stays as it was)."""
    H, hkv, d = 4, 2, 64
    c = Cache("f16", "q8_0", 16, hkv, d, [40, 300], seed=9)
    q = torch.randn(2, H, d, generator=torch.Generator().manual_seed(3))
    both = paged_decode_attention(q, c.k, c.v, c.tables, torch.tensor([40, 300]), c.ck, c.cv, 0.1, d, n_split=8,
                                  block_t=16, min_keys=16)
    alone = paged_decode_attention(q[:1], c.k, c.v, c.tables[:1], torch.tensor([40]), c.ck, c.cv, 0.1, d,
                                   n_split=8, block_t=16, min_keys=16)
    assert torch.equal(both[0], alone[0])
    _close(both[1], plain_attention(q[1], c.K[1], c.V[1], 299, 0.1))


@triton.jit
def _split_probe(len_ptr, out_ptr, NSPLIT, MIN_KEYS: triton.language.constexpr,
                 BLOCK_T: triton.language.constexpr, SHORT_KEYS: triton.language.constexpr):
    b = triton.language.program_id(0)
    L, lo, per = _row_split(len_ptr, b, NSPLIT, 0, MIN_KEYS, BLOCK_T, SHORT_KEYS)
    triton.language.store(out_ptr + b, per)


@pytest.mark.parametrize("short", [64, 0])
def test_short_rows_get_about_eight_split_programs(short):
    """The float caches' split (64 programs at most, 256 keys each at least, tiles of 64): a row under
    8 * 256 keys is cut into about 8 programs of at least 64 keys (short_keys), longer rows by min_keys;
    short_keys 0 splits every row by min_keys. Keys per program by row length:"""
    lens = torch.tensor([1, 128, 512, 1000, 1024, 2048, 4096, 23000], dtype=torch.int32)
    per = torch.zeros(len(lens), dtype=torch.int32)
    _split_probe[(len(lens),)](lens, per, 64, MIN_KEYS=256, BLOCK_T=64, SHORT_KEYS=short)
    want = [64, 64, 64, 128, 128, 256, 256, 384] if short else [256] * 7 + [384]
    assert per.tolist() == want


def test_short_splits_depend_on_the_row_alone():
    """Short rows split into more programs (short_keys) are still right and still bit-identical alone or
    beside other rows."""
    H, hkv, d = 4, 2, 64
    c = Cache("f16", "f16", 16, hkv, d, [40, 300, 130], seed=11)
    q = torch.randn(3, H, d, generator=torch.Generator().manual_seed(5))
    kw = dict(n_split=8, block_t=16, min_keys=128, short_keys=16)
    both = paged_decode_attention(q, c.k, c.v, c.tables, torch.tensor([40, 300, 130]), c.ck, c.cv, 0.1, d, **kw)
    for b, n in enumerate([40, 300, 130]):
        alone = paged_decode_attention(q[b:b + 1], c.k, c.v, c.tables[b:b + 1], torch.tensor([n]), c.ck, c.cv,
                                       0.1, d, **kw)
        assert torch.equal(both[b], alone[0])
        _close(both[b], plain_attention(q[b], c.K[b], c.V[b], n - 1, 0.1))


@pytest.mark.parametrize("precision", ["tf32", "f16"])
def test_decode_precision_option(precision):
    """The decode kernel's tensor-core dots (what the runner uses on CUDA) stay within fp16 rounding of
    the plain softmax."""
    H, hkv, d = 8, 2, 128
    c = Cache("f16", "f16", 16, hkv, d, [200], seed=10)
    q = torch.randn(1, H, d, generator=torch.Generator().manual_seed(4))
    out = paged_decode_attention(q, c.k, c.v, c.tables, torch.tensor([200]), c.ck, c.cv, 0.09, d, n_split=4,
                                 block_t=32, min_keys=32, precision=precision)
    _close(out[0], plain_attention(q[0], c.K[0], c.V[0], 199, 0.09), 5e-3)


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}-d{h[2]}")
def test_segment_bias_matches_einsum(heads):
    """The decode steps' score-correction table from a slot-indexed centers buffer (engine/runner.py)
    equals SequenceKV.score_bias's einsum; a row's numbers do not depend on the other rows."""
    from kernels.attention.paged import segment_bias
    H, hkv, d = heads
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, H, d, generator=g)
    centers = torch.randn(4, 37, hkv, d, generator=g)          # 37 segments: the last block partial
    slots = torch.tensor([2, 0, 3])
    out = segment_bias(q, centers, slots)
    want = torch.einsum("nkgd,nskd->nkgs", q.reshape(3, hkv, H // hkv, d), centers[slots]).reshape(3, H, 37)
    _close(out, want, 1e-5)
    assert torch.equal(segment_bias(q[1:2], centers, slots[1:2])[0], out[1])


def test_prefill_precision_option():
    """precision="tf32" (the runner's prompt chunks on CUDA) and a given `longest`: in the interpreter,
    which computes every dot in fp32, the ieee result; on a GPU within tf32 rounding of it."""
    H, hkv, d = GQA[1]
    c = _cache(("turbo3", "q8_0"), 16, GQA[1])
    q = torch.randn(9, H, d, generator=torch.Generator().manual_seed(3))
    args = (q, c.k, c.v, c.tables[:1], torch.tensor([0, 9]), torch.tensor([20]), c.ck, c.cv, 0.1, d)
    a = paged_prefill_attention(*args, block_t=16)
    b = paged_prefill_attention(*args, block_t=16, precision="tf32", longest=9)
    _close(b, a, 3e-3)
    for i in range(9):
        _close(a[i], plain_attention(q[i], c.K[0], c.V[0], 20 + i, 0.1))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [("f16", "f16"), ("q8_0", "q8_0"), ("turbo4", "turbo4"), ("turbo3_tcq", "turbo3_tcq"),
                                  ("turbo2_tcq", "turbo2_tcq")], ids=_ids)
def test_gpu_decode_at_the_27b_shape(pair):
    """On CUDA with the engine's settings (decode: f16 tensor-core dots, 64 split-K programs; prompt chunks:
    tf32 dots): the 27B's attention shape (24 query heads, 4 KV heads of 256) over 3000 keys, against a
    plain softmax. (A decoder whose values were right went wrong only in an fp16 tensor-core dot.)"""
    H, hkv, d = 24, 4, 256
    lens = [3000, 1111]
    c = Cache(*pair, 16, hkv, d, lens, seed=5)
    q = torch.randn(len(lens), H, d, generator=torch.Generator().manual_seed(2))
    scale = d ** -0.5
    dev = torch.device("cuda")
    out = paged_decode_attention(q.to(dev), c.k.to(dev), c.v.to(dev), c.tables.to(dev), torch.tensor(lens, device=dev),
                                 c.ck, c.cv, scale, d, n_split=64, precision="f16").cpu()
    for b, n in enumerate(lens):
        _close(out[b], plain_attention(q[b], c.K[b], c.V[b], n - 1, scale), tol=2e-3)
    # prompt chunks as the runner runs them (tf32 tensor-core dots): each sequence's last 24 positions
    starts = [n - 24 for n in lens]
    qp = torch.randn(48, H, d, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 24, 48])
    out = paged_prefill_attention(qp.to(dev), c.k.to(dev), c.v.to(dev), c.tables.to(dev), cu.to(dev),
                                  torch.tensor(starts, device=dev), c.ck, c.cv, scale, d, precision="tf32").cpu()
    for b in range(2):
        for i in range(0, 24, 5):
            _close(out[24 * b + i], plain_attention(qp[24 * b + i], c.K[b], c.V[b], starts[b] + i, scale), tol=2e-3)



_PTX_SCRIPT = r"""
import re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.attention.paged as paged
from kernels.kvcodec import get_codec
fn, f16 = paged._decode_kernel, get_codec("f16")
ptrs = {"q_ptr": "*fp32", "k_ptr": "*u8", "v_ptr": "*u8", "bt_ptr": "*i32", "len_ptr": "*i32",
        "cbk_ptr": "*fp32", "cbv_ptr": "*fp32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "sb_ptr": "*fp32"}
cfg = paged.decode_config(f16, f16)
const = dict(WINDOW=0, SEG=0, G=6, G_PAD=16, DK=256, DV=256, BS=16, BLOCK_T=cfg["block_t"],
             MIN_KEYS=cfg["min_keys"], CODEC_K=f16.codec_id, CODEC_V=f16.codec_id, DOT="f16",
             SHORT_KEYS=cfg["short_keys"])
sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "scale" else "i32") for n in fn.arg_names}
# what the launcher specializes: pointers and row sizes divisible by 16
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptrs or n in ("RBK", "RBV")}
try:
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
except (RuntimeError, FileNotFoundError) as e:
    print("cannot compile for sm_90 here:", e)
    sys.exit(3)
ptx = k.asm["ptx"]
# 2-byte loads (plain or asynchronous), and 16-byte ones (plain, or cp.async when the loop is pipelined)
small = len(re.findall(r"ld\.global(\.\w+)*\.b16", ptx)) + len(re.findall(r"cp\.async\S* .*, 0x2,", ptx))
wide = len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx)) + len(re.findall(r"cp\.async\S* .*, 0x10,", ptx))
print(small, wide)
"""


def test_decode_kernel_reads_float_rows_16_bytes_at_a_time():
    """The f16 decode attention compiled for the H200 (sm_90; no GPU needed: Triton's own compiler and
    ptxas, in a process without TRITON_INTERPRET) loads K/V rows with 16-byte vector loads, not one 2-byte
    load per value (addressed as bytes and cast, every value was a load of its own and the kernel ran at
    ~0.6 TB/s; docs/PERFORMANCE.md)."""
    pytest.importorskip("triton")
    small, wide = sm90_figures(_PTX_SCRIPT)[-2:]
    assert small == 0
    assert wide >= 8
