"""turbo3_tcq / turbo2_tcq: trellis-coded quantization with a bit-shift trellis.

Each rotated 128-value group is normalised as in turbo.py (u = y * sqrt(128) / |y|) and coded as
one path through a trellis of 2^L states (L = 9 for 3 bits/value, L = 8 for 2 bits/value). The
group's bit stream b (little-endian bits) defines the state of value t as the L-bit window
    state_t = (b >> (k * t)) & (2^L - 1)        (k = bits per value)
so consecutive states overlap in L - k bits: state_{t+1} = (state_t >> k) | (new k bits << (L - k)),
and value t decodes in O(1) as codebook[state_t] * s. The encoder (Viterbi) picks the path that
minimises sum_t (u_t - codebook[state_t])^2; the stream holds k*127 + L bits (the first state's L
bits, then k new bits per value). The scale s = |y| / |codebook[states]| keeps the original norm.

Layout: 128 values in 52 bytes (3-bit: fp16 s + 50 bytes of stream, 390 bits used) or in 36 bytes
(2-bit: fp16 s + 34 bytes, 262 bits used). The unused tail bits are zero; decoding reads up to 4 bytes
at byte (k*t)/8, which stays inside the group.
The codebooks (one float per state) are trained by train_codebooks.py.
"""
from __future__ import annotations

import math

import torch

from kernels.kvcodec.base import HAVE_TRITON, KVCodec
from kernels.kvcodec.rotation import GROUP, Rotation

if HAVE_TRITON:
    import triton
    import triton.language as tl

SQRT_GROUP = math.sqrt(GROUP)


def viterbi(u: torch.Tensor, codebook: torch.Tensor, L: int, k: int, max_groups: int = 8192) -> torch.Tensor:
    """Best trellis path for each row of u [G, T]: states int64 [G, T] minimising the squared error
    to codebook[state]. Any first state is allowed; state_{t+1} = (state_t >> k) | (j << (L - k))."""
    if u.shape[0] > max_groups:
        return torch.cat([viterbi(u[i:i + max_groups], codebook, L, k, max_groups)
                          for i in range(0, u.shape[0], max_groups)])
    G, T = u.shape
    M = 1 << (L - k)
    cb = codebook.to(u.device, torch.float32)
    cost = (u[:, :1] - cb[None]) ** 2                                # [G, S]
    back = torch.empty(max(T - 1, 0), G, M, dtype=torch.uint8, device=u.device)
    for t in range(1, T):
        best, arg = cost.view(G, M, 1 << k).min(-1)                  # predecessor of s is (s & (M-1)) << k | j
        back[t - 1] = arg
        cost = best.repeat(1, 1 << k) + (u[:, t:t + 1] - cb[None]) ** 2   # s = new * M + m -> best[m]
    s = cost.argmin(-1)
    states = torch.empty(G, T, dtype=torch.long, device=u.device)
    states[:, T - 1] = s
    for t in range(T - 1, 0, -1):
        m = s & (M - 1)
        s = (m << k) | back[t - 1].gather(1, m[:, None])[:, 0].long()
        states[:, t - 1] = s
    return states


