"""Every Triton kernel launch the engine can make, per GPU family: a registry for compiling them ahead of time
(tests/kernels/test_aot_families.py compiles each for sm_80, sm_86, sm_89 and sm_120 without a GPU and checks
its shared memory and registers against the family's limits, kernels/family.py).

The settings come from the kernels' own config functions and tables (tuned_config, small_prompt,
wide_decode_rows, decode_config, the families' tables), so a setting changed there is what gets compiled here;
the compile-time constants the launch sites derive from shapes (heads, head sizes, tiles) are enumerated over
the shapes the supported models have. `Launch.key` identifies a compile: launches with the same kernel,
argument types, constants and options compile to the same code and are compiled once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from kernels.family import Family

# a 128-row tile is taken for matrices of at least this many rows, 64 below (kernels/packed_layout.py); the
# sizes used to get each (the 27B's: 5120 and 17408 outputs, 5120 inputs)
_ROWS_FOR_TILE = {64: 5120, 128: 17408}
# K for each tile width: the 27B's 5120 for 128 and 256, an odd multiple for 32 and 64 (what default_tile_k
# gives such a K)
_K_FOR_TILE = {32: 32 * 81, 64: 64 * 81, 128: 5120, 256: 5120}
# SMs of one common card of each family (RTX 3090, A100, H100, B200, RTX 5090): the split-K a decode matmul gets
# follows from it (another card of the family gets other splits: the same code but for the number of partial sums)
SM_COUNT = {"sm80": 108, "sm86": 82, "sm90": 132, "sm100": 148, "sm120": 170}
# the head sizes and query heads per KV head of the supported models' attention (SmolLM2 64, Qwen3 128,
# Gemma3 and Qwen3.5/3.6 256; 1 to 6 query heads per KV head)
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 6)


@dataclass
class Launch:
    """One compile: a kernel (a triton JITFunction), its argument types (name -> "*fp16", "i32",
    "constexpr" ...), constants, options (num_warps, num_stages, maxnreg) and a readable name."""
    name: str
    fn: object
    signature: dict
    constants: dict
    options: dict
    divisible: tuple = field(default=())   # arguments the launcher specializes as multiples of 16

    @property
    def key(self) -> tuple:
        return (getattr(self.fn, "__module__", ""), _name(self.fn), tuple(sorted(self.signature.items())),
                tuple(sorted((k, str(v)) for k, v in self.constants.items())), tuple(sorted(self.options.items())),
                self.divisible)


_NONE = object()


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or fn.fn.__name__


def _constexpr_params(fn) -> list[tuple[str, object]]:
    """(name, default or _NONE) of a kernel's constexpr arguments: from the JITFunction's params, or under
    Triton's interpreter (an InterpretedFunction) from the Python function's annotations."""
    if hasattr(fn, "params"):
        return [(p.name, p.default if p.has_default else _NONE) for p in fn.params if p.is_constexpr]
    import inspect
    return [(p.name, _NONE if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn.fn).parameters.values() if "constexpr" in str(p.annotation)]


def _signature(fn, constants: dict, types: dict) -> dict:
    """Every argument of fn: "constexpr" for the constants (constexpr arguments left out get their defaults,
    added to `constants`), types[name], else a pointer ("*fp32") for a name ending in _ptr, else "i32"."""
    for name, default in _constexpr_params(fn):
        if name not in constants:
            if default is _NONE:
                raise ValueError(f"{_name(fn)}: no value for the constant {name}")
            constants[name] = default
    return {n: "constexpr" if n in constants else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
            for n in fn.arg_names}


# ---------------------------------------------------------------------------------------------------------
# the packed matmuls (kernels/quant/packed.py)

def _layout(qname: str, tile_n: int, tile_k: int, coded: bool) -> SimpleNamespace | None:
    """What tuned_config and kernel_constants read of a packed weight of GGUF type qname in tile_n x tile_k
    tiles (None where that type cannot take that tile)."""
    from gguf import GGMLQuantizationType as QT

    from kernels.packed_layout import PACKED_LAYOUT, scale_kind
    from kernels.quant.packing import _PACKERS, SUPER_BLOCK
    group, hi_bits, _ = PACKED_LAYOUT[qname]
    kind = scale_kind(qname, coded)
    if tile_k % group or (kind.startswith("codes") and SUPER_BLOCK % tile_k):
        return None
    n, k = _ROWS_FOR_TILE[tile_n], _K_FOR_TILE[tile_k]
    return SimpleNamespace(n=n, n_pad=-(-n // tile_n) * tile_n, k=k, tile_n=tile_n, tile_k=tile_k, hi_bits=hi_bits,
                           group=group, codes={"codes": 1, "codes+min": 2}.get(kind, 0),
                           offset=_PACKERS[QT[qname]][1], minv=True if kind == "f16+min" else None, qtype=qname,
                           kind=kind)


def packed_layouts() -> list[SimpleNamespace]:
    """Every (type, tile layout) the loader makes by default (kernels/packed_layout.py): fp16 scales, tiles of
    64 or 128 rows by 128 values (K a multiple of 128) or 64 (K an odd multiple of 64, e.g. SmolLM2's 576).
    Not compiled: 32-value tiles (K an odd multiple of 32; the 64-value tile's code with half the tile, under
    its figures) and the layouts only pack_weight's arguments make (scale codes kept, 256-value tiles:
    docs/decisions/packed-scale-codes.md, tiles-64x256.md)."""
    from kernels.packed_layout import PACKED_LAYOUT
    return [p for q in PACKED_LAYOUT for tn in (64, 128) for tk in (64, 128)
            if (p := _layout(q, tn, tk, False)) is not None]


def _mm_types(p) -> dict:
    s = {"f16": "*fp16", "f16+min": "*fp16", "codes": "*i8", "codes+min": "*u8"}[p.kind]
    return dict(x_ptr="*fp16", lo_ptr="*i8" if p.hi_bits == 8 else "*u8", hi_ptr="*u8", s_ptr=s, m_ptr="*fp16",
                sup_ptr="*fp16", part_ptr="*fp32", out_ptr="*fp32", add_ptr="*fp32", cnt_ptr="*i32", ids_ptr="*i64")


def _packed_mm(p, cfg: dict, family: Family, what: str) -> list[Launch]:
    """The decode matmul launched with settings cfg (packed_matmul's keywords) on p, with `add` and, on a
    family that takes the Hopper paths, with PDL as packed_matmul launches it."""
    from kernels.quant.packed import (SPLIT_SUM_HERE, _packed_mm_kernel, _split_for,
                                      kernel_constants, prefetch_tiles)
    kt = p.k // p.tile_k
    split = cfg.get("split_k") or _split_for(p.n_pad // p.tile_n, kt, SM_COUNT[family.name], 2)
    split = next(s for s in range(max(1, min(split, kt)), kt + 1) if kt % s == 0)
    pdl = family.hopper_paths      # kernels/pdl.py
    const = dict(kernel_constants(p), BLOCK_M=cfg.get("block_m", 16), SWAP_AB=cfg.get("swap_ab", False),
                 FAST_CVT=True, TMA=bool(cfg.get("tma")), SPLIT=split, SUM_HERE=split > 1 and SPLIT_SUM_HERE,
                 HAS_ADD=False)
    if pdl:
        const.update(PDL=1, PREFETCH=prefetch_tiles(const["BLOCK_M"]))
    opts = dict(num_warps=cfg.get("num_warps") or (8 if p.hi_bits in (1, 2) else 4),
                num_stages=cfg.get("num_stages", 3))
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    types = _mm_types(p)
    if const["TMA"]:
        types.update(lo_ptr=_desc(p, "lo"), hi_ptr=_desc(p, "hi"), s_ptr=_desc(p, "s"), m_ptr=_desc(p, "m"))
    name = (f"packed_mm {p.qtype}{'(codes)' if p.codes else ''} {p.tile_n}x{p.tile_k} {what} "
            f"block_m={const['BLOCK_M']} split={split} {opts}")
    # with `add` (the residual stream): that launch's code is the other's plus one load per output
    c = dict(const, HAS_ADD=True)
    return [Launch(name, _packed_mm_kernel, _signature(_packed_mm_kernel, c, types), c, opts,
                   divisible=("x_ptr", "part_ptr", "out_ptr", "stride_xm"))]


def _desc(p, part: str) -> str:
    """The tensor-descriptor type of one of p's tiled tensors as _descriptors makes it ([tile_n, row] boxes)."""
    if part == "lo":
        dt, w = ("i8", p.tile_k) if p.hi_bits == 8 else ("u8", p.tile_k // 2)
    elif part == "hi":
        if p.hi_bits not in (1, 2):
            return _desc(p, "lo")
        dt, w = "u8", p.tile_k * p.hi_bits // 8
    elif part == "s":
        g = p.tile_k // p.group
        dt, w = {"f16": ("fp16", g), "f16+min": ("fp16", g), "codes": ("i8", g), "codes+min": ("u8", 2 * g)}[p.kind]
    else:
        if p.minv is None:
            return _desc(p, "s")
        dt, w = "fp16", p.tile_k // p.group
    return f"tensordesc<{dt}[{p.tile_n}, {w}]>"


def packed_launches(family: Family) -> list[Launch]:
    """The packed decode matmul for every type x tile layout x row block the engine launches on this
    family (decode rows in 16-row blocks and the wider blocks of wide_decode_rows, small prompt chunks),
    its split-K sum, the dequantization for prompt chunks and the embedding-row gather."""
    from kernels.family import by_family
    from kernels.quant.packed import (PACKED_SETTINGS, SMALL_PROMPT_ROWS, _dequant_kernel, _rows_kernel, _sum_parts_kernel,
                                      kernel_constants, tuned_config, wide_decode_rows)
    settings = by_family(PACKED_SETTINGS, family)
    out = []
    n_sm = SM_COUNT[family.name]
    for p in packed_layouts():
        decode = tuned_config(p, 0, n_sm, tma=settings["tma"], family=family)
        out += _packed_mm(p, decode, family, "decode")
        for m in (32, 64):
            wide = wide_decode_rows(decode, m)
            if wide is not decode:
                out += _packed_mm(p, wide, family, f"decode {m} rows")
        small = tuned_config(p, SMALL_PROMPT_ROWS, n_sm, tma=settings["tma"], family=family)
        out += _packed_mm(p, small, family, "small prompt")
        c = kernel_constants(p)
        types = _mm_types(p)
        out.append(Launch(f"packed_dequant {p.qtype} {p.tile_n}x{p.tile_k}", _dequant_kernel,
                          _signature(_dequant_kernel, c, dict(types, out_ptr="*fp16")), c, dict(num_warps=4,
                                                                                                 num_stages=3)))
        c = dict(c, PDL=int(family.hopper_paths))
        out.append(Launch(f"packed_rows {p.qtype} {p.tile_n}x{p.tile_k}", _rows_kernel,
                          _signature(_rows_kernel, c, types), c, dict(num_warps=4, num_stages=3)))
    for split in sorted({lc.constants["SPLIT"] for lc in out if "SPLIT" in lc.constants} - {1}):
        for add in (False, True):
            c = dict(SPLIT=split, BLOCK=1024, HAS_ADD=add, PDL=int(family.hopper_paths))
            out.append(Launch(f"packed_sum_parts split={split}", _sum_parts_kernel,
                              _signature(_sum_parts_kernel, c, {}), c, dict(num_warps=4, num_stages=3)))
    return out


# ---------------------------------------------------------------------------------------------------------
# attention (kernels/attention), the KV codecs (kernels/kvcodec)

def _small(name: str, fn, const: dict, options: dict | None = None, types: dict | None = None,
           floats: tuple = ("eps", "scale")) -> Launch:
    """A launch of one of the smaller kernels: fp32 pointers unless `types` says otherwise, the float
    arguments named in `floats`, every other argument i32."""
    t = {n: "fp32" for n in floats}
    t.update(types or {})
    return Launch(name, fn, _signature(fn, const, t), const, dict(options or {}))


def attention_launches(family: Family) -> list[Launch]:
    """Paged decode attention (its split-K and merge kernels) and prompt attention for every KV cache type (K
    and V of one type; a mixed pair runs the K side of one and the V side of the other, with the coded types'
    settings), head sizes 128 and 256 (64: the same code on tiles half the size; rotated types store 128)
    and 1 or 6 query heads per KV head (the decode kernel pads them to 16 either way); the key centers'
    score correction; the K/V writes."""
    from kernels.attention.kv_write import _norm_rope_write_kernel, _write_kv_kernel
    from kernels.attention.paged import (_combine_kernel, _decode_kernel, _next_pow2, _prefill_kernel,
                                         PREFILL_SETTINGS, _seg_bias_kernel, decode_config, prefill_block_m)
    from kernels.family import by_family
    from kernels.kvcodec import CACHE_TYPES, get_codec
    pdl = int(family.hopper_paths)
    pre = by_family(PREFILL_SETTINGS, family)
    out = []
    for ck in CACHE_TYPES:
        for cv in (ck,):
            k, v = get_codec(ck), get_codec(cv)
            cfg = decode_config(k, v, family)
            for d in HEAD_DIMS[1:]:
                dk, dv = k.stored_dim(d), v.stored_dim(d)
                kv = dict(k_ptr="*u8", v_ptr="*u8", q_ptr="*fp32", bt_ptr="*i32", len_ptr="*i32", cu_ptr="*i32",
                          start_ptr="*i32")
                bt = cfg["block_t"]
                mk = -(-cfg["min_keys"] // bt) * bt
                sk = -(-cfg.get("short_keys", 0) // bt) * bt if 0 < cfg.get("short_keys", 0) < mk else 0
                g = GROUPS[-1]
                c = dict(WINDOW=0, SEG=0, G=g, G_PAD=max(16, _next_pow2(g)), DK=dk, DV=dv, BS=16, BLOCK_T=bt,
                         MIN_KEYS=mk, CODEC_K=k.codec_id, CODEC_V=v.codec_id, DOT=cfg["dot"], SHORT_KEYS=sk,
                         PDL=pdl)
                out.append(_small(f"attn_decode {ck}/{cv} d={d} G={g} {cfg}", _decode_kernel, c,
                                  dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]), kv))
                for g in GROUPS:
                    bm = prefill_block_m(16, g, dk, dv, pre["q_values"])
                    c = dict(WINDOW=0, SEG=0, G=g, G_PAD=_next_pow2(g), DK=dk, DV=dv, BS=16, BLOCK_M=bm,
                             BLOCK_T=pre["block_t"],
                             CODEC_K=k.codec_id, CODEC_V=v.codec_id, DOT="tf32")
                    out.append(_small(f"attn_prefill {ck}/{cv} d={d} G={g}", _prefill_kernel, c, {}, kv))
                c = dict(WINDOW=0, DV=dv, BLOCK_T=bt, MIN_KEYS=mk, GATE=False, SHORT_KEYS=sk, PDL=pdl)
                for gate in (False, True):
                    c = dict(c, GATE=gate)
                    out.append(_small(f"attn_combine {ck}/{cv} d={d}", _combine_kernel, dict(c), {},
                                      dict(kv, out_ptr="*fp16")))
    for d in HEAD_DIMS:
        for g in GROUPS:
            c = dict(G=g, G_PAD=max(16, _next_pow2(g)), D=d, BLOCK_S=32)
            out.append(_small(f"seg_bias d={d} G={g}", _seg_bias_kernel, c, {}, dict(slot_ptr="*i32")))
        for dt in ("fp16", "bf16", "fp32"):
            kv = dict(kc_ptr=f"*{dt}", vc_ptr=f"*{dt}", rows_ptr="*i64")
            blk = _next_pow2(d * 4)          # K/V rows of up to 4 KV heads of d
            out.append(_small(f"write_kv {dt} d={d}", _write_kv_kernel,
                              dict(K_ELEMS=d * 4, V_ELEMS=d * 4, BLOCK=blk, PDL=pdl), dict(num_warps=4), kv))
            for h in (8, 24):
                bd = _next_pow2(d)
                bh = max(1, min(_next_pow2(h), 2048 // bd))
                c = dict(NORM=True, HAS_W=True, ROPE_DIM=min(64, d), NEOX=True, BLOCK_H=bh, BLOCK_D=bd, PDL=pdl)
                out.append(_small(f"norm_rope_write {dt} d={d} H={h}", _norm_rope_write_kernel, c,
                                  dict(num_warps=max(1, min(8, bh * bd // 256))), kv))
    return out


def kvcodec_launches(family: Family) -> list[Launch]:
    """The standalone decoder of every coded cache type and the rotation's row product."""
    from kernels.kvcodec import CACHE_TYPES, get_codec
    from kernels.kvcodec.rotation import _rotate_kernel
    from kernels.kvcodec.triton_decode import _decode_kernel
    out = [_small("kv_rotate", _rotate_kernel, dict(BLOCK_R=16))]
    for name in CACHE_TYPES:
        c = get_codec(name)
        if c.codec_id < 0 or name in ("f32", "f16", "bf16"):
            continue
        for d in HEAD_DIMS:
            ds = c.stored_dim(d)
            bd = 128
            while ds % bd:
                bd //= 2
            out.append(_small(f"kv_decode {name} d={d}", _decode_kernel,
                              dict(DS=ds, BLOCK_D=bd, BLOCK_R=16, CODEC=c.codec_id), {}, dict(p_ptr="*u8")))
    return out


# ---------------------------------------------------------------------------------------------------------
# Gated DeltaNet (kernels/gdn), the fused small kernels (kernels/fused.py)

# the state size, key heads and value heads of the supported Qwen3.5/3.6 models' Gated DeltaNet layers
GDN_SHAPES = ((128, 16, 48), (128, 16, 32), (128, 16, 16))


def gdn_launches(family: Family) -> list[Launch]:
    """The decode step's convolution and delta-rule kernels (block_v and warps as gdn_decode_triton picks them
    for 1 and for many rows) and the prompt rows' kernel (one run, and pieces)."""
    from kernels.gdn.recurrent import DELTA_CONFIG, _conv_kernel, _delta_kernel, _next_pow2
    from kernels.gdn.rows import _delta_pieces_kernel
    pdl = int(family.hopper_paths)
    out = []
    for d, hk, hv in GDN_SHAPES:
        dp = _next_pow2(d)
        out.append(_small(f"gdn_conv d={d}", _conv_kernel, dict(K=4, KP=4, DP=dp, PDL=pdl),
                          dict(num_warps=max(1, min(4, dp * 4 // 256))), dict(slot_ptr="*i32")))
        for rows in (1, 64):
            block_v = DELTA_CONFIG["block_v"] or (16 if rows * hv * max(1, dp // 32) < 256 else 32)
            bv = min(_next_pow2(block_v), dp)
            warps = DELTA_CONFIG["num_warps"] or max(1, min(8, dp * bv // 1024))
            for raw in (False, True):
                out.append(_small(f"gdn_delta d={d} BV={bv} rows={rows}", _delta_kernel,
                                  dict(DP=dp, BV=bv, RAW_GATES=raw, PDL=pdl), dict(num_warps=warps),
                                  dict(slot_ptr="*i32")))
        for pieces in (False, True):
            out.append(_small(f"gdn_rows d={d} pieces={pieces}", _delta_pieces_kernel,
                              dict(DP=dp, BV=16, PIECES=pieces), dict(num_warps=4),
                              dict(slot_ptr="*i32", cu_ptr="*i32")))
    return out


# the supported models' hidden sizes (SmolLM2-135M, Gemma3-270M, Qwen3.5 small ones, the 27B) and vocabularies
HIDDEN = (576, 640, 2048, 5120)
VOCABS = (49152, 151936, 262144, 248320)


def fused_launches(family: Family) -> list[Launch]:
    """The norms, the per-head norm/RoPE/gate kernel, the gated products (and the one over split-K partial
    sums), the greedy sampler's argmax."""
    from kernels.fused import (_GATE_OPS, _add_rms_norm_kernel, _argmax_chunk, _argmax_chunk_kernel,
                               _argmax_partials_kernel, _gated_kernel, _gated_parts_kernel, _heads_kernel,
                               _next_pow2, _rms_norm_kernel)
    pdl = int(family.hopper_paths)

    def warps(n):       # kernels.fused._warps
        return dict(num_warps=int(min(16, max(1, n // 256))))
    out = []
    for e in HIDDEN:
        b = _next_pow2(e)
        for w in (False, True):
            out.append(_small(f"rms_norm E={e}", _rms_norm_kernel, dict(HAS_W=w, BLOCK=b, PDL=pdl), warps(b)))
            out.append(_small(f"add_rms_norm E={e}", _add_rms_norm_kernel, dict(HAS_XW=w, HAS_W=True, BLOCK=b,
                                                                              PDL=pdl), warps(b)))
    for d in HEAD_DIMS:
        for h in (4, 24):
            bd = _next_pow2(d)
            bh = max(1, min(_next_pow2(h), 4096 // bd))
            for norm, rope, gate in ((True, min(64, d), False), (True, 0, True), (True, 0, False),
                                     (False, min(64, d), False)):
                c = dict(NORM=norm, HAS_W=True, ROPE_DIM=rope, NEOX=True, GATE=gate, BLOCK_H=bh, BLOCK_D=bd, PDL=pdl)
                out.append(_small(f"heads d={d} H={h} norm={norm} rope={rope} gate={gate}", _heads_kernel, c,
                                  warps(bh * bd)))
    for op in (0, 1, 2):
        out.append(_small(f"gated op={op}", _gated_kernel, dict(OP=op, BLOCK=1024, PDL=pdl), warps(1024)))
    for split in (1, 2, 4, 8):
        for op in _GATE_OPS.values():
            out.append(_small(f"gated_parts split={split} op={op}", _gated_parts_kernel,
                              dict(SPLIT=split, OP=op, BLOCK=1024, PDL=pdl), warps(1024)))
    for vocab in VOCABS:
        for rows in (1, 16, 64):
            chunk = _argmax_chunk(rows, vocab, 1024)
            out.append(_small(f"argmax_chunk V={vocab}", _argmax_chunk_kernel, dict(CHUNK=chunk, BLOCK=1024),
                              warps(1024), dict(pi_ptr="*i32")))
            pb = min(_next_pow2(-(-vocab // chunk)), 1024)
            out.append(_small("argmax_partials", _argmax_partials_kernel, dict(BLOCK=pb), warps(pb),
                              dict(pi_ptr="*i32", out_ptr="*i64")))
    return out


def all_launches(family: Family) -> list[Launch]:
    """Every launch the engine can make on this family (duplicates possible: see Launch.key)."""
    return (packed_launches(family) + attention_launches(family) + kvcodec_launches(family) + gdn_launches(family)
            + fused_launches(family))
