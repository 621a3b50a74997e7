"""ggml element types: vectorised dequantisation of every readable type and quantisation of the writable ones.

Block layouts and rounding rules are those of ggml's reference quantisers (``ggml-quants.c``); every function works
on whole arrays of blocks at once.  Blocks arrive as uint8 arrays of shape ``(..., n_blocks, type_size)`` and
decode to float32 arrays of shape ``(..., n_blocks * blck)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ggml_rpc.spec import TYPES, GgmlType, type_name

from ..graph import ExecutorError

Q4_0 = int(GgmlType.Q4_0)
Q4_1 = int(GgmlType.Q4_1)
Q5_0 = int(GgmlType.Q5_0)
Q5_1 = int(GgmlType.Q5_1)
Q8_0 = int(GgmlType.Q8_0)
Q8_1 = int(GgmlType.Q8_1)
Q2_K = int(GgmlType.Q2_K)
Q3_K = int(GgmlType.Q3_K)
Q4_K = int(GgmlType.Q4_K)
Q5_K = int(GgmlType.Q5_K)
Q6_K = int(GgmlType.Q6_K)
Q8_K = int(GgmlType.Q8_K)
IQ4_NL = int(GgmlType.IQ4_NL)
F32 = int(GgmlType.F32)
F16 = int(GgmlType.F16)
BF16 = int(GgmlType.BF16)

#: The 16 non-linear levels of IQ4_NL.
IQ4NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

# ---- small helpers ---------------------------------------------------------------------------------------------


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The little-endian f16 at byte ``at`` of every block, as float32 of shape (n, 1)."""
    return np.ascontiguousarray(b[:, at : at + 2]).view("<f2").astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """Nibbles of 16 bytes per block in ggml's order: the 16 low nibbles, then the 16 high ones: (n, 32) uint8."""
    q = np.empty((qs.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])
    return q


def round_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves away from zero, exact for every float32 (no ``x + 0.5`` rounding trap)."""
    r = np.trunc(v)
    frac = v - r
    return r + np.where(np.abs(frac) >= 0.5, np.sign(v), 0).astype(v.dtype)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per row, the value with the largest magnitude (first one on ties), shape (n, 1)."""
    idx = np.argmax(np.abs(x), axis=1)
    return np.take_along_axis(x, idx[:, None], axis=1)


def _to_half_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2").view(np.uint8).reshape(v.shape[0], 2)


# ---- float formats ---------------------------------------------------------------------------------------------


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) to float32: the bits are the high half of an f32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to BF16 bits: round to nearest even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded = np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)
    return rounded


# ---- dequantisation (blocks (n, size) -> (n, blck)) ------------------------------------------------------------


def _dq_q4_0(b: np.ndarray) -> np.ndarray:
    q = _low_high(b[:, 2:18]).view(np.int8)
    q -= 8
    return np.multiply(q, _half(b, 0), dtype=np.float32)


def _dq_q4_1(b: np.ndarray) -> np.ndarray:
    return _low_high(b[:, 4:20]) * _half(b, 0) + _half(b, 2)


def _q5_values(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh_bytes).view("<u4")  # (n, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return _low_high(qs) | high


def _dq_q5_0(b: np.ndarray) -> np.ndarray:
    q = _q5_values(b[:, 2:6], b[:, 6:22]).astype(np.int8) - np.int8(16)
    return q * _half(b, 0)


def _dq_q5_1(b: np.ndarray) -> np.ndarray:
    return _q5_values(b[:, 4:8], b[:, 8:24]) * _half(b, 0) + _half(b, 2)


def _dq_q8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:34].view(np.int8) * _half(b, 0)


def _dq_q8_1(b: np.ndarray) -> np.ndarray:
    return b[:, 4:36].view(np.int8) * _half(b, 0)


def _dq_iq4_nl(b: np.ndarray) -> np.ndarray:
    return IQ4NL_LEVELS[_low_high(b[:, 2:18])] * _half(b, 0)


def _dq_q8_k(b: np.ndarray) -> np.ndarray:
    d = np.ascontiguousarray(b[:, 0:4]).view("<f4")
    return b[:, 4:260].view(np.int8) * d


