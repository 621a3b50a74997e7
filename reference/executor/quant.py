"""Vectorised quantisation to every block type ggml's CPU backend writes: float32 ``(..., n)`` to uint8 blocks,
with the rounding rules of ggml's reference quantisers (ggml-quants.c) and of its x86 activation path."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ggml_rpc.spec import TYPES, type_name
from ggml_rpc.spec.blocks import pack_blocks

from ..graph import ExecutorError
from .dequant import UE4M3_HALF, e8m0_half
from .formats import (
    E2M1_DOUBLED,
    IQ4_NL,
    IQ4_XS,
    IQ4NL_LEVELS,
    MXFP4,
    NVFP4,
    Q1_0,
    Q2_0,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_1,
    Q8_K,
    SHIFT2,
    TQ1_0,
    TQ2_0,
    round_away,
    signed_absmax,
    to_half_bytes,
)
from .kquant import quantize_q2_k, quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k

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
    return pack_blocks(Q8_0, x.shape[0], d=to_half_bytes(d), qs=q.view(np.uint8))


def _q_q8_1(x: np.ndarray) -> np.ndarray:
    d, q = _q8_scale(x)
    s = q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32) * d
    return pack_blocks(Q8_1, x.shape[0], d=to_half_bytes(d), s=to_half_bytes(s), qs=q.view(np.uint8))


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values < 16 to ggml's 16 bytes: element j in the low nibble, element j + 16 in the high one."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _symmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0: d = max / -levels (max = signed value of largest magnitude) and the codes in [0, 2 * levels)."""
    mx = signed_absmax(x)
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
    return pack_blocks(Q4_0, x.shape[0], d=to_half_bytes(d), qs=_pack_nibbles(q))


def _q_q4_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _affine(x, 15)
    return pack_blocks(Q4_1, x.shape[0], d=to_half_bytes(d), m=to_half_bytes(m), qs=_pack_nibbles(q))


def _q_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 16)
    return pack_blocks(Q5_0, x.shape[0], d=to_half_bytes(d), qh=_qh_bits(q), qs=_pack_nibbles(q & 0x0F))


def _q_q5_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _affine(x, 31)
    return pack_blocks(Q5_1, x.shape[0], d=to_half_bytes(d), m=to_half_bytes(m), qh=_qh_bits(q),
                       qs=_pack_nibbles(q & 0x0F))


def _q_q8_k(x: np.ndarray) -> np.ndarray:
    mx = signed_absmax(x)
    iscale = np.divide(np.float32(-127), mx, out=np.zeros_like(mx), where=mx != 0)
    q = np.minimum(np.rint(x * iscale), 127).astype(np.int8)  # nearest, ties to even
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    bsums = q.reshape(-1, 16, 16).astype(np.int16).sum(axis=2).astype("<i2")
    return pack_blocks(Q8_K, x.shape[0], d=d.astype("<f4").view(np.uint8), qs=q.view(np.uint8),
                       bsums=bsums.view(np.uint8))


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
    mx = signed_absmax(x)
    live = np.abs(mx) >= 1e-15
    d0 = np.where(live, mx / np.float32(-127), np.float32(1))
    levels = nearest_level(x * (np.float32(1) / d0))
    q = _IQ4NL_F[levels]
    w = x * x
    sumqx = np.cumsum(w * q * x, axis=1, dtype=np.float32)[:, -1:]  # sequential sums, as the scalar loop adds
    sumq2 = np.cumsum(w * q * q, axis=1, dtype=np.float32)[:, -1:]
    d = np.where(live, sumqx / np.where(sumq2 == 0, np.float32(1), sumq2), np.float32(0))
    levels = np.where(live, levels, 0).astype(np.uint8)
    return pack_blocks(IQ4_NL, x.shape[0], d=to_half_bytes(d.astype(np.float32)), qs=_pack_nibbles(levels))


def _seq_sum(v: np.ndarray) -> np.ndarray:
    """Row sums added left to right in float32, as ggml's scalar loops add (numpy's pairwise sum differs)."""
    return np.cumsum(v, axis=1, dtype=np.float32)[:, -1:]


def _q_q1_0(x: np.ndarray) -> np.ndarray:
    # d = mean |x|; each bit is the sign (set for x >= 0).
    d = _seq_sum(np.abs(x)) / np.float32(128)
    return pack_blocks(Q1_0, x.shape[0], d=to_half_bytes(d), qs=np.packbits(x >= 0, axis=1, bitorder="little"))


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """(n, 4 * k) values < 4 to k bytes, value j in bits 2 * (j % 4) of byte j // 4."""
    g = q.reshape(q.shape[0], -1, 4).astype(np.uint8) << SHIFT2
    return np.bitwise_or.reduce(g, axis=2)


