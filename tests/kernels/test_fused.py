"""kernels/fused.py: every Triton kernel against its torch reference (odd small shapes, strided
views, partial rotary, both rope layouts, argmax ties / NaN / -inf and rows not a multiple of the
block), the references against the model code they stand for, and the dispatchers. On the CPU the
kernels run in Triton's interpreter; the `gpu` tests use real model sizes and a CUDA graph."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import fused  # noqa: E402
from kernels.fused import (  # noqa: E402
    force_triton, ref_add_rms_norm, ref_argmax_rows, ref_gelu_tanh_mul, ref_head_rms_norm, ref_head_rms_norm_silu,
    ref_qk_norm_rope, ref_rms_norm, ref_rope, ref_sigmoid_gate_mul, ref_silu_mul, triton_add_rms_norm,
    triton_argmax_rows, triton_gelu_tanh_mul, triton_head_rms_norm, triton_head_rms_norm_silu, triton_qk_norm_rope,
    triton_rms_norm, triton_rope, triton_sigmoid_gate_mul, triton_silu_mul)

# the interpreter evaluates exp(-x) in numpy, which warns where it overflows to inf (as intended)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

EPS = 1e-6
RTOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(out: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL):
    """Within rtol of each value, or of the tensor's scale for values near zero."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    finite = ref[ref.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * scale * 0.1, equal_nan=True)


def _cos_sin(n: int, rope_dim: int, base: float = 10000.0, start: int = 5):
    """Tables as engine.models.common.Rope.cos_sin builds them (float64 angles)."""
    inv = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    theta = torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv[None, :]
    return theta.cos().float(), theta.sin().float()


# --------------------------------------------------------------------------- norms

@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("e", [96, 160])
@pytest.mark.parametrize("with_w", [True, False])
def test_rms_norm(n, e, with_w):
    g = _gen(n * e)
    x = torch.randn(n, e, generator=g) * 3
    w = torch.randn(e, generator=g) if with_w else None
    _close(triton_rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))


