"""Float weights as the K-quant blocks llama.cpp writes (gguf quantizes the 32-wide types itself, not these):
each super-block of 256 holds its sub-blocks' scales in 6 or 8 bits of an f16 maximum, then each weight's
nearest code, in ggml's byte layout (gguf's dequantize_blocks reads it back; tests/model/test_qmm.py checks).

These follow llama.cpp's quantize_row_q*_K_ref without its search for better scales (make_qkx2_quants' and
make_qx_quants' refinement): the codes are a quantizer's, with realistic magnitudes, and the tests compare
against gguf's dequantization of exactly these blocks, so the refinement would change nothing they check.

Random bytes would decode to weights no quantizer writes: all-positive, a mean of 1.2 against a model's 0, and
logits near 1000."""

from __future__ import annotations

import numpy as np


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _scales_mins(x: np.ndarray, levels: int):
    """Sub-blocks of 32 spanning their min (never above 0) to their max in `levels` steps, the steps and mins in
    6 bits of their super-block's largest: (d, dmin) f16 [S, 1] and (sc, mn) uint8 [S, 8], and the codes."""
    low = np.minimum(x.min(-1), 0)
    steps, mins = (x.max(-1) - low) / levels, -low
    top_step, top_min = steps.max(-1, keepdims=True), mins.max(-1, keepdims=True)
    sc = np.rint(steps * (63 / np.where(top_step > 0, top_step, 1))).clip(0, 63).astype(np.uint8)
    mn = np.rint(mins * (63 / np.where(top_min > 0, top_min, 1))).clip(0, 63).astype(np.uint8)
    d, dmin = _f16(top_step / 63), _f16(top_min / 63)
    step = (d.astype(np.float32) * sc)[..., None]
    q = np.rint((x + (dmin.astype(np.float32) * mn)[..., None]) / np.where(step > 0, step, 1))
    return d, dmin, sc, mn, q.clip(0, levels).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """ggml's 12 bytes of eight 6-bit scales and mins (see gguf's Q4_K.get_scale_min)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4 << 6)
    out[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4 << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | (mn[:, 4:] << 4)
    return out


def q4_k_blocks(w: np.ndarray) -> np.ndarray:
    """[n, k] (k a multiple of 256) -> Q4_K blocks [n, k / 256 * 144]."""
    n, k = w.shape
    d, dmin, sc, mn, q = _scales_mins(w.astype(np.float32).reshape(-1, 8, 32), 15)
    q = q.reshape(-1, 4, 2, 32)  # runs of 64: the low nibbles are the first 32
    out = np.empty((q.shape[0], 144), np.uint8)
    out[:, 0:2], out[:, 2:4] = d.view(np.uint8), dmin.view(np.uint8)
    out[:, 4:16] = _pack_scales(sc, mn)
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return out.reshape(n, -1)


def q5_k_blocks(w: np.ndarray) -> np.ndarray:
    """[n, k] -> Q5_K blocks [n, k / 256 * 176]: Q4_K's layout with 31 steps, each code's fifth bit in qh (bit
    2c of qh[l] for code 64c + l, bit 2c + 1 for code 64c + 32 + l)."""
    n, k = w.shape
    d, dmin, sc, mn, q = _scales_mins(w.astype(np.float32).reshape(-1, 8, 32), 31)
    q = q.reshape(-1, 4, 2, 32)
    low = q & 0x0F
    high = (q >> 4).astype(np.uint8)  # [S, 4, 2, 32]: one bit per code
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for c in range(4):
        qh |= high[:, c, 0] << (2 * c)
        qh |= high[:, c, 1] << (2 * c + 1)
    out = np.empty((q.shape[0], 176), np.uint8)
    out[:, 0:2], out[:, 2:4] = d.view(np.uint8), dmin.view(np.uint8)
    out[:, 4:16] = _pack_scales(sc, mn)
    out[:, 16:48] = qh
    out[:, 48:] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    return out.reshape(n, -1)


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """[n, k] -> Q6_K blocks [n, k / 256 * 210]: per 16 weights an int8 scale of the f16 d, codes -32..31 stored
    +32 in 6 bits (ql's nibbles, qh's bit pairs), as quantize_row_q6_K_ref lays them out."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)  # super-blocks of 16 groups of 16
    group = np.abs(x).max(-1) / 31  # each group's step
    top = group.max(-1, keepdims=True)
    d = _f16(top / 127)
    sc = np.rint(group / np.where(d.astype(np.float32) > 0, d.astype(np.float32), 1)).clip(-128, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None]
    q = (np.rint(x / np.where(step != 0, step, 1)).clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.empty((q.shape[0], 2, 64), np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.empty((q.shape[0], 210), np.uint8)
    out[:, 0:128] = ql.reshape(-1, 128)
    out[:, 128:192] = qh.reshape(-1, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.view(np.uint8)
    return out.reshape(n, -1)


QUANTIZERS = {"Q4_K": q4_k_blocks, "Q5_K": q5_k_blocks, "Q6_K": q6_k_blocks}


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """w [n, k] as kind's blocks [n, bytes per row], by gguf's quantizer or, for the K types, the above."""
    import gguf

    if kind in QUANTIZERS:
        return QUANTIZERS[kind](w)
    return np.ascontiguousarray(gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind]))
