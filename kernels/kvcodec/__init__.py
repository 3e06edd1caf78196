"""KV cache codecs: encode K/V rows on write, decode them inside attention.

`get_codec(name)` for the cache types (llama.cpp's --cache-type-k / --cache-type-v names):
  f32, f16, bf16   the values themselves (f16 is llama.cpp's default)
  q8_0             llama.cpp's 32-value block, 8.5 bits/value
  turbo4/3/2       random rotation + Lloyd-Max scalar codes: 4.125 / 3.5 / 2.5 bits/value
  turbo3_tcq/2_tcq random rotation + trellis-coded quantization: 3.25 / 2.25 bits/value
Rotated codecs pad head dims to a multiple of 128 (a 64-value head costs twice the nominal bits).
"""
from __future__ import annotations

import functools

import torch

from kernels.kvcodec.base import (BF16, F16, F32, TCQ2, TCQ3, TURBO2, TURBO3, TURBO4, FloatCodec, KVCodec)
from kernels.kvcodec.codebooks import load_codebooks
from kernels.kvcodec.q8_0 import Q8_0Codec
from kernels.kvcodec.rotation import GROUP, Rotation, padded_dim
from kernels.kvcodec.tcq import TCQCodec
from kernels.kvcodec.turbo import TurboCodec

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq")
DTYPE_CACHE_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@functools.lru_cache(maxsize=1)
def default_rotation() -> Rotation:
    cb = load_codebooks()
    return Rotation(torch.from_numpy(cb["signs1"]), torch.from_numpy(cb["signs2"]))


@functools.lru_cache(maxsize=None)
def get_codec(name: str) -> KVCodec:
    if name == "f32":
        return FloatCodec("f32", torch.float32, F32)
    if name == "f16":
        return FloatCodec("f16", torch.float16, F16)
    if name == "bf16":
        return FloatCodec("bf16", torch.bfloat16, BF16)
    if name == "q8_0":
        return Q8_0Codec()
    if name in ("turbo4", "turbo3", "turbo2"):
        bits = int(name[-1])
        cid = {4: TURBO4, 3: TURBO3, 2: TURBO2}[bits]
        return TurboCodec(name, bits, cid, default_rotation(), torch.from_numpy(load_codebooks()[f"lm{bits}"]))
    if name in ("turbo3_tcq", "turbo2_tcq"):
        bits = int(name[5])
        cid = TCQ3 if bits == 3 else TCQ2
        return TCQCodec(name, bits, cid, default_rotation(), torch.from_numpy(load_codebooks()[f"tcq{bits}"]))
    raise ValueError(f"unknown KV cache type {name!r} (choose from {', '.join(CACHE_TYPES)})")


def cache_type_name(t) -> str:
    """A cache type given as a name or a torch float dtype -> its name (validated)."""
    if isinstance(t, torch.dtype):
        if t not in DTYPE_CACHE_TYPES:
            raise ValueError(f"no KV cache type for dtype {t}")
        return DTYPE_CACHE_TYPES[t]
    get_codec(t)
    return t


__all__ = ["CACHE_TYPES", "GROUP", "KVCodec", "Rotation", "cache_type_name", "default_rotation", "get_codec",
           "padded_dim"]