def _q_q2_0(x: np.ndarray) -> np.ndarray:
    # d = max |x|; codes round(x / d) + 1 clamped to 0..3 (halves away from zero, C roundf).
    d = np.abs(x).max(axis=1, keepdims=True)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(round_away(x * inv) + 1, 0, 3)
    return pack_blocks(Q2_0, x.shape[0], d=to_half_bytes(d), qs=_pack_crumbs(q))


_E2M1_F = E2M1_DOUBLED.astype(np.float32)


def _nearest_e2m1(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per value, the first code whose ``level * scale`` is nearest (ties to the lower code, as ggml's scan)."""
    err = np.abs(_E2M1_F * scale[..., None] - x[..., None])
    return np.argmin(err, axis=-1).astype(np.uint8)


def _pack_fp4(codes: np.ndarray, group: int) -> np.ndarray:
    """Inverse of :func:`_fp4_nibbles`: code j of each group in the low nibble of byte j, j + group / 2 high."""
    n = codes.shape[0]
    g = codes.reshape(n, -1, 2, group // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, -1)


def _q_mxfp4(x: np.ndarray) -> np.ndarray:
    # Shared exponent floor(log2(amax)) - 2 (so amax lands in the top codes), biased by 127.
    amax = np.abs(x).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        lg = np.floor(np.log2(amax, dtype=np.float32))
    e = np.where(amax > 0, lg - 2 + 127, 0).astype(np.int32).astype(np.uint8)
    codes = _nearest_e2m1(x, e8m0_half(e))
    return pack_blocks(MXFP4, x.shape[0], e=e, qs=_pack_fp4(codes, 32))


def f32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml's float -> UE4M3 byte: clamp to 448, round the mantissa on its 4th bit (halves up); subnormals by
    ``x * 512 + 0.5`` truncated; non-positive (and NaN) to 0; overflow to 0x7E."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    pos = x > 0
    xc = np.where(pos, np.minimum(x, np.float32(448)), np.float32(1))
    bits = xc.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7
    man = ((bits >> 20) & 7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    carry = man > 7
    man = np.where(carry, 0, man)
    exp = exp + carry
    normal = np.where(exp >= 15, 0x7E, (exp << 3) | man)
    sub = np.minimum((xc * np.float32(512) + np.float32(0.5)).astype(np.int32), 7)
    sub = np.where(sub < 1, 0, sub)
    # The subnormal branch is chosen from the exponent before any carry.
    first_exp = ((bits >> 23) & 0xFF).astype(np.int32) - 120
    res = np.where(first_exp <= 0, sub, np.where(first_exp >= 15, 0x7E, normal))
    return np.where(pos, res, 0).astype(np.uint8)


def _q_nvfp4(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 4, 16)
    amax = np.abs(sub).max(axis=2)
    ue = f32_to_ue4m3(amax / np.float32(6))
    codes = _nearest_e2m1(sub, UE4M3_HALF[ue][:, :, None]).reshape(n, 64)
    return pack_blocks(NVFP4, n, d=ue, qs=_pack_fp4(codes, 16))


def _ternary(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """TQ1_0/TQ2_0: d = max |x| and the trits round(x / d) + 1 (C lroundf: halves away from zero)."""
    d = np.abs(x).max(axis=1, keepdims=True)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return d, (round_away(x * inv) + 1).astype(np.int32)


def _pack_trits(t: np.ndarray) -> np.ndarray:
    """(n, digits, bytes) trits, most significant first, to bytes ceil(v * 256 / 243) (v padded to 5 digits)."""
    v = np.zeros(t.shape[::2], dtype=np.int32)
    for k in range(t.shape[1]):  # at most 5 digits: a loop over digit positions, not over data
        v = v * 3 + t[:, k]
    v = v * 3 ** (5 - t.shape[1])
    return ((v * 256 + 242) // 243).astype(np.uint8)


def _q_tq1_0(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, t = _ternary(x)
    qs = np.concatenate((_pack_trits(t[:, 0:160].reshape(n, 5, 32)), _pack_trits(t[:, 160:240].reshape(n, 5, 16))),
                        axis=1)
    return pack_blocks(TQ1_0, n, qs=qs, qh=_pack_trits(t[:, 240:256].reshape(n, 4, 4)), d=to_half_bytes(d))


def _q_tq2_0(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, t = _ternary(x)
    q = (t & 3).astype(np.uint8).reshape(n, 2, 4, 32) << SHIFT2[None, None, :, None]
    return pack_blocks(TQ2_0, n, qs=np.bitwise_or.reduce(q, axis=2).reshape(n, 64), d=to_half_bytes(d))


#: Twice the midpoints between neighbouring IQ4_NL levels: a value x takes level k once 2x reaches the k-th.
_IQ4NL_MID2 = (IQ4NL_LEVELS[:-1].astype(np.float32) + IQ4NL_LEVELS[1:].astype(np.float32))


def iq4_index(v: np.ndarray) -> np.ndarray:
    """Index of the IQ4_NL level nearest each value, ties to the upper one (exact: compares 2v with sums)."""
    return np.searchsorted(_IQ4NL_MID2, v + v, side="right").astype(np.uint8)


def _iq4_fit(xb: np.ndarray, w: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sum w*q*x and sum w*q*q (left to right, float32) with q the levels picked for ``inv * x``."""
    q = _IQ4NL_F[iq4_index(inv * xb)]
    wq = w * q
    return _seq_sum3(wq * xb), _seq_sum3(wq * q)


def _seq_sum3(v: np.ndarray) -> np.ndarray:
    return np.cumsum(v, axis=-1, dtype=np.float32)[..., -1]


def _q_iq4_xs(x: np.ndarray) -> np.ndarray:
    # ggml's IQ4_XS quantiser (no importance weights: w = x^2): per sub-block of 32 a scale searched over 15
    # candidates (-max/-127 shifted by -7..7 levels), then one f16 super-scale d = -max_scale / 32 and 6-bit
    # sub-scales rounded to it; the codes are re-picked with the rounded sub-scales.
    n = x.shape[0]
    xb = x.reshape(n, 8, 32)
    w = xb * xb
    mx = signed_absmax(xb.reshape(n * 8, 32)).reshape(n, 8)
    live = np.abs(mx) >= np.float32(1e-15)
    safe = np.where(live, mx, np.float32(1))
    d0 = -safe / np.float32(-127)
    sumqx, sumq2 = _iq4_fit(xb, w, (np.float32(1) / d0)[:, :, None])
    d = np.divide(sumqx, sumq2, out=np.zeros_like(sumqx), where=sumq2 > 0)
    best = d * sumqx
    for itry in range(-7, 8):  # 15 candidate scales, each evaluated for every block at once
        inv = (np.float32(itry) + np.float32(-127)) / safe
        sqx, sq2 = _iq4_fit(xb, w, inv[:, :, None])
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = np.where(better, sqx / np.where(sq2 > 0, sq2, np.float32(1)), d)
        best = np.where(better, d * sqx, best)
    scales = np.where(live, d, np.float32(0))
    max_scale = signed_absmax(scales)  # (n, 1): the sub-scale of largest magnitude, first on ties
    dsup = -max_scale / np.float32(32)
    inv_sup = np.divide(np.float32(1), dsup, out=np.zeros_like(dsup), where=dsup != 0)
    ls = np.clip(np.rint(inv_sup * scales), -32, 31)
    dl = dsup * ls
    idl = np.divide(np.float32(1), dl, out=np.zeros_like(dl), where=dl != 0)
    codes = iq4_index(idl[:, :, None] * xb)  # (n, 8, 32)
    ls = (ls + 32).astype(np.uint8)
    high = (ls >> 4).astype(np.uint16) << (2 * np.arange(8)).astype(np.uint16)
    low = ls & 0x0F
    return pack_blocks(IQ4_XS, n, d=to_half_bytes(dsup),
                       scales_h=np.bitwise_or.reduce(high, axis=1).astype("<u2").view(np.uint8).reshape(n, 2),
                       scales_l=low[:, 0::2] | (low[:, 1::2] << 4),
                       qs=_pack_nibbles(codes.reshape(n * 8, 32)).reshape(n, 128))


QUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    Q4_0: _q_q4_0,
    Q4_1: _q_q4_1,
    Q5_0: _q_q5_0,
    Q5_1: _q_q5_1,
    Q8_0: _q_q8_0,
    Q8_1: _q_q8_1,
    Q8_K: _q_q8_k,
    IQ4_NL: _q_iq4_nl,
    IQ4_XS: _q_iq4_xs,
    TQ1_0: _q_tq1_0,
    TQ2_0: _q_tq2_0,
    MXFP4: _q_mxfp4,
    NVFP4: _q_nvfp4,
    Q1_0: _q_q1_0,
    Q2_0: _q_q2_0,
    Q2_K: quantize_q2_k,
    Q3_K: quantize_q3_k,
    Q4_K: quantize_q4_k,
    Q5_K: quantize_q5_k,
    Q6_K: quantize_q6_k,
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


