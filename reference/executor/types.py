"""ggml element types: vectorised dequantisation of every readable type and quantisation of the writable ones.

Block layouts and rounding rules are those of ggml's reference quantisers (``ggml-quants.c``); every function works
on whole arrays of blocks at once.  Blocks arrive as uint8 arrays of shape ``(..., n_blocks, type_size)`` and
decode to float32 arrays of shape ``(..., n_blocks * blck)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ggml_rpc.spec import TYPES, GgmlType, type_name
from ggml_rpc.spec.blocks import BLOCK_FIELDS, pack_blocks

from ..graph import ExecutorError
from .kquant import quantize_q2_k, quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k

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
IQ4_XS = int(GgmlType.IQ4_XS)
TQ1_0 = int(GgmlType.TQ1_0)
TQ2_0 = int(GgmlType.TQ2_0)
MXFP4 = int(GgmlType.MXFP4)
NVFP4 = int(GgmlType.NVFP4)
Q1_0 = int(GgmlType.Q1_0)
Q2_0 = int(GgmlType.Q2_0)
F32 = int(GgmlType.F32)
F16 = int(GgmlType.F16)
BF16 = int(GgmlType.BF16)

#: The 16 non-linear levels of IQ4_NL.
IQ4NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
#: The 16 E2M1 (FP4) code points of the OCP microscaling spec, doubled so they are integers (ggml stores them so and
#: halves the block scale instead): codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 their negatives.
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)

# ---- small helpers ---------------------------------------------------------------------------------------------


def _half(b: np.ndarray, field: slice) -> np.ndarray:
    """The little-endian f16 field of every block, as float32 of shape (n, 1)."""
    return np.ascontiguousarray(b[:, field]).view("<f2").astype(np.float32)


_L = BLOCK_FIELDS


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
    f = _L[Q4_0]
    q = _low_high(b[:, f["qs"]]).view(np.int8)
    q -= 8
    return np.multiply(q, _half(b, f["d"]), dtype=np.float32)


def _dq_q4_1(b: np.ndarray) -> np.ndarray:
    f = _L[Q4_1]
    return _low_high(b[:, f["qs"]]) * _half(b, f["d"]) + _half(b, f["m"])


def _q5_values(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh_bytes).view("<u4")  # (n, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return _low_high(qs) | high


def _dq_q5_0(b: np.ndarray) -> np.ndarray:
    f = _L[Q5_0]
    q = _q5_values(b[:, f["qh"]], b[:, f["qs"]]).astype(np.int8) - np.int8(16)
    return q * _half(b, f["d"])


def _dq_q5_1(b: np.ndarray) -> np.ndarray:
    f = _L[Q5_1]
    return _q5_values(b[:, f["qh"]], b[:, f["qs"]]) * _half(b, f["d"]) + _half(b, f["m"])


def _dq_q8_0(b: np.ndarray) -> np.ndarray:
    f = _L[Q8_0]
    return b[:, f["qs"]].view(np.int8) * _half(b, f["d"])


def _dq_q8_1(b: np.ndarray) -> np.ndarray:
    f = _L[Q8_1]
    return b[:, f["qs"]].view(np.int8) * _half(b, f["d"])


def _dq_iq4_nl(b: np.ndarray) -> np.ndarray:
    f = _L[IQ4_NL]
    return IQ4NL_LEVELS[_low_high(b[:, f["qs"]])] * _half(b, f["d"])


def _dq_q8_k(b: np.ndarray) -> np.ndarray:
    f = _L[Q8_K]
    d = np.ascontiguousarray(b[:, f["d"]]).view("<f4")
    return b[:, f["qs"]].view(np.int8) * d


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
_Q6_HBYTE = 32 * _Q6_N + _Q6_L
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
    f = _L[Q2_K]
    sc = b[:, f["scales"]]
    q = ((b[:, f["qs"]][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(np.float32)
    d, dmin = _half(b, f["d"]), _half(b, f["dmin"])
    mul = np.repeat((sc & 0x0F) * d, 16, axis=1)
    sub = np.repeat((sc >> 4) * dmin, 16, axis=1)
    return q * mul - sub


def _dq_q3_k(b: np.ndarray) -> np.ndarray:
    f = _L[Q3_K]
    s = b[:, f["scales"]]
    k = np.arange(16)
    low = np.where(k < 8, s[:, k % 8] & 0x0F, s[:, k % 8] >> 4)
    high = (s[:, 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    scales = (low | (high << 4)).astype(np.int16) - 32
    q = ((b[:, f["qs"]][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(np.int8)
    hbit = (b[:, f["hmask"]][:, _Q3_HBYTE] >> _Q3_HBIT) & 1
    q = q - np.where(hbit == 0, np.int8(4), np.int8(0))
    return q * np.repeat(scales * _half(b, f["d"]), 16, axis=1)


def _nibble_chunks(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 128 bytes as 4 chunks of 32 low nibbles then 32 high nibbles: (n, 8, 32) uint8."""
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32)
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(chunks[:, :, 0], 0x0F, out=q[:, :, 0])
    np.right_shift(chunks[:, :, 0], 4, out=q[:, :, 1])
    return q.reshape(n, 8, 32)