def test_rms_norm_strided_rows():
    g = _gen(1)
    big = torch.randn(5, 2 * 96, generator=g)
    x = big[:, 96:]  # row stride 192
    w = torch.randn(96, generator=g)
    _close(triton_rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("e", [96, 160])
@pytest.mark.parametrize("post_norm", [False, True])
def test_add_rms_norm(n, e, post_norm):
    g = _gen(100 + n * e)
    x, res = torch.randn(n, e, generator=g), torch.randn(n, e, generator=g) * 4
    w = torch.randn(e, generator=g)
    xw = torch.randn(e, generator=g) if post_norm else None
    out, new_res = triton_add_rms_norm(x, res, w, EPS, xw)
    ref_out, ref_res = ref_add_rms_norm(x, res, w, EPS, xw)
    _close(new_res, ref_res)
    _close(out, ref_out)
    if not post_norm:
        assert torch.equal(new_res, x + res)


def test_add_rms_norm_without_weight():
    g = _gen(7)
    x, res = torch.randn(3, 160, generator=g), torch.randn(3, 160, generator=g)
    out, new_res = triton_add_rms_norm(x, res, None, EPS)
    _close(out, ref_rms_norm(x + res, None, EPS))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("d", [64, 80])
def test_head_rms_norm(n, d):
    g = _gen(n + d)
    x = torch.randn(n, 3, d, generator=g) * 2
    w = torch.randn(d, generator=g)
    _close(triton_head_rms_norm(x, w, EPS), ref_head_rms_norm(x, w, EPS))
    _close(triton_head_rms_norm(x, None, EPS), ref_head_rms_norm(x, None, EPS))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("d", [64, 80])
def test_head_rms_norm_silu(n, d):
    """Qwen3.5's DeltaNet output: silu(z) * RMSNorm(o) per head in one kernel, z a strided view of the
    stacked projection; the float32 result, and fp16 as the norm then the gate kernel round it."""
    g = _gen(7 * n + d)
    x = torch.randn(n, 3, d, generator=g) * 2
    z = torch.randn(n, 3 * d + 5, generator=g)[:, :3 * d].view(n, 3, d) * 3
    w = torch.randn(d, generator=g)
    _close(triton_head_rms_norm_silu(x, w, EPS, z), ref_head_rms_norm_silu(x, w, EPS, z))
    assert torch.equal(ref_head_rms_norm_silu(x, w, EPS, z), ref_silu_mul(z, ref_head_rms_norm(x, w, EPS)))
    two = triton_silu_mul(z, triton_head_rms_norm(x, w, EPS), torch.float16)
    assert torch.equal(triton_head_rms_norm_silu(x, w, EPS, z, torch.float16), two)
    with pytest.raises(ValueError, match="differ"):
        triton_head_rms_norm_silu(x, w, EPS, z[:, :2])


# --------------------------------------------------------------------------- rope

@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("rope_dim", [32, 64])
@pytest.mark.parametrize("neox", [False, True])
def test_rope(n, rope_dim, neox):
    x = torch.randn(n, 3, 64, generator=_gen(n * rope_dim + neox))
    cos, sin = _cos_sin(n, rope_dim)
    _close(triton_rope(x, cos, sin, rope_dim, neox), ref_rope(x, cos, sin, rope_dim, neox))


@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("rope_dim", [32, 64])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("with_w", [True, False])
def test_qk_norm_rope(n, rope_dim, neox, with_w):
    g = _gen(1000 + n * rope_dim + neox)
    x = torch.randn(n, 3, 64, generator=g) * 2
    w = torch.randn(64, generator=g) if with_w else None
    cos, sin = _cos_sin(n, rope_dim, start=1000)
    out = triton_qk_norm_rope(x, w, EPS, cos, sin, rope_dim, neox)
    _close(out, ref_qk_norm_rope(x, w, EPS, cos, sin, rope_dim, neox))


def test_qk_norm_rope_strided_view():
    """qwen35: q is qg[..., :hd] of the joint [N, H, 2*hd] Q|gate projection."""
    n, h, hd, rope_dim = 3, 3, 64, 32
    g = _gen(5)
    qg = torch.randn(n, h, 2 * hd, generator=g)
    q = qg[..., :hd]
    w = torch.randn(hd, generator=g)
    cos, sin = _cos_sin(n, rope_dim)
    _close(triton_qk_norm_rope(q, w, EPS, cos, sin, rope_dim, True),
           ref_qk_norm_rope(q, w, EPS, cos, sin, rope_dim, True))


def test_references_match_model_code():
    common = pytest.importorskip("engine.models.common")
    g = _gen(9)
    x = torch.randn(3, 3, 64, generator=g)
    w = torch.randn(64, generator=g)
    assert torch.equal(ref_rms_norm(x, w, EPS), common.rms_norm(x, w, EPS))
    for rope_dim in (32, 64):
        for neox in (False, True):
            r = common.Rope(rope_dim, 10000.0, neox=neox)
            cos, sin = r.cos_sin(torch.tensor([0, 17, 4000]))
            assert torch.equal(ref_rope(x, cos, sin, rope_dim, neox), r.apply(x, cos, sin))


# --------------------------------------------------------------------------- gated activations

@pytest.mark.parametrize("shape", [(1, 160), (3, 96), (7, 2100), (2, 3, 64)])
def test_silu_and_gelu_mul(shape):
    g = _gen(sum(shape))
    gate, up = torch.randn(shape, generator=g) * 4, torch.randn(shape, generator=g)
    _close(triton_silu_mul(gate, up), ref_silu_mul(gate, up))
    _close(triton_gelu_tanh_mul(gate, up), ref_gelu_tanh_mul(gate, up))


def test_gelu_tanh_tails():
    """Large |x| (torch's 1 + tanh(u) cancels for x < -3: values there agree to ~1e-7 absolute,
    not relative) and the specials: inf, -inf and NaN give torch's inf, NaN, NaN."""
    gate = torch.linspace(-30, 30, 2001).view(3, 667)
    gate[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -1e30, 1e30])
    up = torch.ones_like(gate)
    out, ref = triton_gelu_tanh_mul(gate, up), ref_gelu_tanh_mul(gate, up)
    _close(out, ref)
    out, ref = triton_silu_mul(gate, up), ref_silu_mul(gate, up)
    _close(out, ref)