# K-quants: 256 elements per super-block; element e uses scale e // 16 (Q2_K, Q3_K, Q6_K) or e // 32 (Q4_K, Q5_K).
_E = np.arange(256)
# Q2_K / Q3_K: element e reads byte 32 * (e // 128) + e % 32 of qs at bit shift 2 * ((e % 128) // 32).
_Q23_BYTE = 32 * (_E // 128) + _E % 32
_Q23_SHIFT = (2 * ((_E % 128) // 32)).astype(np.uint8)
_Q3_HBIT = (4 * (_E // 128) + (_E % 128) // 32).astype(np.uint8)
_Q3_HBYTE = _E % 32
# Q6_K: half n = e // 128, quarter g = (e % 128) // 32, l = e % 32.
_Q6_N, _Q6_G, _Q6_L = _E // 128, (_E % 128) // 32, _E % 32
_Q6_LBYTE = 64 * _Q6_N + _Q6_L + 32 * (_Q6_G % 2)
_Q6_LSHIFT = (4 * (_Q6_G // 2)).astype(np.uint8)
_Q6_HBYTE = 128 + 32 * _Q6_N + _Q6_L
_Q6_HSHIFT = (2 * _Q6_G).astype(np.uint8)


def _k_scales_6bit(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 six-bit scales and 8 six-bit mins packed in 12 bytes, each (n, 8)."""
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _dq_q2_k(b: np.ndarray) -> np.ndarray:
    sc = b[:, 0:16]
    q = ((b[:, 16:80][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(np.float32)
    d, dmin = _half(b, 80), _half(b, 82)
    mul = np.repeat((sc & 0x0F) * d, 16, axis=1)
    sub = np.repeat((sc >> 4) * dmin, 16, axis=1)
    return q * mul - sub


def _dq_q3_k(b: np.ndarray) -> np.ndarray:
    s = b[:, 96:108]
    k = np.arange(16)
    low = np.where(k < 8, s[:, k % 8] & 0x0F, s[:, k % 8] >> 4)
    high = (s[:, 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    scales = (low | (high << 4)).astype(np.int16) - 32
    q = ((b[:, 32:96][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(np.int8)
    hbit = (b[:, 0:32][:, _Q3_HBYTE] >> _Q3_HBIT) & 1
    q = q - np.where(hbit == 0, np.int8(4), np.int8(0))
    return q * np.repeat(scales * _half(b, 108), 16, axis=1)


def _nibble_chunks(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 128 bytes as 4 chunks of 32 low nibbles then 32 high nibbles: (n, 8, 32) uint8."""
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32)
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(chunks[:, :, 0], 0x0F, out=q[:, :, 0])
    np.right_shift(chunks[:, :, 0], 4, out=q[:, :, 1])
    return q.reshape(n, 8, 32)


def _scaled_sub_blocks(q: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: ``d * scale_j * q - dmin * min_j`` over the 8 sub-blocks of 32: (n, 256) float32."""
    sc, mn = _k_scales_6bit(b[:, 4:16])
    scale = (sc * _half(b, 0))[:, :, None]
    offset = (mn * _half(b, 2))[:, :, None]
    out = np.multiply(q, scale, dtype=np.float32)
    out -= offset
    return out.reshape(q.shape[0], 256)


def _dq_q4_k(b: np.ndarray) -> np.ndarray:
    return _scaled_sub_blocks(_nibble_chunks(np.ascontiguousarray(b[:, 16:144])), b)


def _dq_q5_k(b: np.ndarray) -> np.ndarray:
    q = _nibble_chunks(np.ascontiguousarray(b[:, 48:176]))
    # Sub-block j takes bit j of each of the 32 qh bytes as its fifth bit.
    high = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q |= high << 4
    return _scaled_sub_blocks(q, b)


def _dq_q6_k(b: np.ndarray) -> np.ndarray:
    low = (b[:, _Q6_LBYTE] >> _Q6_LSHIFT) & 0x0F
    high = (b[:, _Q6_HBYTE] >> _Q6_HSHIFT) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = b[:, 192:208].view(np.int8) * _half(b, 208)
    return q * np.repeat(scales, 16, axis=1)


DEQUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q4_0: _dq_q4_0,
    Q4_1: _dq_q4_1,
    Q5_0: _dq_q5_0,
    Q5_1: _dq_q5_1,
    Q8_0: _dq_q8_0,
    Q8_1: _dq_q8_1,
    Q2_K: _dq_q2_k,
    Q3_K: _dq_q3_k,
    Q4_K: _dq_q4_k,
    Q5_K: _dq_q5_k,
    Q6_K: _dq_q6_k,
    Q8_K: _dq_q8_k,
    IQ4_NL: _dq_iq4_nl,
}


def dequantize(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """Blocks ``(..., n_blocks, type_size)`` of a quantised type to float32 ``(..., n_blocks * blck)``."""
    fn = DEQUANT.get(type_id)
    if fn is None:
        raise ExecutorError(f"no dequantisation for type {type_name(type_id)}")
    info = TYPES[type_id]
    lead = blocks.shape[:-2]
    flat = np.ascontiguousarray(blocks).reshape(-1, info.size)
    out = fn(flat).astype(np.float32, copy=False)
    return out.reshape(*lead, blocks.shape[-2] * info.blck)


# ---- quantisation (float32 (n, blck) -> blocks (n, size)) ------------------------------------------------------


def _q8_scale(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0/Q8_1 as ggml's x86 CPU backend quantises (its AVX path, the one upstream runs here): d = amax / 127,
    the codes ``x * (127 / amax)`` rounded half to even.  The generic C path multiplies by ``1 / d`` and rounds
    halves away from zero; the two differ by one code now and then, enough to move a Q4_0 model's logits by
    NMSE 1e-5 (measured against upstream 6.0.0/7.0.0, which agree with this one)."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    return d, np.rint(x * inv).astype(np.int8)


def _q_q8_0(x: np.ndarray) -> np.ndarray:
    d, q = _q8_scale(x)
    out = np.empty((x.shape[0], 34), dtype=np.uint8)
    out[:, 0:2] = _to_half_bytes(d)
    out[:, 2:34] = q.view(np.uint8)
    return out


def _q_q8_1(x: np.ndarray) -> np.ndarray:
    d, q = _q8_scale(x)
    s = q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32) * d
    out = np.empty((x.shape[0], 36), dtype=np.uint8)
    out[:, 0:2] = _to_half_bytes(d)
    out[:, 2:4] = _to_half_bytes(s)
    out[:, 4:36] = q.view(np.uint8)
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values < 16 to ggml's 16 bytes: element j in the low nibble, element j + 16 in the high one."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _symmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0: d = max / -levels (max = signed value of largest magnitude) and the codes in [0, 2 * levels)."""
    mx = _signed_absmax(x)
    d = mx / np.float32(-levels)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.trunc(x * inv + np.float32(levels + 0.5))
    return d, np.minimum(q, 2 * levels - 1).astype(np.uint8)


def _affine(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1: d = (max - min) / top, m = min, codes = trunc((x - min) / d + 0.5)."""
    mn = x.min(axis=1, keepdims=True)
    mx = x.max(axis=1, keepdims=True)
    d = (mx - mn) / np.float32(top)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.trunc((x - mn) * inv + np.float32(0.5))
    return d, mn, np.minimum(q, top).astype(np.uint8)


def _qh_bits(q: np.ndarray) -> np.ndarray:
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(q.shape[0], 4)


def _q_q4_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 8)
    out = np.empty((x.shape[0], 18), dtype=np.uint8)
    out[:, 0:2] = _to_half_bytes(d)
    out[:, 2:18] = _pack_nibbles(q)
    return out


def _q_q4_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _affine(x, 15)
    out = np.empty((x.shape[0], 20), dtype=np.uint8)
    out[:, 0:2] = _to_half_bytes(d)
    out[:, 2:4] = _to_half_bytes(m)
    out[:, 4:20] = _pack_nibbles(q)
    return out


def _q_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 16)
    out = np.empty((x.shape[0], 22), dtype=np.uint8)
    out[:, 0:2] = _to_half_bytes(d)
    out[:, 2:6] = _qh_bits(q)
    out[:, 6:22] = _pack_nibbles(q & 0x0F)
    return out


def _q_q5_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _affine(x, 31)
    out = np.empty((x.shape[0], 24), dtype=np.uint8)
    out[:, 0:2] = _to_half_bytes(d)
    out[:, 2:4] = _to_half_bytes(m)
    out[:, 4:8] = _qh_bits(q)
    out[:, 8:24] = _pack_nibbles(q & 0x0F)
    return out


def _q_q8_k(x: np.ndarray) -> np.ndarray:
    mx = _signed_absmax(x)
    iscale = np.divide(np.float32(-127), mx, out=np.zeros_like(mx), where=mx != 0)
    q = np.minimum(np.rint(x * iscale), 127).astype(np.int8)  # nearest, ties to even
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    out = np.empty((x.shape[0], 292), dtype=np.uint8)
    out[:, 0:4] = d.astype("<f4").view(np.uint8)
    out[:, 4:260] = q.view(np.uint8)
    out[:, 260:292] = q.reshape(-1, 16, 16).astype(np.int16).sum(axis=2).astype("<i2").view(np.uint8)
    return out


_IQ4NL_F = IQ4NL_LEVELS.astype(np.float32)


def nearest_level(v: np.ndarray) -> np.ndarray:
    """Index of the IQ4_NL level nearest to each value (the lower one only when strictly nearer)."""
    upper = np.clip(np.searchsorted(_IQ4NL_F, v, side="right"), 1, 15)
    lower = upper - 1
    pick_lower = (v - _IQ4NL_F[lower]) < (_IQ4NL_F[upper] - v)
    idx = np.where(pick_lower, lower, upper)
    idx = np.where(v <= _IQ4NL_F[0], 0, idx)
    return np.where(v >= _IQ4NL_F[15], 15, idx).astype(np.uint8)


def _q_iq4_nl(x: np.ndarray) -> np.ndarray:
    # Reference quantiser: d0 = max / -127 picks the levels, then d is the x^2-weighted least-squares scale.
    mx = _signed_absmax(x)
    live = np.abs(mx) >= 1e-15
    d0 = np.where(live, mx / np.float32(-127), np.float32(1))
    levels = nearest_level(x * (np.float32(1) / d0))
    q = _IQ4NL_F[levels]
    w = x * x
    sumqx = np.cumsum(w * q * x, axis=1, dtype=np.float32)[:, -1:]  # sequential sums, as the scalar loop adds
    sumq2 = np.cumsum(w * q * q, axis=1, dtype=np.float32)[:, -1:]
    d = np.where(live, sumqx / np.where(sumq2 == 0, np.float32(1), sumq2), np.float32(0))
    levels = np.where(live, levels, 0).astype(np.uint8)
    out = np.empty((x.shape[0], 18), dtype=np.uint8)
    out[:, 0:2] = _to_half_bytes(d.astype(np.float32))
    out[:, 2:18] = _pack_nibbles(levels)
    return out


QUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q4_0: _q_q4_0,
    Q4_1: _q_q4_1,
    Q5_0: _q_q5_0,
    Q5_1: _q_q5_1,
    Q8_0: _q_q8_0,
    Q8_1: _q_q8_1,
    Q8_K: _q_q8_k,
    IQ4_NL: _q_iq4_nl,
}


def quantize(type_id: int, x: np.ndarray) -> np.ndarray:
    """float32 ``(..., n)`` with ``n`` a multiple of the block size to blocks ``(..., n / blck, type_size)``."""
    fn = QUANT.get(type_id)
    if fn is None:
        raise ExecutorError(f"no quantisation to type {type_name(type_id)}")
    info = TYPES[type_id]
    lead = x.shape[:-1]
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, info.blck)
    return fn(flat).reshape(*lead, x.shape[-1] // info.blck, info.size)


#: The type ggml's CPU backend converts src1 of MUL_MAT to before the dot products, per weight type.
VEC_DOT_TYPE: dict[int, int] = {
    F32: F32,
    F16: F16,
    BF16: BF16,
    Q4_0: Q8_0,
    Q5_0: Q8_0,
    Q8_0: Q8_0,
    IQ4_NL: Q8_0,
    Q4_1: Q8_1,
    Q5_1: Q8_1,
    Q2_K: Q8_K,
    Q3_K: Q8_K,
    Q4_K: Q8_K,
    Q5_K: Q8_K,
    Q6_K: Q8_K,
}


def through_type(type_id: int, x: np.ndarray) -> np.ndarray:
    """``x`` (float32, last axis a multiple of the block size) as it reads back after being stored as ``type_id``."""
    if type_id == F32:
        return x
    if type_id == F16:
        return x.astype(np.float16).astype(np.float32)
    if type_id == BF16:
        return bf16_to_f32(f32_to_bf16(x))
    return dequantize(type_id, quantize(type_id, x))
