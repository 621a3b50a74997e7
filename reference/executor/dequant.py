"""Vectorised dequantisation of every readable ggml block type: uint8 blocks ``(..., n_blocks, type_size)`` to
float32 ``(..., n_blocks * blck)``, each function on whole arrays of blocks at once (ggml-quants.c's rules)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ggml_rpc.spec import TYPES, type_name

from ..graph import ExecutorError
from .formats import (
    E2M1_DOUBLED,
    IQ4_NL,
    IQ4_XS,
    IQ4NL_LEVELS,
    LAYOUT,
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
    half_field,
    low_high,
)
from .grids import GRID_DEQUANT

# ---- dequantisation (blocks (n, size) -> (n, blck)) ------------------------------------------------------------


def _dq_q4_0(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q4_0]
    q = low_high(b[:, f["qs"]]).view(np.int8)
    q -= 8
    return np.multiply(q, half_field(b, f["d"]), dtype=np.float32)


def _dq_q4_1(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q4_1]
    return low_high(b[:, f["qs"]]) * half_field(b, f["d"]) + half_field(b, f["m"])


def _q5_values(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh_bytes).view("<u4")  # (n, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return low_high(qs) | high


def _dq_q5_0(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q5_0]
    q = _q5_values(b[:, f["qh"]], b[:, f["qs"]]).astype(np.int8) - np.int8(16)
    return q * half_field(b, f["d"])


def _dq_q5_1(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q5_1]
    return _q5_values(b[:, f["qh"]], b[:, f["qs"]]) * half_field(b, f["d"]) + half_field(b, f["m"])


def _dq_q8_0(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q8_0]
    return b[:, f["qs"]].view(np.int8) * half_field(b, f["d"])


def _dq_q8_1(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q8_1]
    return b[:, f["qs"]].view(np.int8) * half_field(b, f["d"])


def _dq_iq4_nl(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[IQ4_NL]
    return IQ4NL_LEVELS[low_high(b[:, f["qs"]])] * half_field(b, f["d"])


def _dq_q8_k(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q8_K]
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
    f = LAYOUT[Q2_K]
    sc = b[:, f["scales"]]
    q = ((b[:, f["qs"]][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(np.float32)
    d, dmin = half_field(b, f["d"]), half_field(b, f["dmin"])
    mul = np.repeat((sc & 0x0F) * d, 16, axis=1)
    sub = np.repeat((sc >> 4) * dmin, 16, axis=1)
    return q * mul - sub


def _dq_q3_k(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q3_K]
    s = b[:, f["scales"]]
    k = np.arange(16)
    low = np.where(k < 8, s[:, k % 8] & 0x0F, s[:, k % 8] >> 4)
    high = (s[:, 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    scales = (low | (high << 4)).astype(np.int16) - 32
    q = ((b[:, f["qs"]][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(np.int8)
    hbit = (b[:, f["hmask"]][:, _Q3_HBYTE] >> _Q3_HBIT) & 1
    q = q - np.where(hbit == 0, np.int8(4), np.int8(0))
    return q * np.repeat(scales * half_field(b, f["d"]), 16, axis=1)


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
    scale = (sc * half_field(b, f["d"]))[:, :, None]
    offset = (mn * half_field(b, f["dmin"]))[:, :, None]
    out = np.multiply(q, scale, dtype=np.float32)
    out -= offset
    return out.reshape(q.shape[0], 256)


def _dq_q4_k(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q4_K]
    return _scaled_sub_blocks(_nibble_chunks(np.ascontiguousarray(b[:, f["qs"]])), b, f)


def _dq_q5_k(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q5_K]
    q = _nibble_chunks(np.ascontiguousarray(b[:, f["qs"]]))
    # Sub-block j takes bit j of each of the 32 qh bytes as its fifth bit.
    high = (b[:, f["qh"]][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q |= high << 4
    return _scaled_sub_blocks(q, b, f)


def _dq_q6_k(b: np.ndarray) -> np.ndarray:
    f = LAYOUT[Q6_K]
    low = (b[:, f["ql"]][:, _Q6_LBYTE] >> _Q6_LSHIFT) & 0x0F
    high = (b[:, f["qh"]][:, _Q6_HBYTE] >> _Q6_HSHIFT) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = b[:, f["scales"]].view(np.int8) * half_field(b, f["d"])
    return q * np.repeat(scales, 16, axis=1)


# ---- 1-bit, 2-bit, ternary, FP4 and IQ4_XS blocks -------------------------------------------------------------

_BIT8 = np.arange(8, dtype=np.uint8)


def _bits_lsb_first(qs: np.ndarray) -> np.ndarray:
    """Bit ``j % 8`` of byte ``j // 8``, for every bit: (n, 8 * bytes) uint8 of 0/1."""
    return ((qs[:, :, None] >> _BIT8) & 1).reshape(qs.shape[0], -1)