def test_gated_cat_halves():
    gu = torch.randn(3, 2 * 160, generator=_gen(3)) * 3
    with force_triton():
        _close(fused.silu_mul_cat(gu), ref_silu_mul(gu[:, :160], gu[:, 160:]))
        _close(fused.gelu_tanh_mul_cat(gu), ref_gelu_tanh_mul(gu[:, :160], gu[:, 160:]))


@pytest.mark.parametrize("op", ["silu", "gelu_tanh"])
def test_gated_sum_parts(op):
    """The gated activation of split-K partial sums: the sums added in slice order then the activation,
    the same bits as adding first and running the plain kernel (Triton), the reference alike; fp16 out; bad
    arguments refused."""
    g = _gen(31)
    parts = torch.randn(5, 3, 2 * 96 + 32, generator=g) * 2          # 5 slices, 3 rows, gate | up | padding
    gate, up = parts[0, :, :96].clone(), parts[0, :, 128:224].clone()
    for i in range(1, 5):
        gate, up = gate + parts[i, :, :96], up + parts[i, :, 128:224]
    tri = fused.triton_gated_sum_parts(parts, 0, 128, 96, op, torch.float16)
    plain = (triton_silu_mul if op == "silu" else triton_gelu_tanh_mul)(gate, up, torch.float16)
    assert tri.dtype == torch.float16 and torch.equal(tri, plain)
    ref = fused.ref_gated_sum_parts(parts, 0, 128, 96, op)
    assert torch.equal(ref, (ref_silu_mul if op == "silu" else ref_gelu_tanh_mul)(gate, up))
    _close(fused.triton_gated_sum_parts(parts, 0, 128, 96, op), ref)
    one = parts[:1].contiguous()                                       # one slice: no sums
    assert torch.equal(fused.triton_gated_sum_parts(one, 0, 128, 96, op),
                       (triton_silu_mul if op == "silu" else triton_gelu_tanh_mul)(one[0, :, :96], one[0, :, 128:224]))
    with pytest.raises(ValueError, match="do not fit"):
        fused.triton_gated_sum_parts(parts, 0, 200, 96, op)
    with pytest.raises(ValueError, match="op must be"):
        fused.gated_sum_parts(parts, 0, 128, 96, "relu")


def test_sigmoid_gate_mul():
    """Same shapes, and qwen35's layout: a [N, H*D], gate a strided [N, H, D] view of Q|gate."""
    n, h, hd = 3, 3, 64
    g = _gen(11)
    a = torch.randn(n, h * hd, generator=g)
    gate = torch.randn(n, h * hd, generator=g) * 5
    _close(triton_sigmoid_gate_mul(a, gate), ref_sigmoid_gate_mul(a, gate))
    qg = torch.randn(n, h, 2 * hd, generator=g) * 5
    view = qg[..., hd:]
    out = triton_sigmoid_gate_mul(a, view)
    assert out.shape == a.shape
    _close(out, a * torch.sigmoid(view.reshape(n, h * hd)))
    _close(ref_sigmoid_gate_mul(a, view), a * torch.sigmoid(view.reshape(n, h * hd)))


