"""The bytes of synthetic tensors: K-quant quantizers (float rows -> blocks) and random blocks made
directly for large quantized tensors (engine/tools/synth.py's "How values are made").

gguf 0.19 quantizes F16/BF16 and the 32-element types but only dequantizes K-quants, so Q4_K/Q5_K/Q6_K
are encoded here with simple min/max fits: valid and well-scaled, not optimal.
"""
from __future__ import annotations

import math

import numpy as np
import gguf
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

__all__ = ["quantize_q4_k", "quantize_q5_k", "quantize_q6_k", "encode", "direct_blocks", "DIRECT_TYPES"]


# ---------------------------------------------------------------------------------------------
# K-quant quantizers (float -> blocks); simple min/max fits, valid and well-scaled, not optimal

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and mins of 8 sub-blocks -> the 12 bytes of Q4_K/Q5_K (inverse of get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    return out


def _affine_fit(x: np.ndarray, levels: int):
    """x (nb, 8, 32) -> (d16, dmin16, sc, m, q) with x ~= d*sc*q - dmin*m, q in [0, levels]."""
    mn = np.minimum(x.min(axis=-1), 0.0)
    mx = np.maximum(x.max(axis=-1), mn)
    scale = (mx - mn) / levels
    mins = -mn
    d16 = _f16(scale.max(axis=-1) / 63.0)
    dmin16 = _f16(mins.max(axis=-1) / 63.0)
    d = d16.astype(np.float32)[:, None]
    dmin = dmin16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(np.rint(scale / d), 0, 63), 0)
        m = np.where(dmin > 0, np.clip(np.rint(mins / dmin), 0, 63), 0)
        step = (d * sc)[..., None]
        q = np.where(step > 0, np.rint((x + (dmin * m)[..., None]) / step), 0)
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d16, dmin16, sc.astype(np.uint8), m.astype(np.uint8), q


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float rows (..., n*256) -> Q4_K blocks as uint8 (..., n*144)."""
    lead = x.shape[:-1]
    xb = np.asarray(x, dtype=np.float32).reshape(-1, 8, 32)
    d16, dmin16, sc, m, q = _affine_fit(xb, 15)
    nb = xb.shape[0]
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(nb, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(nb, 2), dmin16.view(np.uint8).reshape(nb, 2),
                          _pack_k_scales(sc, m), qs], axis=1)
    return out.reshape(lead + (-1,))


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float rows (..., n*256) -> Q5_K blocks as uint8 (..., n*176)."""
    lead = x.shape[:-1]
    xb = np.asarray(x, dtype=np.float32).reshape(-1, 8, 32)
    d16, dmin16, sc, m, q = _affine_fit(xb, 31)
    nb = xb.shape[0]
    lo = q & 0xF
    qs = (lo[:, 0::2, :] | (lo[:, 1::2, :] << 4)).reshape(nb, 128)
    hi = (q >> 4) & 1                                                  # (nb, 8, 32)
    qh = np.zeros((nb, 32), dtype=np.uint8)
    for i in range(8):
        qh |= hi[:, i, :] << i
    out = np.concatenate([d16.view(np.uint8).reshape(nb, 2), dmin16.view(np.uint8).reshape(nb, 2),
                          _pack_k_scales(sc, m), qh, qs], axis=1)
    return out.reshape(lead + (-1,))


