"""Programmatic dependent launch (kernels/pdl.py): off where it must be, and, compiled for sm_90, every
decode kernel launched with it waits for the previous kernel before it touches memory; the packed matmul
prefetches only weights before that wait and lets its successor launch only after its tiles."""
from __future__ import annotations

import pytest
import torch

import kernels.pdl as pdl
from tests.kernels.sm90 import sm90_figures


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter():
    assert pdl.pdl_args(torch.zeros(1)) == {}
    # the test session runs Triton's interpreter, which has no grid dependency control
    assert not pdl.ENABLED


# Each kernel compiled for sm_90 with PDL=True: prints, per kernel, the PTX positions that must be in order
# (-1 where absent): the wait, the first global load or store (or cp.async) and, for the matmul, the last
# L2 prefetch, the trigger, the last wgmma and the first global store.
_SCRIPT = r"""
import re, sys
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
try:
    from tests.kernels.sm90 import compile_decode_matmul
    from kernels.fused import _rms_norm_kernel, _add_rms_norm_kernel, _heads_kernel, _gated_kernel
    from kernels.gdn.recurrent import _conv_kernel, _delta_kernel
    from kernels.attention.paged import _combine_kernel, _decode_kernel
    from kernels.attention.kv_write import _norm_rope_write_kernel, _write_kv_kernel
    from kernels.quant.packed import _rows_kernel, _sum_parts_kernel, kernel_constants
    from kernels.quant.packing import pack_weight
    from tests.kernels.test_packed import _random_weight
    from gguf import GGMLQuantizationType as QT
except ImportError as e:
    print(f"cannot compile for sm_90 here: {e}"); sys.exit(3)

def at(ptx, pat, last=False):
    m = [x.start() for x in re.finditer(pat, ptx)]
    return (m[-1] if last else m[0]) if m else -1

MEM = r"\b(ld\.global|st\.global|cp\.async\.(?!bulk\.prefetch)|atom\.global|red\.global)"

def small(fn, const, fp=(), types=()):
    types = dict(types, len_ptr="*i32", slot_ptr="*i32", bt_ptr="*i32")
    sig = {n: "constexpr" if n in const else types[n] if n in types else "*fp32" if n.endswith("_ptr")
           else "fp32" if n in fp else "i32" for n in fn.arg_names}
    ptx = triton_compile(ASTSource(fn, sig, dict(const, PDL=True)), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4)).asm["ptx"]
    return [at(ptx, r"griddepcontrol\.wait"), at(ptx, MEM)]

out = []
out += small(_rms_norm_kernel, dict(HAS_W=True, BLOCK=1024), fp=("eps",))
out += small(_add_rms_norm_kernel, dict(HAS_XW=False, HAS_W=True, BLOCK=1024), fp=("eps",))
out += small(_heads_kernel, dict(NORM=True, HAS_W=True, ROPE_DIM=64, NEOX=True, GATE=True, BLOCK_H=4, BLOCK_D=256),
             fp=("eps",))
out += small(_gated_kernel, dict(OP=0, BLOCK=1024))
out += small(_conv_kernel, dict(K=4, KP=4, DP=128), fp=("eps", "scale"))
out += small(_delta_kernel, dict(DP=128, BV=32, RAW_GATES=True))
out += small(_decode_kernel, dict(WINDOW=0, SEG=0, G=4, G_PAD=16, DK=256, DV=256, BS=16, BLOCK_T=64, MIN_KEYS=256,
                                  CODEC_K=1, CODEC_V=1, DOT="f16", SHORT_KEYS=64), fp=("scale",),
             types=dict(q_ptr="*fp16", k_ptr="*u8", v_ptr="*u8"))
out += small(_combine_kernel, dict(WINDOW=0, DV=256, BLOCK_T=64, MIN_KEYS=256, GATE=True, SHORT_KEYS=64),
             types=dict(out_ptr="*fp16"))
out += small(_write_kv_kernel, dict(K_ELEMS=1024, V_ELEMS=1024, BLOCK=1024),
             types=dict(kc_ptr="*fp16", vc_ptr="*fp16", rows_ptr="*i64"))
out += small(_norm_rope_write_kernel, dict(NORM=True, HAS_W=True, ROPE_DIM=64, NEOX=True, BLOCK_H=8, BLOCK_D=256),
             fp=("eps",), types=dict(kc_ptr="*fp16", vc_ptr="*fp16", rows_ptr="*i64"))
_q4 = pack_weight(_random_weight(QT.Q4_K, 128, 512), QT.Q4_K, 128, 512)
out += small(_rows_kernel, kernel_constants(_q4), types=dict(lo_ptr="*u8", hi_ptr="*u8", s_ptr="*fp16", m_ptr="*fp16",
                                                            sup_ptr="*fp16", ids_ptr="*i64"))
out += small(_sum_parts_kernel, dict(SPLIT=4, BLOCK=1024, HAS_ADD=False))
ptx = compile_decode_matmul(sys.argv[1], 128 if sys.argv[1] == "Q4_K" else 64, pdl=True, prefetch=1).asm["ptx"]
out += [at(ptx, r"griddepcontrol\.wait"), at(ptx, MEM), at(ptx, r"cp\.async\.bulk\.prefetch\.L2", last=True),
        len(re.findall(r"cp\.async\.bulk\.prefetch\.L2", ptx)), at(ptx, r"griddepcontrol\.launch_dependents"),
        at(ptx, r"wgmma\.mma_async", last=True), at(ptx, r"st\.global")]
print(*out)
"""


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_kernels_launched_with_pdl_wait_before_touching_memory(qtype):
    """A kernel launched with PDL starts while the previous one still runs: a load before its wait could
    read a value not yet written, a store could overwrite one still being read. Fails if a kernel given
    `pdl_args` at its launch lacks `pdl_enter`, or if the matmul's prefetch or trigger moves."""
    f = sm90_figures(_SCRIPT, qtype)
    small, mm = f[:-7], f[-7:]
    for wait, first_mem in zip(small[::2], small[1::2]):
        assert 0 <= wait < first_mem
    wait, first_mem, last_prefetch, n_prefetch, trigger, last_mma, first_store = mm
    # the weight's planes and scales (3 tensors for these two types) asked into L2, then the wait
    assert n_prefetch == 3 and 0 <= last_prefetch < wait < first_mem
    # the next kernel may launch once the tiles are multiplied, not before (earlier, it slowed the matmul)
    assert last_mma < trigger < first_store