def _crumbs_lsb_first(qs: np.ndarray) -> np.ndarray:
    """The 2-bit field ``j % 4`` of byte ``j // 4``, for every field: (n, 4 * bytes) uint8."""
    return ((qs[:, :, None] >> SHIFT2) & 3).reshape(qs.shape[0], -1)


def _dq_q1_0(b: np.ndarray) -> np.ndarray:
    # A set bit is +d, a clear one -d.
    f = LAYOUT[Q1_0]
    d = half_field(b, f["d"])
    return np.where(_bits_lsb_first(b[:, f["qs"]]) != 0, d, -d)


def _dq_q2_0(b: np.ndarray) -> np.ndarray:
    # Codes 0..3 are -1, 0, +1, +2 times d (the quantiser only emits the first three for ternary weights).
    f = LAYOUT[Q2_0]
    return (_crumbs_lsb_first(b[:, f["qs"]]).astype(np.int8) - np.int8(1)) * half_field(b, f["d"])


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
    f = LAYOUT[MXFP4]
    return E2M1_DOUBLED[_fp4_nibbles(b[:, f["qs"]], 32)] * e8m0_half(b[:, f["e"]])


def _dq_nvfp4(b: np.ndarray) -> np.ndarray:
    # Four sub-blocks of 16, each with its own UE4M3 scale.
    f = LAYOUT[NVFP4]
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
    n, f = b.shape[0], LAYOUT[TQ1_0]
    qs = b[:, f["qs"]]
    parts = (_trits(qs[:, 0:32], 5), _trits(qs[:, 32:48], 5), _trits(b[:, f["qh"]], 4))
    t = np.concatenate([p.reshape(n, -1) for p in parts], axis=1)
    return (t.astype(np.int8) - np.int8(1)) * half_field(b, f["d"])


def _dq_tq2_0(b: np.ndarray) -> np.ndarray:
    # Two halves of 32 bytes; within each, field l of byte m is element 32 * l + m.
    n, f = b.shape[0], LAYOUT[TQ2_0]
    q = (b[:, f["qs"]].reshape(n, 2, 1, 32) >> SHIFT2[None, None, :, None]) & 3
    return (q.reshape(n, 256).astype(np.int8) - np.int8(1)) * half_field(b, f["d"])


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """The 8 six-bit sub-block scales minus 32: low nibbles from scales_l, high 2 bits from scales_h: (n, 8)."""
    f = LAYOUT[IQ4_XS]
    ib = np.arange(8)
    low = (b[:, f["scales_l"]][:, ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F
    sh = np.ascontiguousarray(b[:, f["scales_h"]]).view("<u2")  # (n, 1)
    high = (sh >> (2 * ib).astype(np.uint16)) & 3
    return (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32


def _dq_iq4_xs(b: np.ndarray) -> np.ndarray:
    n, f = b.shape[0], LAYOUT[IQ4_XS]
    dl = half_field(b, f["d"]) * _iq4_xs_scales(b).astype(np.float32)  # d * (ls - 32), exact in float32
    q = low_high(np.ascontiguousarray(b[:, f["qs"]]).reshape(n * 8, 16)).reshape(n, 8, 32)
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
    # The IQ grid types, whose codebooks come from an installed upstream build (they refuse without one).
    **GRID_DEQUANT,
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


