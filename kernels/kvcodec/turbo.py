"""turbo4 / turbo3 / turbo2: random rotation + Lloyd-Max scalar codes.

Each 128-value group y = R x (rotation.py; heads below 128 zero-padded) is normalised to
u = y * sqrt(128) / |y|, whose coordinates follow the marginal of a random unit vector (~N(0, 1));
each coordinate gets the nearest Lloyd-Max centroid of that marginal (codebooks.py). The stored
scale s is corrected so that the reconstruction c * s keeps the original norm: s = |y_b| / |c_b|
over each block b that has its own fp16 scale (the whole group for turbo4, each 32 values for
turbo3 / turbo2, which have four scale slots per group in llama.cpp-style 32-value blocks).

Layouts (bytes, little-endian):
  turbo4  128 values in 66: fp16 s, 64 bytes of 4-bit codes (value 2i low nibble, 2i+1 high)
  turbo3   32 values in 14: fp16 s, 8 bytes of 2 low code bits (value j at byte j/4, bits 2(j%4)),
                            4 bytes of the high code bit (value j at byte j/8, bit j%8)
  turbo2   32 values in 10: fp16 s, 8 bytes of 2-bit codes (as turbo3's low bits)
Decoding is value = centroid[code] * s (in the rotated domain).
"""
from __future__ import annotations

import math

import torch

from kernels.kvcodec.base import HAVE_TRITON, KVCodec
from kernels.kvcodec.rotation import GROUP, Rotation, padded_dim

if HAVE_TRITON:
    import triton
    import triton.language as tl

SQRT_GROUP = math.sqrt(GROUP)


def _fp16_bytes(s: torch.Tensor) -> torch.Tensor:
    return s.to(torch.float16).contiguous().view(torch.uint8).reshape(*s.shape, 2)


