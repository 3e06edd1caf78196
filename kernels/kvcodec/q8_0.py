"""q8_0: llama.cpp's block of 32 values in 34 bytes (fp16 scale d = amax/127, then 32 int8
q = roundf(x / d), half away from zero), 8.5 bits/value; exactly ggml's quantize_row_q8_0_ref."""
from __future__ import annotations

import torch

from kernels.kvcodec.base import HAVE_TRITON, Q8_0, KVCodec

if HAVE_TRITON:
    import triton
    import triton.language as tl


def _round_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


class Q8_0Codec(KVCodec):
    name = "q8_0"
    codec_id = Q8_0
    group = 32
    group_bytes = 34

    def _encode_ref(self, x2):
        n, d = x2.shape
        self.stored_dim(d)
        b = x2.float().reshape(n, d // 32, 32)
        amax = b.abs().amax(-1, keepdim=True)
        scale = amax / 127.0
        inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        q = _round_away(b * inv).to(torch.int8)
        out = torch.empty(n, d // 32, 34, dtype=torch.uint8, device=x2.device)
        out[..., :2] = scale.to(torch.float16).view(torch.uint8)
        out[..., 2:] = q.view(torch.uint8)
        return out.reshape(n, -1)

    def _decode_ref(self, p2):
        n, rb = p2.shape
        b = p2.reshape(n, rb // 34, 34)
        scale = b[..., :2].contiguous().view(torch.float16).float()
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * scale).reshape(n, -1)

    def _encode_triton(self, x2):
        n, d = x2.shape
        self.stored_dim(d)
        out = torch.empty(n, self.row_bytes(d), dtype=torch.uint8, device=x2.device)
        n_blocks = n * d // 32
        block_b = 64
        _q8_0_encode_kernel[(triton.cdiv(n_blocks, block_b),)](x2.float().contiguous(), out, n_blocks, BLOCK_B=block_b)
        return out


if HAVE_TRITON:
    @triton.jit
    def _q8_0_encode_kernel(x_ptr, out_ptr, n_blocks, BLOCK_B: tl.constexpr):
        b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        mb = b < n_blocks
        j = tl.arange(0, 32)
        x = tl.load(x_ptr + b[:, None].to(tl.int64) * 32 + j[None, :], mask=mb[:, None], other=0.0)
        amax = tl.max(tl.abs(x), axis=1)
        d = tl.math.div_rn(amax, 127.0)
        inv = tl.where(d != 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d != 0, d, 1.0)), 0.0)
        v = x * inv[:, None]
        q = tl.where(v >= 0, tl.floor(tl.abs(v) + 0.5), -tl.floor(tl.abs(v) + 0.5))
        base = out_ptr + b.to(tl.int64) * 34
        tl.store((base + 0).to(tl.pointer_type(tl.float16)), d.to(tl.float16), mask=mb)
        tl.store((base[:, None] + 2 + j[None, :]).to(tl.pointer_type(tl.int8)), q.to(tl.int8), mask=mb[:, None])
