"""ggml element types: ids, level tables, the block field helpers and the float formats the (de)quantisers share.

Block layouts come from :mod:`ggml_rpc.spec.blocks`; :mod:`.dequant` decodes blocks, :mod:`.quant` encodes them,
and :mod:`.types` puts them together (vec-dot types, round trips).
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlType
from ggml_rpc.spec.blocks import BLOCK_FIELDS

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


def half_field(b: np.ndarray, field: slice) -> np.ndarray:
    """The little-endian f16 field of every block, as float32 of shape (n, 1)."""
    return np.ascontiguousarray(b[:, field]).view("<f2").astype(np.float32)


LAYOUT = BLOCK_FIELDS


def low_high(qs: np.ndarray) -> np.ndarray:
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


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per row, the value with the largest magnitude (first one on ties), shape (n, 1)."""
    idx = np.argmax(np.abs(x), axis=1)
    return np.take_along_axis(x, idx[:, None], axis=1)


def to_half_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2").view(np.uint8).reshape(v.shape[0], 2)


# ---- float formats ---------------------------------------------------------------------------------------------


#: The float32 value of every F16 bit pattern (a lookup instead of a conversion, and the inputs of ggml's F16 tables).
HALVES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


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


#: Bit shifts of the four 2-bit fields of a byte.
SHIFT2 = (2 * np.arange(4)).astype(np.uint8)


