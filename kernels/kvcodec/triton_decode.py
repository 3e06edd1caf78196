"""Decoding every cache type inside Triton kernels: `load_values` reads a tile of rows (tokens of
one KV head) from the packed bytes and returns float32 values in the stored domain. The attention
kernels (kernels/attention) call it on each K/V tile; `decode_rows_triton` is the standalone
decode, tested against the torch references."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
    from kernels._interpreter_compat import apply as _fix_interpreter
    _fix_interpreter()
except ImportError:  # CPU-only installs run the torch references
    HAVE_TRITON = False

if HAVE_TRITON:

    @triton.jit
    def _f16_at(ptr, mask):
        return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _typed_rows(base_ptr, row_off, offs_d, DT: tl.constexpr, SIZE: tl.constexpr):
        """Pointers [R, D] to float rows of type DT (SIZE bytes) at byte offsets row_off: offsets counted
        in elements from a typed base, so that Triton sees each row's values as contiguous and issues
        16-byte loads. (Addressed as bytes + 2 * d and cast afterwards, every value was a load of its own:
        the f16 decode attention ran at ~0.6 TB/s.) Rows start at multiples of 16 bytes (row bytes are)."""
        elem = tl.multiple_of(row_off // SIZE, 16 // SIZE)
        return base_ptr.to(tl.pointer_type(DT)) + elem[:, None] + offs_d[None, :]

    @triton.jit
    def _group_scales(rp, D0, m2, D: tl.constexpr, G: tl.constexpr, GB: tl.constexpr):
        """The fp16 scales that open each group of G values (GB bytes) of values D0 .. D0 + D of each row,
        [R, D // G]: one load per group, not one per value."""
        grp = D0 // G + tl.arange(0, D // G)
        return _f16_at(rp + (grp * GB)[None, :], m2)

    @triton.jit
    def _group_scaled(v, s, G: tl.constexpr):
        """Values v [R, D] times their group's scale s [R, D // G]."""
        R: tl.constexpr = v.shape[0]
        D: tl.constexpr = v.shape[1]
        return tl.reshape(tl.reshape(v, (R, D // G, G)) * s[:, :, None], (R, D))

    @triton.jit
    def _tcq_values(rp, D0, m2, cb_ptr, D: tl.constexpr, KB: tl.constexpr, L: tl.constexpr, GB: tl.constexpr):
        """Values D0 .. D0 + D of each row (D0 and D multiples of 8). Eight values in a row start at bit
        8 * KB * a of their group's stream and their states lie within the next 7 * KB + L <= 32 bits:
        one 32-bit word (built from 4 byte loads; the stream is only 2-byte aligned) serves 8 values, and
        the group's scale is read once per 8 values, instead of 3 byte loads and a scale per value."""
        NW: tl.constexpr = D // 8
        wi = D0 // 8 + tl.arange(0, NW)            # which 8 values
        grp = wi // 16                             # 16 of them per 128-value group
        bp = rp + (grp * GB + 2 + (wi % 16) * KB)[None, :]
        mw = m2 & (wi >= 0)[None, :]               # [R, NW]
        w = (tl.load(bp, mask=mw, other=0).to(tl.int32)
             | (tl.load(bp + 1, mask=mw, other=0).to(tl.int32) << 8)
             | (tl.load(bp + 2, mask=mw, other=0).to(tl.int32) << 16))
        if 7 * KB + L > 24:
            w = w | (tl.load(bp + 3, mask=mw, other=0).to(tl.int32) << 24)
        s = _f16_at(rp + (grp * GB)[None, :], mw)
        MASK: tl.constexpr = (1 << L) - 1
        # the 8 states as a trailing axis by broadcast shifts. (Built with nested tl.join instead, as
        # kernels/quant/packed.py builds its tiles, the values were right on their own and through an fp32
        # dot, but an fp16 tensor-core dot of them gave wrong results on the H200: Triton 3.6.)
        st = (w[:, :, None] >> (KB * tl.arange(0, 8))[None, None, :]) & MASK
        v = tl.load(cb_ptr + st) * s[:, :, None]
        return tl.reshape(v, (w.shape[0], D))

    @triton.jit
    def load_values(base_ptr, row_off, offs_d, mask, cb_ptr, CODEC: tl.constexpr, D0=0):
        """base_ptr: uint8 storage; row_off [R] int64 byte offset of each row; offs_d [D] the value
        indices to read, D0 .. D0 + D (D0 a multiple of D); mask [R]. Returns float32 [R, D] (0 where
        masked)."""
        m2 = mask[:, None]
        rp = base_ptr + row_off[:, None]
        if CODEC == 0:      # f32
            v = tl.load(_typed_rows(base_ptr, row_off, offs_d, tl.float32, 4), mask=m2, other=0.0)
        elif CODEC == 1:    # f16
            v = tl.load(_typed_rows(base_ptr, row_off, offs_d, tl.float16, 2), mask=m2, other=0.0).to(tl.float32)
        elif CODEC == 2:    # bf16
            v = tl.load(_typed_rows(base_ptr, row_off, offs_d, tl.bfloat16, 2), mask=m2, other=0.0).to(tl.float32)
        elif CODEC == 3:    # q8_0: 32 values in 34 bytes
            blk = offs_d // 32
            q = tl.load((rp + (blk * 34 + 2 + offs_d % 32)[None, :]).to(tl.pointer_type(tl.int8)), mask=m2, other=0)
            v = _group_scaled(q.to(tl.float32), _group_scales(rp, D0, m2, offs_d.shape[0], 32, 34), 32)
        elif CODEC == 4:    # turbo4: 128 values in 66 bytes
            grp = offs_d // 128
            j = offs_d % 128
            b = tl.load(rp + (grp * 66 + 2 + j // 2)[None, :], mask=m2, other=0).to(tl.int32)
            code = (b >> ((j % 2) * 4)[None, :]) & 15
            v = _group_scaled(tl.load(cb_ptr + code), _group_scales(rp, D0, m2, offs_d.shape[0], 128, 66), 128)
        elif CODEC == 5 or CODEC == 6:    # turbo3 (14 bytes) / turbo2 (10 bytes) per 32 values
            BB: tl.constexpr = 14 if CODEC == 5 else 10
            blk = offs_d // 32
            j = offs_d % 32
            lo = tl.load(rp + (blk * BB + 2 + j // 4)[None, :], mask=m2, other=0).to(tl.int32)
            code = (lo >> ((j % 4) * 2)[None, :]) & 3
            if CODEC == 5:
                hi = tl.load(rp + (blk * BB + 10 + j // 8)[None, :], mask=m2, other=0).to(tl.int32)
                code = code | (((hi >> (j % 8)[None, :]) & 1) << 2)
            v = _group_scaled(tl.load(cb_ptr + code), _group_scales(rp, D0, m2, offs_d.shape[0], 32, BB), 32)
        elif CODEC == 7:    # turbo3_tcq: 128 values in 52 bytes
            v = _tcq_values(rp, D0, m2, cb_ptr, offs_d.shape[0], 3, 9, 52)
        else:               # turbo2_tcq: 128 values in 36 bytes
            v = _tcq_values(rp, D0, m2, cb_ptr, offs_d.shape[0], 2, 8, 36)
        return v

    @triton.jit
    def _decode_kernel(p_ptr, cb_ptr, out_ptr, N, row_bytes, DS: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_R: tl.constexpr, CODEC: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mr = r < N
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        v = load_values(p_ptr, r.to(tl.int64) * row_bytes, offs_d, mr, cb_ptr, CODEC, tl.program_id(1) * BLOCK_D)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * DS + offs_d[None, :], v, mask=mr[:, None])


def decode_rows_triton(p2: torch.Tensor, codec) -> torch.Tensor:
    """uint8 [N, row_bytes] -> float32 [N, stored values] with the Triton decoder."""
    n, rb = p2.shape
    ds = rb // codec.group_bytes * codec.group
    out = torch.empty(n, ds, dtype=torch.float32, device=p2.device)
    block_d = 128
    while ds % block_d:
        block_d //= 2
    block_r = 16
    _decode_kernel[(triton.cdiv(n, block_r), ds // block_d)](
        p2, codec.codebook(p2.device), out, n, rb, DS=ds, BLOCK_D=block_d, BLOCK_R=block_r, CODEC=codec.codec_id)
    return out
