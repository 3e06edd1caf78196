"""Facts of the GPU's packed weight layout (kernels/quant/packed.py) that need no torch: which GGUF types
are packed and how (values per scale group, extra high bits per value), how many rows and values a tile
holds, and so how many bytes a matrix takes. engine/planner.py counts memory with these (it runs without
torch); kernels/quant/packed.py packs with the same rules."""
from __future__ import annotations

# GGUF type name -> (values per group, extra high bits) (tests check it against packed._PACKERS)
PACKED_LAYOUT: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 0), "Q4_1": (32, 0), "Q5_0": (32, 1), "Q5_1": (32, 1), "Q8_0": (32, 8), "Q2_K": (16, 0),
    "Q3_K": (16, 0), "Q4_K": (32, 0), "Q5_K": (32, 1), "Q6_K": (16, 2), "IQ4_NL": (32, 8), "IQ4_XS": (32, 8),
}


def default_tile_n(n: int) -> int:
    """128 rows per tile for wide matrices (n >= 16384), else 64 (measured on the H200)."""
    return 128 if n >= 16384 else 64


def default_tile_k(k: int) -> int:
    """256 values per tile along K, or the largest power of two >= 32 that divides K."""
    for tk in (256, 128, 64, 32):
        if k % tk == 0:
            return tk
    raise ValueError(f"K = {k} is not a multiple of 32")


def packed_bytes(qtype_name: str, n: int, k: int) -> int | None:
    """Bytes of an [n, k] matrix of a quantized GGUF type in the packed layout (4-bit plane + high
    plane, or an int8 plane; fp16 scale and min per group; rows padded to whole tiles); None for types
    that are not packed."""
    lay = PACKED_LAYOUT.get(qtype_name)
    if lay is None:
        return None
    group, hi_bits = lay
    tile = default_tile_n(n)
    n = -(-n // tile) * tile
    planes = n * k if hi_bits == 8 else n * k // 2 + n * k * hi_bits // 8
    return planes + 2 * 2 * n * (k // group)