def test_fp16_outputs_are_the_float32_results_rounded():
    """out_dtype=fp16 (a packed matmul's input, Weight.input_dtype): the kernels write their float32
    result rounded to nearest, the same bits as rounding the float32 output afterwards (what the matmul
    did to its x before), for the norm and each gate; the references round the same way."""
    g = _gen(21)
    x, w = torch.randn(3, 160, generator=g) * 3, torch.randn(160, generator=g)
    a, b = torch.randn(3, 2, 96, generator=g) * 3, torch.randn(3, 2, 96, generator=g) * 3
    f16 = torch.float16
    assert torch.equal(triton_rms_norm(x, w, EPS, f16), triton_rms_norm(x, w, EPS).to(f16))
    assert triton_rms_norm(x, w, EPS, f16).dtype == f16
    for tri, ref in ((triton_silu_mul, ref_silu_mul), (triton_gelu_tanh_mul, ref_gelu_tanh_mul),
                     (triton_sigmoid_gate_mul, ref_sigmoid_gate_mul)):
        out = tri(a, b, f16)
        assert out.dtype == f16 and torch.equal(out, tri(a, b).to(f16))
        assert torch.equal(ref(a, b, f16), ref(a, b).to(f16))
    assert torch.equal(ref_rms_norm(x, w, EPS, f16), ref_rms_norm(x, w, EPS).to(f16))
    with force_triton():
        assert torch.equal(fused.rms_norm(x, w, EPS, f16), triton_rms_norm(x, w, EPS).to(f16))
        assert torch.equal(fused.silu_mul(a, b, f16), triton_silu_mul(a, b).to(f16))


# --------------------------------------------------------------------------- argmax

@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("v", [1, 130, 1000, 3001])
def test_argmax_blocked(n, v):
    x = torch.randn(n, v, generator=_gen(n * v))
    for kw in (dict(block=64, chunk=256), dict(block=128, chunk=128), {}):
        assert torch.equal(triton_argmax_rows(x, **kw), ref_argmax_rows(x)), kw


def test_argmax_ties_and_specials():
    v = 1537
    x = torch.randn(6, v, generator=_gen(2))
    x[0, [700, 5, 1536]] = 10.0                    # ties across chunks: lowest index wins
    x[1, [300, 301]] = 10.0                        # ties in adjacent lanes of one block
    x[2, [64, 128, 192]] = 10.0                    # same lane, successive blocks
    x[3] = float("-inf")                           # all -inf: index 0
    x[4, [900, 40]] = float("nan")                 # NaN counts as the maximum, first NaN wins
    x[4, 10] = float("inf")
    x[5] = 0.0                                     # all equal
    ref = ref_argmax_rows(x)
    assert ref.tolist() == [5, 300, 64, 0, 40, 0]
    # block=16: pass 2 also loops (49 chunk winners in blocks of 16)
    for kw in (dict(block=64, chunk=256), dict(block=64, chunk=64), dict(block=16, chunk=32), {}):
        assert torch.equal(triton_argmax_rows(x, **kw), ref), kw


def test_argmax_strided_and_half():
    big = torch.randn(3, 2 * 777, generator=_gen(4))
    x = big[:, :777]
    assert torch.equal(triton_argmax_rows(x, block=64, chunk=256), ref_argmax_rows(x))
    h = x.half()
    assert torch.equal(triton_argmax_rows(h, block=64, chunk=256), ref_argmax_rows(h))


# --------------------------------------------------------------------------- dispatch

def test_dispatch():
    g = _gen(12)
    x = torch.randn(3, 96, generator=g)
    w = torch.randn(96, generator=g)
    assert torch.equal(fused.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))  # CPU: the reference
    with force_triton():
        assert fused.use_triton(x)
        assert torch.equal(fused.rms_norm(x, w, EPS), triton_rms_norm(x, w, EPS))
        assert torch.equal(fused.argmax_rows(x), ref_argmax_rows(x))
    assert not fused.use_triton(x)


# --------------------------------------------------------------------------- real sizes (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5, 64])
def test_gpu_norms_real_size(n):
    dev, e = "cuda", 5120
    g = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(n, e, device=dev, generator=g) * 3
    res = torch.randn(n, e, device=dev, generator=g) * 10
    w, xw = torch.randn(e, device=dev, generator=g), torch.randn(e, device=dev, generator=g)
    _close(triton_rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))
    for post in (None, xw):
        out, new_res = triton_add_rms_norm(x, res, w, EPS, post)
        ref_out, ref_res = ref_add_rms_norm(x, res, w, EPS, post)
        _close(new_res, ref_res)
        _close(out, ref_out)