def _shifted_sum(codes: torch.Tensor, per_byte: int, bits: int) -> torch.Tensor:
    """Pack `per_byte` consecutive codes of `bits` bits into each byte (first code lowest)."""
    c = codes.reshape(*codes.shape[:-1], -1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack(b: torch.Tensor, per_byte: int, bits: int) -> torch.Tensor:
    shifts = torch.arange(per_byte, device=b.device, dtype=torch.int32) * bits
    v = (b.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return v.reshape(*b.shape[:-1], -1)


class TurboCodec(KVCodec):
    rotated = True

    def __init__(self, name: str, bits: int, codec_id: int, rotation: Rotation, centroids: torch.Tensor):
        self.name, self.bits, self.codec_id, self.rotation = name, bits, codec_id, rotation
        self.scale_block = GROUP if bits == 4 else 32          # values per fp16 scale
        self.group = self.scale_block
        self.group_bytes = 2 + self.scale_block * bits // 8     # 66, 14, 10
        c = centroids.to(torch.float32).reshape(-1)
        if c.numel() != 1 << bits or not bool((c[1:] > c[:-1]).all()):
            raise ValueError(f"{name}: need {1 << bits} ascending centroids")
        self.centroids = c
        self.boundaries = (c[1:] + c[:-1]) / 2
        self._dev: dict = {}

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        t = self._dev.get(key)
        if t is None:
            t = self._dev[key] = (self.centroids.to(device), self.boundaries.to(device))
        return t

    def codebook(self, device="cpu") -> torch.Tensor:
        return self._tables(device)[0]

    # ----- torch reference -----
    def quantize_stored(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated rows y [N, Dp] -> codes int64 [N, Dp] and scales float32 [N, Dp / scale_block]."""
        n, dp = y.shape
        cent, bnd = self._tables(y.device)
        g = y.reshape(n, dp // GROUP, GROUP)
        nrm = g.norm(dim=-1, keepdim=True)
        inv = torch.where(nrm > 0, SQRT_GROUP / nrm, torch.zeros_like(nrm))
        codes = torch.bucketize(g * inv, bnd).reshape(n, dp)
        c = cent[codes]
        sb = self.scale_block
        yn = y.reshape(n, dp // sb, sb).norm(dim=-1)
        cn = c.reshape(n, dp // sb, sb).norm(dim=-1)
        return codes, yn / cn

    def _encode_ref(self, x2):
        return self.pack(*self.quantize_stored(self.rotation.rotate(x2)))

    def pack(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        n, dp = codes.shape
        nb = dp // self.scale_block
        cb = codes.reshape(n, nb, self.scale_block)
        parts = [_fp16_bytes(scales)]
        if self.bits == 4:
            parts.append(_shifted_sum(cb, 2, 4))
        else:
            parts.append(_shifted_sum(cb & 3, 4, 2))
            if self.bits == 3:
                parts.append(_shifted_sum(cb >> 2, 8, 1))
        return torch.cat(parts, dim=-1).reshape(n, nb * self.group_bytes)

    def unpack(self, p2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, rb = p2.shape
        nb = rb // self.group_bytes
        b = p2.reshape(n, nb, self.group_bytes)
        scales = b[..., :2].contiguous().view(torch.float16).float()[..., 0]
        if self.bits == 4:
            codes = _unpack(b[..., 2:], 2, 4)
        else:
            codes = _unpack(b[..., 2:10], 4, 2)
            if self.bits == 3:
                codes = codes | (_unpack(b[..., 10:14], 8, 1) << 2)
        return codes.reshape(n, nb * self.scale_block), scales

    def _decode_ref(self, p2):
        codes, scales = self.unpack(p2)
        n = codes.shape[0]
        v = self._tables(p2.device)[0][codes].reshape(n, scales.shape[1], self.scale_block) * scales[..., None]
        return v.reshape(n, -1)

    # ----- Triton -----
    def _encode_triton(self, x2):
        n, d = x2.shape
        dp = padded_dim(d)
        out = torch.empty(n, self.row_bytes(d), dtype=torch.uint8, device=x2.device)
        cent, bnd = self._tables(x2.device)
        # rotated by the rotation's own kernel: with the rotation inside, this kernel held R (64 KB of
        # fp32) in registers and took ~110 us per call on the H200 (a decode step encodes 2 per layer)
        y = self.rotation.rotate(x2).contiguous()
        block_r = 16
        _turbo_encode_kernel[(triton.cdiv(n, block_r),)](
            y, bnd, cent, out, n, out.shape[1], BITS=self.bits, G=dp // GROUP, BLOCK_R=block_r)
        return out


if HAVE_TRITON:
    @triton.jit
    def _turbo_encode_kernel(y_ptr, bnd_ptr, cent_ptr, out_ptr, N, row_bytes,
                             BITS: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr):
        """Rotated rows y [N, G * 128] (float32) -> their codes and scales."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mr = r < N
        r64 = r.to(tl.int64)
        j = tl.arange(0, 128)
        for g in tl.static_range(G):
            col = g * 128 + j
            y = tl.load(y_ptr + r64[:, None] * (G * 128) + col[None, :], mask=mr[:, None], other=0.0)
            nrm = tl.sqrt_rn(tl.sum(y * y, axis=1))
            inv = tl.where(nrm > 0, tl.math.div_rn(tl.full(nrm.shape, 11.313708498984761, tl.float32), tl.maximum(nrm, 1e-30)), 0.0)
            u = y * inv[:, None]
            code = tl.zeros((BLOCK_R, 128), dtype=tl.int32)
            for i in tl.static_range((1 << BITS) - 1):
                code += (u > tl.load(bnd_ptr + i)).to(tl.int32)
            c = tl.load(cent_ptr + code)
            if BITS == 4:
                s = tl.math.div_rn(nrm, tl.sqrt_rn(tl.sum(c * c, axis=1)))
                base = out_ptr + r64 * row_bytes + g * 66
                tl.store(base.to(tl.pointer_type(tl.float16)), s.to(tl.float16), mask=mr)
                w = (tl.arange(0, 2) * 4)[None, None, :]
                packed = tl.sum(tl.reshape(code, (BLOCK_R, 64, 2)) << w, axis=2)
                tl.store(base[:, None] + 2 + tl.arange(0, 64)[None, :], packed.to(tl.uint8), mask=mr[:, None])
            else:
                BB: tl.constexpr = 2 + 32 * BITS // 8                        # 14 or 10 bytes per 32 values
                yb = tl.sum(tl.reshape(y * y, (BLOCK_R, 4, 32)), axis=2)
                cb = tl.sum(tl.reshape(c * c, (BLOCK_R, 4, 32)), axis=2)
                s = tl.math.div_rn(tl.sqrt_rn(yb), tl.sqrt_rn(cb))           # [BLOCK_R, 4]
                blk = tl.arange(0, 4)
                base = out_ptr + r64[:, None] * row_bytes + g * 4 * BB + blk[None, :] * BB   # [BLOCK_R, 4]
                tl.store(base.to(tl.pointer_type(tl.float16)), s.to(tl.float16), mask=mr[:, None])
                w2 = (tl.arange(0, 4) * 2)[None, None, None, :]
                lows = tl.sum(tl.reshape(code & 3, (BLOCK_R, 4, 8, 4)) << w2, axis=3)     # [BLOCK_R, 4, 8]
                tl.store(base[:, :, None] + 2 + tl.arange(0, 8)[None, None, :], lows.to(tl.uint8),
                         mask=mr[:, None, None])
                if BITS == 3:
                    w1 = tl.arange(0, 8)[None, None, None, :]
                    highs = tl.sum(tl.reshape((code >> 2) & 1, (BLOCK_R, 4, 4, 8)) << w1, axis=3)  # [BLOCK_R, 4, 4]
                    tl.store(base[:, :, None] + 10 + tl.arange(0, 4)[None, None, :], highs.to(tl.uint8),
                             mask=mr[:, None, None])