def _pack_q6_k(q: np.ndarray, scales: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """q (nb, 256) codes 0..63, scales (nb, 16) int8, d16 (nb,) -> Q6_K blocks (nb, 210)."""
    nb = q.shape[0]
    qh_ = q.reshape(nb, 2, 128)
    ql = ((qh_[:, :, :64] & 0xF) | ((qh_[:, :, 64:] & 0xF) << 4)).reshape(nb, 128)
    hi = (qh_ >> 4) & 3
    qh = (hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8), d16.view(np.uint8).reshape(nb, 2)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float rows (..., n*256) -> Q6_K blocks as uint8 (..., n*210)."""
    lead = x.shape[:-1]
    xb = np.asarray(x, dtype=np.float32).reshape(-1, 16, 16)
    nb = xb.shape[0]
    scale = np.abs(xb).max(axis=-1) / 31.0                             # (nb, 16)
    d16 = _f16(scale.max(axis=-1) / 127.0)
    d = d16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(np.rint(scale / d), 0, 127), 0)
        step = (d * sc)[..., None]
        q = np.where(step > 0, np.rint(xb / step), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 256)
    return _pack_q6_k(q, sc.astype(np.int8), d16).reshape(lead + (-1,))


_K_QUANTIZERS = {QT.Q4_K: quantize_q4_k, QT.Q5_K: quantize_q5_k, QT.Q6_K: quantize_q6_k}


def encode(x: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 rows -> the tensor's bytes (uint8, flat)."""
    if qtype == QT.F32:
        out = x.astype(np.float32, copy=False)
    elif qtype == QT.F16:
        out = x.astype(np.float16)
    elif qtype in _K_QUANTIZERS:
        out = _K_QUANTIZERS[qtype](x)
    else:
        out = gguf.quants.quantize(x, qtype)
    return np.ascontiguousarray(out).view(np.uint8).reshape(-1)


# ---------------------------------------------------------------------------------------------
# direct block generation (large quantized tensors)

def _rms_uniform_int(lo: int, hi: int) -> float:
    v = np.arange(lo, hi + 1, dtype=np.float64)
    return float(np.sqrt(np.mean(v * v)))


_SC_LO, _SC_HI = 40, 63                     # K-quant sub-block scales: uniform integers in this range
_SC_RMS = _rms_uniform_int(_SC_LO, _SC_HI)


def _random_bytes(rng: np.random.SFC64, n: int) -> np.ndarray:
    raw = rng.random_raw((n + 7) // 8)
    return raw.view(np.uint8)[:n]


def _scale_tables() -> tuple[np.ndarray, np.ndarray]:
    """Fixed random tables of sub-block scales (drawn once from a constant seed): 256 packed Q4_K/Q5_K
    scale+min patterns (sc = m, uniform in [_SC_LO, _SC_HI]) and 4096 Q6_K patterns (the same
    magnitudes with random signs). A block picks one by a random index: one gather per chunk."""
    g = np.random.Generator(np.random.SFC64(0x5EED))
    sc = g.integers(_SC_LO, _SC_HI + 1, size=(256, 8)).astype(np.uint8)
    k_table = _pack_k_scales(sc, sc)
    mag = g.integers(_SC_LO, _SC_HI + 1, size=(4096, 16))
    sign = g.integers(0, 2, size=(4096, 16)) * 2 - 1
    q6_table = (mag * sign).astype(np.int8).view(np.uint8)
    return k_table, q6_table


_K_SCALES, _Q6_SCALES = _scale_tables()


def direct_blocks(qtype: QT, n_blocks: int, std: float, rng: np.random.SFC64) -> np.ndarray:
    """n_blocks random blocks whose dequantized values have mean ~0 and standard deviation `std`:
    random bytes for the quant codes, then the scale fields overwritten."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = _random_bytes(rng, n_blocks * size).reshape(n_blocks, size)
    if qtype in (QT.Q4_K, QT.Q5_K):
        # value = d*sc*q - dmin*m with m = sc and dmin = (levels/2)*d -> d*sc*(q - levels/2), q uniform
        levels = 15 if qtype == QT.Q4_K else 31
        q_rms = math.sqrt(((levels + 1) ** 2 - 1) / 12.0)
        d = np.float16(std / (q_rms * _SC_RMS))
        dmin = np.float16(float(d) * levels / 2.0)
        b[:, 4:16] = _K_SCALES[b[:, 4]]
        b[:, 0:4] = np.frombuffer(d.tobytes() + dmin.tobytes(), dtype=np.uint8)
    elif qtype == QT.Q6_K:
        # value = d*sc*(q - 32), q uniform in 0..63 (mean -0.5: the random scale signs cancel it)
        q_rms = math.sqrt(341.5)
        d = np.float16(std / (q_rms * _SC_RMS))
        idx = (b[:, 192].astype(np.uint16) | (b[:, 193].astype(np.uint16) << 8)) & 4095
        b[:, 192:208] = _Q6_SCALES[idx]
        b[:, 208:210] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    elif qtype in (QT.Q8_0, QT.Q4_0):
        # value = d*q (Q8_0, q int8) or d*(q - 8) (Q4_0); the sign of d is random
        q_rms = math.sqrt((65536 - 1) / 12.0 + 0.25) if qtype == QT.Q8_0 else math.sqrt(21.5)
        d = np.float16(std / q_rms)
        pair = np.stack([np.frombuffer(d.tobytes(), dtype=np.uint8), np.frombuffer((-d).tobytes(), dtype=np.uint8)])
        b[:, 0:2] = pair[b[:, 0] & 1]
    else:
        raise ValueError(f"no direct generator for {qtype.name}")
    return b.reshape(-1)


DIRECT_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0)