def _scaled_sub_blocks(q: np.ndarray, b: np.ndarray, f: dict[str, slice]) -> np.ndarray:
    """Q4_K/Q5_K: ``d * scale_j * q - dmin * min_j`` over the 8 sub-blocks of 32: (n, 256) float32."""
    sc, mn = _k_scales_6bit(b[:, f["scales"]])
    scale = (sc * _half(b, f["d"]))[:, :, None]
    offset = (mn * _half(b, f["dmin"]))[:, :, None]
    out = np.multiply(q, scale, dtype=np.float32)
    out -= offset
    return out.reshape(q.shape[0], 256)


def _dq_q4_k(b: np.ndarray) -> np.ndarray:
    f = _L[Q4_K]
    return _scaled_sub_blocks(_nibble_chunks(np.ascontiguousarray(b[:, f["qs"]])), b, f)


def _dq_q5_k(b: np.ndarray) -> np.ndarray:
    f = _L[Q5_K]
    q = _nibble_chunks(np.ascontiguousarray(b[:, f["qs"]]))
    # Sub-block j takes bit j of each of the 32 qh bytes as its fifth bit.
    high = (b[:, f["qh"]][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q |= high << 4
    return _scaled_sub_blocks(q, b, f)


def _dq_q6_k(b: np.ndarray) -> np.ndarray:
    f = _L[Q6_K]
    low = (b[:, f["ql"]][:, _Q6_LBYTE] >> _Q6_LSHIFT) & 0x0F
    high = (b[:, f["qh"]][:, _Q6_HBYTE] >> _Q6_HSHIFT) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = b[:, f["scales"]].view(np.int8) * _half(b, f["d"])
    return q * np.repeat(scales, 16, axis=1)


# ---- 1-bit, 2-bit, ternary, FP4 and IQ4_XS blocks -------------------------------------------------------------

_BIT8 = np.arange(8, dtype=np.uint8)
_SHIFT2 = (2 * np.arange(4)).astype(np.uint8)


def _bits_lsb_first(qs: np.ndarray) -> np.ndarray:
    """Bit ``j % 8`` of byte ``j // 8``, for every bit: (n, 8 * bytes) uint8 of 0/1."""
    return ((qs[:, :, None] >> _BIT8) & 1).reshape(qs.shape[0], -1)


def _crumbs_lsb_first(qs: np.ndarray) -> np.ndarray:
    """The 2-bit field ``j % 4`` of byte ``j // 4``, for every field: (n, 4 * bytes) uint8."""
    return ((qs[:, :, None] >> _SHIFT2) & 3).reshape(qs.shape[0], -1)


def _dq_q1_0(b: np.ndarray) -> np.ndarray:
    # A set bit is +d, a clear one -d.
    f = _L[Q1_0]
    d = _half(b, f["d"])
    return np.where(_bits_lsb_first(b[:, f["qs"]]) != 0, d, -d)


def _dq_q2_0(b: np.ndarray) -> np.ndarray:
    # Codes 0..3 are -1, 0, +1, +2 times d (the quantiser only emits the first three for ternary weights).
    f = _L[Q2_0]
    return (_crumbs_lsb_first(b[:, f["qs"]]).astype(np.int8) - np.int8(1)) * _half(b, f["d"])


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """An E8M0 exponent byte as 2^(e - 127) / 2 (the half that pairs with the doubled E2M1 codes), exact."""
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)


def _ue4m3_table() -> np.ndarray:
    # Unsigned E4M3 (bias 7, 3 mantissa bits, bit 7 ignored), halved like e8m0_half; 0x00 and 0x7F read as 0.
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 7
    raw = np.where(exp == 0, np.ldexp(man.astype(np.float64), -9), np.ldexp(1 + man / 8, exp - 7))
    raw[(x == 0) | (x == 0x7F)] = 0
    return (raw * 0.5).astype(np.float32)


UE4M3_HALF = _ue4m3_table()


def _fp4_nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Groups of ``group`` codes in ``group / 2`` bytes: low nibbles first, then high ones: (n, 2 * bytes) uint8."""
    n = qs.shape[0]
    g = qs.reshape(n, -1, group // 2)
    return np.concatenate((g & 0x0F, g >> 4), axis=2).reshape(n, -1)


def _dq_mxfp4(b: np.ndarray) -> np.ndarray:
    f = _L[MXFP4]
    return E2M1_DOUBLED[_fp4_nibbles(b[:, f["qs"]], 32)] * e8m0_half(b[:, f["e"]])


def _dq_nvfp4(b: np.ndarray) -> np.ndarray:
    # Four sub-blocks of 16, each with its own UE4M3 scale.
    f = _L[NVFP4]
    vals = E2M1_DOUBLED[_fp4_nibbles(b[:, f["qs"]], 16)].reshape(-1, 4, 16)
    return (vals * UE4M3_HALF[b[:, f["d"]]][:, :, None]).reshape(-1, 64)


_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _trits(packed: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` base-3 digits of bytes holding ceil(v * 256 / 243) (most significant first):
    (n, count, bytes) uint8 of 0..2.  Multiplying by 3^k wraps the byte so the k-th digit lands on top."""
    q = packed[:, None, :] * _POW3[:count, None]  # uint8 arithmetic wraps as ggml's does
    return ((q.astype(np.uint16) * 3) >> 8).astype(np.uint8)


def _dq_tq1_0(b: np.ndarray) -> np.ndarray:
    # 32 bytes of 5 trits (160 values, digit-major), 16 bytes of 5 (80), then 4 bytes of 4 (16).
    n, f = b.shape[0], _L[TQ1_0]
    qs = b[:, f["qs"]]
    parts = (_trits(qs[:, 0:32], 5), _trits(qs[:, 32:48], 5), _trits(b[:, f["qh"]], 4))
    t = np.concatenate([p.reshape(n, -1) for p in parts], axis=1)
    return (t.astype(np.int8) - np.int8(1)) * _half(b, f["d"])


def _dq_tq2_0(b: np.ndarray) -> np.ndarray:
    # Two halves of 32 bytes; within each, field l of byte m is element 32 * l + m.
    n, f = b.shape[0], _L[TQ2_0]
    q = (b[:, f["qs"]].reshape(n, 2, 1, 32) >> _SHIFT2[None, None, :, None]) & 3
    return (q.reshape(n, 256).astype(np.int8) - np.int8(1)) * _half(b, f["d"])


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """The 8 six-bit sub-block scales minus 32: low nibbles from scales_l, high 2 bits from scales_h: (n, 8)."""
    f = _L[IQ4_XS]
    ib = np.arange(8)
    low = (b[:, f["scales_l"]][:, ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F
    sh = np.ascontiguousarray(b[:, f["scales_h"]]).view("<u2")  # (n, 1)
    high = (sh >> (2 * ib).astype(np.uint16)) & 3
    return (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32


def _dq_iq4_xs(b: np.ndarray) -> np.ndarray:
    n, f = b.shape[0], _L[IQ4_XS]
    dl = _half(b, f["d"]) * _iq4_xs_scales(b).astype(np.float32)  # d * (ls - 32), exact in float32
    q = _low_high(np.ascontiguousarray(b[:, f["qs"]]).reshape(n * 8, 16)).reshape(n, 8, 32)
    return (IQ4NL_LEVELS[q] * dl[:, :, None]).reshape(n, 256)


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
    IQ4_XS: _dq_iq4_xs,
    TQ1_0: _dq_tq1_0,
    TQ2_0: _dq_tq2_0,
    MXFP4: _dq_mxfp4,
    NVFP4: _dq_nvfp4,
    Q1_0: _dq_q1_0,
    Q2_0: _dq_q2_0,
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
    return pack_blocks(Q8_0, x.shape[0], d=_to_half_bytes(d), qs=q.view(np.uint8))


def _q_q8_1(x: np.ndarray) -> np.ndarray:
    d, q = _q8_scale(x)
    s = q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32) * d
    return pack_blocks(Q8_1, x.shape[0], d=_to_half_bytes(d), s=_to_half_bytes(s), qs=q.view(np.uint8))


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
    return pack_blocks(Q4_0, x.shape[0], d=_to_half_bytes(d), qs=_pack_nibbles(q))


def _q_q4_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _affine(x, 15)
    return pack_blocks(Q4_1, x.shape[0], d=_to_half_bytes(d), m=_to_half_bytes(m), qs=_pack_nibbles(q))


def _q_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 16)
    return pack_blocks(Q5_0, x.shape[0], d=_to_half_bytes(d), qh=_qh_bits(q), qs=_pack_nibbles(q & 0x0F))


def _q_q5_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _affine(x, 31)
    return pack_blocks(Q5_1, x.shape[0], d=_to_half_bytes(d), m=_to_half_bytes(m), qh=_qh_bits(q),
                       qs=_pack_nibbles(q & 0x0F))


def _q_q8_k(x: np.ndarray) -> np.ndarray:
    mx = _signed_absmax(x)
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
    return pack_blocks(IQ4_NL, x.shape[0], d=_to_half_bytes(d.astype(np.float32)), qs=_pack_nibbles(levels))


def _seq_sum(v: np.ndarray) -> np.ndarray:
    """Row sums added left to right in float32, as ggml's scalar loops add (numpy's pairwise sum differs)."""
    return np.cumsum(v, axis=1, dtype=np.float32)[:, -1:]


def _q_q1_0(x: np.ndarray) -> np.ndarray:
    # d = mean |x|; each bit is the sign (set for x >= 0).
    d = _seq_sum(np.abs(x)) / np.float32(128)
    return pack_blocks(Q1_0, x.shape[0], d=_to_half_bytes(d), qs=np.packbits(x >= 0, axis=1, bitorder="little"))


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """(n, 4 * k) values < 4 to k bytes, value j in bits 2 * (j % 4) of byte j // 4."""
    g = q.reshape(q.shape[0], -1, 4).astype(np.uint8) << _SHIFT2
    return np.bitwise_or.reduce(g, axis=2)


def _q_q2_0(x: np.ndarray) -> np.ndarray:
    # d = max |x|; codes round(x / d) + 1 clamped to 0..3 (halves away from zero, C roundf).
    d = np.abs(x).max(axis=1, keepdims=True)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(round_away(x * inv) + 1, 0, 3)
    return pack_blocks(Q2_0, x.shape[0], d=_to_half_bytes(d), qs=_pack_crumbs(q))


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
    return pack_blocks(TQ1_0, n, qs=qs, qh=_pack_trits(t[:, 240:256].reshape(n, 4, 4)), d=_to_half_bytes(d))


def _q_tq2_0(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, t = _ternary(x)
    q = (t & 3).astype(np.uint8).reshape(n, 2, 4, 32) << _SHIFT2[None, None, :, None]
    return pack_blocks(TQ2_0, n, qs=np.bitwise_or.reduce(q, axis=2).reshape(n, 64), d=_to_half_bytes(d))


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
    mx = _signed_absmax(xb.reshape(n * 8, 32)).reshape(n, 8)
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
    max_scale = _signed_absmax(scales)  # (n, 1): the sub-scale of largest magnitude, first on ties
    dsup = -max_scale / np.float32(32)
    inv_sup = np.divide(np.float32(1), dsup, out=np.zeros_like(dsup), where=dsup != 0)
    ls = np.clip(np.rint(inv_sup * scales), -32, 31)
    dl = dsup * ls
    idl = np.divide(np.float32(1), dl, out=np.zeros_like(dl), where=dl != 0)
    codes = iq4_index(idl[:, :, None] * xb)  # (n, 8, 32)
    ls = (ls + 32).astype(np.uint8)
    high = (ls >> 4).astype(np.uint16) << (2 * np.arange(8)).astype(np.uint16)
    low = ls & 0x0F
    return pack_blocks(IQ4_XS, n, d=_to_half_bytes(dsup),
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


#: The type ggml's CPU backend converts src1 of MUL_MAT to before the dot products, per weight type.
VEC_DOT_TYPE: dict[int, int] = {
    F32: F32,
    F16: F16,
    BF16: BF16,
    Q4_0: Q8_0,
    Q5_0: Q8_0,
    Q8_0: Q8_0,
    IQ4_NL: Q8_0,
    Q1_0: Q8_0,
    Q2_0: Q8_0,
    MXFP4: Q8_0,
    NVFP4: Q8_0,
    Q4_1: Q8_1,
    Q5_1: Q8_1,
    Q2_K: Q8_K,
    Q3_K: Q8_K,
    Q4_K: Q8_K,
    Q5_K: Q8_K,
    Q6_K: Q8_K,
    IQ4_XS: Q8_K,
    TQ1_0: Q8_K,
    TQ2_0: Q8_K,
}

#: Quantised types the executor reads (dequantises) as tensor sources: every weight type with a dequantiser
#: (Q8_1 and Q8_K are only ever activations inside ggml's dot products).
READ_QUANTS: tuple[int, ...] = tuple(t for t in DEQUANT if t not in (Q8_1, Q8_K))
#: Quantised types the executor writes (CPY / SET_ROWS destinations): those ggml's CPU backend quantises to.
WRITE_QUANTS: tuple[int, ...] = tuple(t for t in QUANT if t not in (Q8_1, Q8_K))


def through_type(type_id: int, x: np.ndarray) -> np.ndarray:
    """``x`` (float32, last axis a multiple of the block size) as it reads back after being stored as ``type_id``."""
    if type_id == F32:
        return x
    if type_id == F16:
        return x.astype(np.float16).astype(np.float32)
    if type_id == BF16:
        return bf16_to_f32(f32_to_bf16(x))
    if type_id in (Q8_0, Q8_1):
        return _through_q8(x)
    return dequantize(type_id, quantize(type_id, x))


def _through_q8(x: np.ndarray) -> np.ndarray:
    """``x`` through Q8_0 (or Q8_1: the same codes and scale) without packing blocks: every activation row of a
    quantised matmul goes this way, so the bytes are skipped; the values are those of quantize + dequantize."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d, q = _q8_scale(flat)
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape)
