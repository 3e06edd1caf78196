"""Facts of the GPU's packed weight layout (kernels/quant/packed.py) that need no torch: which GGUF types
are packed and how (values per scale group, extra high bits per value, how the scales are stored), how
many rows and values a tile holds, and so how many bytes a matrix takes. engine/planner.py counts memory
with these (it runs without torch); kernels/quant/packed.py packs with the same rules."""
from __future__ import annotations

# How a packed type stores its per-group scale (and min):
#   "f16"        an fp16 scale per group (the min, if any, a fixed multiple of it: no bytes)
#   "f16+min"    an fp16 scale and an fp16 min per group (Q4_1, Q5_1)
#   "codes"      a signed 8-bit code per group and one fp16 factor d per tile row (its 256-value
#                super-block): scale = d * code (Q3_K, Q6_K, IQ4_XS)
#   "codes+min"  unsigned 8-bit (scale, min) code pairs per group and (d, dmin) per tile row:
#                scale = d * sc, min = dmin * mn (Q2_K, Q4_K, Q5_K)
# The coded kinds are stored as "f16" / "f16+min" (the products) unless CODED_SCALES (below).

# GGUF type name -> (values per group, extra high bits, scale kind)
PACKED_LAYOUT: dict[str, tuple[int, int, str]] = {
    "Q4_0": (32, 0, "f16"), "Q4_1": (32, 0, "f16+min"), "Q5_0": (32, 1, "f16"), "Q5_1": (32, 1, "f16+min"),
    "Q8_0": (32, 8, "f16"), "Q2_K": (16, 0, "codes+min"), "Q3_K": (16, 0, "codes"),
    "Q4_K": (32, 0, "codes+min"), "Q5_K": (32, 1, "codes+min"), "Q6_K": (16, 2, "codes"),
    "IQ4_NL": (32, 8, "f16"), "IQ4_XS": (32, 8, "codes"),
}


# Whether the coded kinds keep their 8-bit codes on the GPU (True) or are stored as fp16 products ("codes" as
# "f16", "codes+min" as "f16+min"). False: the codes take 1.3 GB less for the 27B Q4_K_M (16.9 against 18.4 GB)
# but its decode step 14 % longer on the H200 (18.1 against 15.9 ms: making the scales in the kernel costs more
# than the bytes it saves; docs/decisions/packed-scale-codes.md). pack_weight(coded=True) still keeps the codes
# (the kernels' tests, .ci/gpu/sweep_scales.py): the layout for a card where those 1.3 GB decide whether a model
# fits at all, to become a typed setting when one needs it.
CODED_SCALES = False


def scale_kind(qtype_name: str, coded: bool | None = None) -> str:
    """How a packed type stores its scales: PACKED_LAYOUT's kind, or with coded False (default
    CODED_SCALES) its fp16 counterpart."""
    kind = PACKED_LAYOUT[qtype_name][2]
    if not (CODED_SCALES if coded is None else coded):
        kind = {"codes": "f16", "codes+min": "f16+min"}.get(kind, kind)
    return kind


# the fewest rows of a matrix packed in 128-row tiles (fewer: 64-row tiles): 128-row tiles for every matrix
# made the 27B's decode step longer on the H200 (docs/decisions/tiles-128-rows-everywhere.md)
WIDE_ROWS = 16384


def default_tile_n(n: int) -> int:
    """128 rows per tile for wide matrices (n >= WIDE_ROWS), else 64 (measured on the H200)."""
    return 128 if n >= WIDE_ROWS else 64


# Values per tile along K: 128, or 256 for weights that keep their 8-bit scale codes. 128 because the decode
# matmul holds its whole dequantized tile in registers as the dot's operand, and a 128 x 256 tile needs 221
# registers per thread on sm_90 (two programs per SM), 128 x 128 needs 139; the 27B's Q4_K matmuls run 18-26 %
# faster and its decode step 13.6 instead of 15.8 ms on the H200 (docs/decisions/tile-k-128.md). Coded weights
# keep 256: their fp16 factor per tile row would cost 0.125-0.25 bits per value more at 128, most of what
# storing the codes saves. (64-row tiles of 256 values, the registers of a 128 x 128 tile, made a step slower:
# docs/decisions/tiles-64x256.md.)
TILE_K = 128
CODED_TILE_K = 256


def default_tile_k(k: int, coded: bool = False) -> int:
    """The largest power of two >= 32 that divides K, up to TILE_K (CODED_TILE_K for a weight whose scales
    are stored as codes)."""
    limit = CODED_TILE_K if coded else TILE_K
    for tk in (256, 128, 64, 32):
        if tk <= limit and k % tk == 0:
            return tk
    raise ValueError(f"K = {k} is not a multiple of 32")


def packed_bytes(qtype_name: str, n: int, k: int) -> int | None:
    """Bytes of an [n, k] matrix of a quantized GGUF type in the packed layout (4-bit plane + high
    plane, or an int8 plane; the scales as their kind (above) says; rows padded to whole tiles); None for types
    that are not packed."""
    lay = PACKED_LAYOUT.get(qtype_name)
    if lay is None:
        return None
    group, hi_bits, _ = lay
    kind = scale_kind(qtype_name)
    tile = default_tile_n(n)
    n = -(-n // tile) * tile
    planes = n * k if hi_bits == 8 else n * k // 2 + n * k * hi_bits // 8
    groups = n * (k // group)
    tile_rows = n * (k // default_tile_k(k, kind.startswith("codes")))
    scales = {"f16": 2 * groups, "f16+min": 4 * groups, "codes": groups + 2 * tile_rows,
              "codes+min": 2 * groups + 4 * tile_rows}[kind]
    return planes + scales