def pack_states(states: torch.Tensor, L: int, k: int, n_bytes: int) -> torch.Tensor:
    """States [G, 128] of one valid path -> its bit stream, uint8 [G, n_bytes]."""
    G, T = states.shape
    n_bits = k * (T - 1) + L
    i = torch.arange(n_bytes * 8, device=states.device)
    t = torch.clamp(i // k, max=T - 1)
    sh = i - k * t
    bits = (states[:, t] >> sh.clamp(max=L - 1)) & 1
    bits = torch.where(i < n_bits, bits, torch.zeros_like(bits)).reshape(G, n_bytes, 8)
    return (bits << torch.arange(8, device=states.device)).sum(-1).to(torch.uint8)


def unpack_states(stream: torch.Tensor, L: int, k: int, T: int = GROUP) -> torch.Tensor:
    """Bit streams uint8 [G, n_bytes] -> states int64 [G, T]."""
    o = torch.arange(T, device=stream.device) * k
    b = stream.long()
    w = b[:, o // 8] | (b[:, o // 8 + 1] << 8) | (b[:, o // 8 + 2] << 16)
    return (w >> (o % 8)) & ((1 << L) - 1)


class TCQCodec(KVCodec):
    rotated = True
    group = GROUP

    def __init__(self, name: str, bits: int, codec_id: int, rotation: Rotation, codebook: torch.Tensor):
        self.name, self.k, self.codec_id, self.rotation = name, bits, codec_id, rotation
        self.L = {3: 9, 2: 8}[bits]
        self.group_bytes = 2 + GROUP * bits // 8 + 2        # 52 or 36
        self.stream_bytes = self.group_bytes - 2
        cb = codebook.to(torch.float32).reshape(-1)
        if cb.numel() != 1 << self.L:
            raise ValueError(f"{name}: need a codebook of {1 << self.L} values, got {cb.numel()}")
        self.table = cb
        self._dev: dict = {}

    def codebook(self, device="cpu") -> torch.Tensor:
        key = str(device)
        t = self._dev.get(key)
        if t is None:
            t = self._dev[key] = self.table.to(device)
        return t

    # ----- torch reference -----
    def quantize_stored(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated rows y [N, Dp] -> states int64 [N * Dp/128, 128] and scales float32 [N * Dp/128]."""
        g = y.reshape(-1, GROUP)
        nrm = g.norm(dim=-1)
        inv = torch.where(nrm > 0, SQRT_GROUP / nrm, torch.zeros_like(nrm))
        cb = self.codebook(y.device)
        states = viterbi(g * inv[:, None], cb, self.L, self.k)
        return states, nrm / cb[states].norm(dim=-1)

    def pack(self, states: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        stream = pack_states(states, self.L, self.k, self.stream_bytes)
        s = scales.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)
        return torch.cat([s, stream], dim=-1).reshape(n, -1)

    def _encode_ref(self, x2):
        return self.pack(*self.quantize_stored(self.rotation.rotate(x2)), x2.shape[0])

    def unpack(self, p2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = p2.reshape(-1, self.group_bytes)
        scales = b[:, :2].contiguous().view(torch.float16).float()[:, 0]
        return unpack_states(b[:, 2:], self.L, self.k), scales

    def _decode_ref(self, p2):
        states, scales = self.unpack(p2)
        v = self.codebook(p2.device)[states] * scales[:, None]
        return v.reshape(p2.shape[0], -1)

    # ----- Triton -----
    def _encode_triton(self, x2):
        n, d = x2.shape
        y = self.rotation.rotate(x2).reshape(-1, GROUP).contiguous()
        g = y.shape[0]
        out = torch.empty(n, self.row_bytes(d), dtype=torch.uint8, device=x2.device)
        M = 1 << (self.L - self.k)
        back = torch.empty(g, GROUP, M, dtype=torch.uint8, device=x2.device)
        states = torch.empty(g, GROUP, dtype=torch.int32, device=x2.device)
        _tcq_encode_kernel[(g,)](y, self.codebook(x2.device), back, states, out,
                                 KB=self.k, L=self.L, GB=self.group_bytes,
                                 **({"num_warps": 4} if x2.is_cuda else {}))
        return out


if HAVE_TRITON:
    @triton.jit
    def _tcq_encode_kernel(y_ptr, cb_ptr, back_ptr, st_ptr, out_ptr,
                           KB: tl.constexpr, L: tl.constexpr, GB: tl.constexpr):
        """Viterbi over one 128-value group per program; one trellis state per lane."""
        S: tl.constexpr = 1 << L
        M: tl.constexpr = 1 << (L - KB)
        NK: tl.constexpr = 1 << KB
        g = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, 128)
        y = tl.load(y_ptr + g * 128 + j)
        nrm = tl.sqrt_rn(tl.sum(y * y, axis=0))
        inv = tl.where(nrm > 0, tl.math.div_rn(11.313708498984761, tl.maximum(nrm, 1e-30)), 0.0)
        s_idx = tl.arange(0, S)
        cb = tl.load(cb_ptr + s_idx)
        u0 = tl.load(y_ptr + g * 128) * inv
        cost = (u0 - cb) * (u0 - cb)
        bp = back_ptr + g * 128 * M
        m_idx = tl.arange(0, M)
        for t in range(1, 128):
            c2 = tl.reshape(cost, (M, NK))
            best = tl.min(c2, axis=1)
            arg = tl.argmin(c2, axis=1)
            tl.store(bp + t * M + m_idx, arg.to(tl.uint8))
            ut = tl.load(y_ptr + g * 128 + t) * inv
            full = tl.reshape(tl.broadcast_to(best[None, :], (NK, M)), (S,))
            cost = full + (ut - cb) * (ut - cb)
        s = tl.argmin(cost, axis=0).to(tl.int32)
        sp = st_ptr + g * 128
        tl.store(sp + 127, s)
        tl.debug_barrier()
        for tt in range(0, 127):
            t = 127 - tt
            m = s & (M - 1)
            s = (m << KB) | tl.load(bp + t * M + m).to(tl.int32)
            tl.store(sp + t - 1, s)
        tl.debug_barrier()
        states = tl.load(sp + j)
        c = tl.load(cb_ptr + states)
        scale = tl.math.div_rn(nrm, tl.sqrt_rn(tl.sum(c * c, axis=0)))
        ob = out_ptr + g * GB
        tl.store(ob.to(tl.pointer_type(tl.float16)), scale.to(tl.float16))
        NBITS: tl.constexpr = KB * 127 + L
        byte = tl.arange(0, 64)
        acc = tl.zeros((64,), dtype=tl.int32)
        for r in tl.static_range(8):
            i = byte * 8 + r
            t = tl.minimum(i // KB, 127)
            st = tl.load(sp + t, mask=byte < GB - 2, other=0)
            bit = (st >> tl.minimum(i - KB * t, L - 1)) & 1
            acc |= tl.where(i < NBITS, bit, 0) << r
        tl.store(ob + 2 + byte, acc.to(tl.uint8), mask=byte < GB - 2)
