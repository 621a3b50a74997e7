"""ggml element types as the executor uses them: which vec-dot type a weight type's matmul converts activations
to, which types are read and written, and values as they read back after being stored as a type.

The codecs live in :mod:`.dequant` and :mod:`.quant` (block layouts from :mod:`ggml_rpc.spec.blocks`); their public
names are re-exported here.
"""

from __future__ import annotations

import numpy as np

from ..graph import ExecutorError
from .dequant import DEQUANT, UE4M3_HALF, dequantize, e8m0_half
from .formats import (
    BF16,
    E2M1_DOUBLED,
    F16,
    F32,
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
    TQ1_0,
    TQ2_0,
    bf16_to_f32,
    f32_to_bf16,
    round_away,
)
from .grids import GRID_TYPES
from .quant import QUANT, _q8_scale, f32_to_ue4m3, iq4_index, nearest_level, quantize

#: Re-exported: the executor's kernels and the tests name the codecs through this module.
__all__ = [
    "BF16", "DEQUANT", "E2M1_DOUBLED", "F16", "F32", "IQ4NL_LEVELS", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4", "Q1_0",
    "Q2_0", "Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K", "QUANT",
    "READ_QUANTS", "TQ1_0", "TQ2_0", "UE4M3_HALF", "VEC_DOT_TYPE", "WRITE_QUANTS", "ExecutorError", "bf16_to_f32",
    "dequantize", "e8m0_half", "f32_to_bf16", "f32_to_ue4m3", "iq4_index", "nearest_level", "q8_1_sum_error",
    "quantize", "round_away", "through_type",
]

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
    # IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S: ggml's CPU backend dots them with Q8_K activations too.
    **dict.fromkeys(GRID_TYPES, Q8_K),
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


def q8_1_sum_error(x: np.ndarray) -> np.ndarray:
    """Per Q8_1 block of ``x`` (float32, last axis a multiple of 32): ggml's stored block sum ``s`` (FP16 of the
    unrounded scale times the codes' sum) minus the block sum :func:`through_type` implies (FP16 scale times the same
    sum).  A Q4_1/Q5_1 dot product adds ``min * s`` per block, so this times the weights' block mins is all that
    separates dequantised weights times :func:`through_type` activations from ggml's product."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d, q = _q8_scale(flat)
    total = q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32)
    stored = (total * d).astype(np.float16).astype(np.float32)
    implied = d.astype(np.float16).astype(np.float32) * total  # exact: 11 by at most 13 significant bits
    return (stored - implied).reshape(*x.shape[:-1], x.shape[-1] // 32)


def _through_q8(x: np.ndarray) -> np.ndarray:
    """``x`` through Q8_0 (or Q8_1: the same codes and scale) without packing blocks: every activation row of a
    quantised matmul goes this way, so the bytes are skipped; the values are those of quantize + dequantize."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d, q = _q8_scale(flat)
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape)