_ENTER_SCRIPT = r"""
import re, sys
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
try:
    from kernels.fused import _gated_kernel
except ImportError as e:
    print(f"cannot compile for sm_90 here: {e}"); sys.exit(3)
sig = {n: "constexpr" if n in ("OP", "BLOCK", "PDL") else "*fp32" if n.endswith("_ptr") else "i32"
       for n in _gated_kernel.arg_names}
ptx = triton_compile(ASTSource(_gated_kernel, sig, dict(OP=0, BLOCK=1024, PDL=1)),
                     target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
print(ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"))
"""


def test_pdl_enter_orders():
    """pdl_enter lets the next kernel launch before it waits (a chain of small kernels may all be launched,
    each waiting on the one before)."""
    wait, trig = sm90_figures(_ENTER_SCRIPT)
    assert 0 <= trig < wait


def test_only_16_row_blocks_prefetch_before_the_wait():
    """The small prompt's 64-row blocks (and the wide decode blocks) compiled with the L2 prefetch gave another
    result nearly every run on the H100 (kernels/quant/packed.py: prefetch_tiles): only 16-row blocks keep it."""
    from kernels.quant.packed import PREFETCH_TILES, prefetch_tiles
    assert prefetch_tiles(16) == PREFETCH_TILES
    assert prefetch_tiles(32) == prefetch_tiles(64) == 0


@pytest.fixture(scope="module")
def gate_up_27b():
    """The 27B's gate+up stack, Q4_K 34816 x 5120, packed on the GPU (made once for the module's GPU tests)."""
    from gguf import GGMLQuantizationType as QT

    from kernels.quant.packing import pack_weight
    from tests.kernels.test_packed import _random_weight
    n, k = 34816, 5120
    return pack_weight(_random_weight(QT.Q4_K, n, k).cuda(), QT.Q4_K, n, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (9, 0)
                    or not pdl.HAVE_GDC, reason="needs an sm_90+ GPU and Triton's grid dependency control")
@pytest.mark.parametrize("rows, prefill", [(32, 64), (64, 64), (1, 0), (16, 0), (32, 0), (64, 0)])
def test_packed_matmul_same_bits_with_pdl_every_run(monkeypatch, gate_up_27b, rows, prefill):
    """The 27B's gate+up stack with PDL on, ten runs after an rms_norm each (as in the model): every run the
    bits it gets with PDL off. The small prompt's settings (prefill 64) failed this with the L2 prefetch in
    64-row blocks."""
    from kernels.fused import rms_norm
    from kernels.quant.packed import matmul_tuned
    p, k = gate_up_27b, gate_up_27b.k
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=g)
    w = torch.rand(k, device="cuda", generator=g) + 0.5

    def run():
        return matmul_tuned(rms_norm(x, w, 1e-6, torch.float16), p, prefill, partials=bool(prefill)).clone()
    monkeypatch.setattr(pdl, "ENABLED", False)
    ref = run()
    monkeypatch.setattr(pdl, "ENABLED", True)
    outs = [run() for _ in range(10)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, ref) for o in outs), max(float((o - ref).abs().max()) for o in outs)


def test_packed_matmul_launches_the_prefetch_only_in_16_row_blocks(monkeypatch):
    """packed_matmul's launch, with PDL as on a GPU: PREFETCH (tiles asked of L2 before the wait) is
    PREFETCH_TILES in 16-row blocks and 0 in 64-row ones (the blocks that gave another result nearly every run)."""
    import kernels.quant.packed as packed
    from kernels.quant.packing import pack_weight
    from gguf import GGMLQuantizationType as QT
    from tests.kernels.test_packed import _random_weight
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)
    monkeypatch.setattr(packed, "_packed_mm_kernel", Recorder())
    monkeypatch.setattr(packed, "pdl_args", lambda t, matmul=False: dict(PDL=1, launch_pdl=True))
    monkeypatch.setattr(packed, "PREFETCH_TILES", 1)
    p = pack_weight(_random_weight(QT.Q4_K, 128, 512), QT.Q4_K, 128, 512)
    for block_m in (16, 64):
        packed.packed_matmul(torch.randn(8, 512), p, block_m=block_m, split_k=1)
    assert [kw["PREFETCH"] for kw in launches] == [1, 0]
    assert all(kw["PDL"] == 1 and kw["launch_pdl"] for kw in launches)