@pytest.mark.gpu
@pytest.mark.parametrize("h,d,rope_dim,neox", [(40, 128, 128, True), (8, 256, 64, True), (32, 128, 128, False),
                                               (16, 256, 256, True)])
def test_gpu_qk_norm_rope_real_size(h, d, rope_dim, neox):
    dev, n = "cuda", 7
    g = torch.Generator(device=dev).manual_seed(h + d)
    x = torch.randn(n, h, d, device=dev, generator=g)
    w = torch.randn(d, device=dev, generator=g)
    cos, sin = (t.to(dev) for t in _cos_sin(n, rope_dim, start=100000))
    _close(triton_qk_norm_rope(x, w, EPS, cos, sin, rope_dim, neox),
           ref_qk_norm_rope(x, w, EPS, cos, sin, rope_dim, neox))
    _close(triton_rope(x, cos, sin, rope_dim, neox), ref_rope(x, cos, sin, rope_dim, neox))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16])
def test_gpu_head_rms_norm_silu_real_size(n):
    """The 27B's DeltaNet output (48 heads of 128), fp16 out: as the norm and the gate kernels make it apart,
    to one fp16 rounding step (on the GPU the two compile their float32 math differently: measured, a few
    values one step apart at 16 rows), and as the reference."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(n, 48, 128, device=dev, generator=g)
    z = torch.randn(n, 2 * 48 * 128, device=dev, generator=g)[:, 48 * 128:].view(n, 48, 128) * 3
    w = torch.randn(128, device=dev, generator=g)
    out = triton_head_rms_norm_silu(x, w, EPS, z, torch.float16)
    two = triton_silu_mul(z, triton_head_rms_norm(x, w, EPS), torch.float16).float()
    assert ((out.float() - two).abs() <= two.abs() * 2.0 ** -10 + 2.0 ** -24).all()
    _close(out.float(), ref_head_rms_norm_silu(x, w, EPS, z, torch.float16).float(), rtol=2e-3)


@pytest.mark.gpu
def test_gpu_gated_real_size():
    dev, n, f = "cuda", 5, 17408
    g = torch.Generator(device=dev).manual_seed(0)
    gate, up = torch.randn(n, f, device=dev, generator=g) * 4, torch.randn(n, f, device=dev, generator=g)
    _close(triton_silu_mul(gate, up), ref_silu_mul(gate, up))
    _close(triton_gelu_tanh_mul(gate, up), ref_gelu_tanh_mul(gate, up))
    qg = torch.randn(n, 24, 512, device=dev, generator=g)
    a = torch.randn(n, 24 * 256, device=dev, generator=g)
    _close(triton_sigmoid_gate_mul(a, qg[..., 256:]), ref_sigmoid_gate_mul(a, qg[..., 256:]))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 33])
def test_gpu_argmax_real_size(n):
    dev, v = "cuda", 248320
    g = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(n, v, device=dev, generator=g)
    x[0, [v - 1, 123457, 99]] = 50.0  # tie: lowest index wins
    if n > 1:
        x[1, v - 1] = 60.0
    assert torch.equal(triton_argmax_rows(x), ref_argmax_rows(x))
    assert torch.equal(triton_argmax_rows(x.bfloat16()), ref_argmax_rows(x.bfloat16()))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """The ops captured in a CUDA graph and replayed on new inputs give the eager results."""
    dev, n, e, h, d = "cuda", 4, 5120, 8, 128
    x = torch.randn(n, e, device=dev)
    res = torch.randn(n, e, device=dev)
    w = torch.randn(e, device=dev)
    q = torch.randn(n, h, d, device=dev)
    wq = torch.randn(d, device=dev)
    cos, sin = (t.to(dev) for t in _cos_sin(n, d))
    logits = torch.randn(n, 248320, device=dev)

    def step():
        hn, r = triton_add_rms_norm(x, res, w, EPS)
        qr = triton_qk_norm_rope(q, wq, EPS, cos, sin, d, True)
        act = triton_silu_mul(hn, r)
        return hn, r, qr, act, triton_argmax_rows(logits)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, res, q, logits):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, step()):
        assert torch.equal(a, b)
